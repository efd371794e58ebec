"""ModelCatalog: the base models this deployment serves, with their tokenizers and context limits.

The `model` field of a request names a base model or an adapter; adapters resolve through the registry
(per tenant) to a base model listed here.
"""

import json
import time
from dataclasses import dataclass, field
from pathlib import Path

from app.prompts import PromptBuilder


@dataclass
class BaseModelEntry:
    name: str
    model_dir: Path
    max_model_len: int
    prompts: PromptBuilder
    created: int = field(default_factory=lambda: int(time.time()))


class ModelCatalog:
    def __init__(self, entries: list[BaseModelEntry]) -> None:
        self._entries = {e.name: e for e in entries}

    @classmethod
    def from_dirs(cls, models: dict[str, tuple[Path, int | None]]) -> "ModelCatalog":
        """name -> (model dir, max_model_len or None to read it from config.json)."""
        entries = []
        for name, (model_dir, max_len) in models.items():
            if max_len is None:
                config = json.loads((model_dir / "config.json").read_text())
                max_len = int(config.get("max_position_embeddings", 2048))
            entries.append(BaseModelEntry(name, model_dir, max_len, PromptBuilder(model_dir)))
        return cls(entries)

    def get(self, name: str) -> BaseModelEntry | None:
        return self._entries.get(name)

    def names(self) -> list[str]:
        return list(self._entries)

    def only(self) -> str | None:
        """The single served base model, if there is exactly one."""
        return next(iter(self._entries)) if len(self._entries) == 1 else None

    def __iter__(self):  # type: ignore[no-untyped-def]
        return iter(self._entries.values())
