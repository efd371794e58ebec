"""BaseModelLayout: the linear modules of a base model that an adapter may target, with their shapes.

torch and transformers are imported when a layout is built, not with this module: the spec and the store
import it, and the registry uses those without loading a model stack.
"""

from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from torch import nn
    from transformers import PretrainedConfig

DEFAULT_TARGET_NAMES: frozenset[str] = frozenset(
    {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "qkv_proj", "gate_up_proj"}
)  # qkv_proj, gate_up_proj: Phi-3's fused linears


def module_suffix(module_path: str) -> str:
    """Last component of a module path: "model.layers.0.self_attn.q_proj" -> "q_proj"."""
    return module_path.rsplit(".", 1)[-1]


@dataclass(frozen=True)
class BaseModelLayout:
    """Linear modules keyed by their `named_modules()` path, mapped to (in_features, out_features)."""

    modules: dict[str, tuple[int, int]]
    num_layers: int

    @classmethod
    def from_config(
        cls, config: "PretrainedConfig", *, target_names: Iterable[str] = DEFAULT_TARGET_NAMES
    ) -> "BaseModelLayout":
        """Instantiate the architecture on the meta device: exact module names, any model, no weights read."""
        import torch
        from transformers import AutoModelForCausalLM

        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config)  # type: ignore[no-untyped-call]
        return cls.from_model(model, target_names=target_names)

    @classmethod
    def from_model_dir(
        cls, path: Path, *, target_names: Iterable[str] = DEFAULT_TARGET_NAMES
    ) -> "BaseModelLayout":
        from transformers import AutoConfig

        return cls.from_config(AutoConfig.from_pretrained(path), target_names=target_names)

    @classmethod
    def from_model(
        cls, model: "nn.Module", *, target_names: Iterable[str] = DEFAULT_TARGET_NAMES
    ) -> "BaseModelLayout":
        """Read `in_features`/`out_features`: quantized layers keep them while their weights are packed."""
        names = frozenset(target_names)
        modules: dict[str, tuple[int, int]] = {}
        for path, module in model.named_modules():
            if module_suffix(path) not in names:
                continue
            in_features = getattr(module, "in_features", None)
            out_features = getattr(module, "out_features", None)
            if isinstance(in_features, int) and isinstance(out_features, int):
                modules[path] = (in_features, out_features)
        return cls(modules=modules, num_layers=_num_layers(model))

    @property
    def suffixes(self) -> frozenset[str]:
        return frozenset(module_suffix(path) for path in self.modules)


def _num_layers(model: "nn.Module") -> int:
    from transformers import PretrainedConfig

    config = getattr(model, "config", None)
    if isinstance(config, PretrainedConfig):
        layers = getattr(config.get_text_config(), "num_hidden_layers", None)
        if isinstance(layers, int):
            return layers
    raise ValueError(
        f"cannot tell the number of layers of {type(model).__name__}: no config.num_hidden_layers"
    )
