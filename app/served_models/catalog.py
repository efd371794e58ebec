"""ModelCatalog: the base models this deployment serves, with their tokenizers, limits and LoRA layout.

The `model` field of a request names a base model or an adapter; adapters resolve through the registry
(per tenant) to a base model listed here.
"""

import json
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path

from adapters.layout import BaseModelLayout
from app.served_models.prompts import PromptBuilder
from deployments.engine.interface import DEFAULT_LORA_TARGETS, DEFAULT_MAX_NUM_SEQS


@dataclass(frozen=True)
class BaseModelSpec:
    """What the ingress must know about a served base model (from its engine's configuration)."""

    model_dir: Path
    max_model_len: int | None = None  # None: the model's own
    max_lora_rank: int = 16
    lora_targets: tuple[str, ...] = DEFAULT_LORA_TARGETS
    max_num_seqs: int = DEFAULT_MAX_NUM_SEQS  # the engine's; also the most sequences one request may run


@dataclass
class BaseModelEntry:
    name: str
    spec: BaseModelSpec
    max_model_len: int
    prompts: PromptBuilder
    created: int = field(default_factory=lambda: int(time.time()))

    @property
    def model_dir(self) -> Path:
        return self.spec.model_dir

    @cached_property
    def layout(self) -> BaseModelLayout:
        """The linear modules adapters may target (built on the meta device, no weights read)."""
        return BaseModelLayout.from_model_dir(
            self.spec.model_dir, target_names=frozenset(self.spec.lora_targets)
        )


class ModelCatalog:
    def __init__(self, entries: list[BaseModelEntry]) -> None:
        self._entries = {e.name: e for e in entries}

    @classmethod
    def from_specs(cls, models: dict[str, BaseModelSpec]) -> "ModelCatalog":
        entries = []
        for name, spec in models.items():
            max_len = spec.max_model_len
            if max_len is None:
                config = json.loads((spec.model_dir / "config.json").read_text())
                max_len = int(config.get("max_position_embeddings", 2048))
            entries.append(BaseModelEntry(name, spec, max_len, PromptBuilder(spec.model_dir)))
        return cls(entries)

    def get(self, name: str) -> BaseModelEntry | None:
        return self._entries.get(name)

    def names(self) -> list[str]:
        return list(self._entries)

    def only(self) -> str | None:
        """The single served base model, if there is exactly one."""
        return next(iter(self._entries)) if len(self._entries) == 1 else None

    def __iter__(self) -> Iterator[BaseModelEntry]:
        return iter(self._entries.values())
