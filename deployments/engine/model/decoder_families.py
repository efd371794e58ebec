"""The decoder families our forward runs, each described by what sets it apart from Llama's layer.

A family names its norms (Llama's `w * x` RMSNorm, or Gemma's `x * (1 + w)` computed in fp32), whether q and
k are RMS-normed per head before rotary (Qwen3, Gemma 3), whether the attention and MLP outputs are normed
before their residual add (Gemma 3's sandwich), its gated activation, whether each layer type has its own
rope table (Gemma 3: local layers use `rope_local_base_freq`) and a final logit softcap. `decoder_forward.py`
walks the layers with these; everything else (projections, paged attention, LoRA) is shared.
"""

from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch import nn
from transformers import PretrainedConfig

from deployments.engine.model.layer_ops import LayerOps

Activation = Literal["silu", "gelu_tanh"]
_ACTIVATIONS: dict[str, Activation] = {"silu": "silu", "swish": "silu", "gelu_pytorch_tanh": "gelu_tanh"}


@dataclass(frozen=True, slots=True)
class Norm:
    """One RMSNorm as the forward applies it."""

    weight: torch.Tensor  # the module's weight; with unit_offset HF's fp32 `1 + w`, computed once here
    eps: float
    unit_offset: bool

    @classmethod
    def of(cls, module: Any, *, unit_offset: bool) -> "Norm":
        eps = (
            module.variance_epsilon if hasattr(module, "variance_epsilon") else module.eps
        )  # Llama's, Gemma's
        weight: torch.Tensor = module.weight
        if unit_offset:  # Gemma3RMSNorm multiplies by `1.0 + self.weight.float()` each call: the same values
            weight = (1.0 + weight.detach().float()).contiguous()
        return cls(weight, float(eps), unit_offset)

    def __call__(self, ops: LayerOps, x: torch.Tensor) -> torch.Tensor:
        if self.unit_offset:
            return ops.unit_offset_rms_norm(x, self.weight, self.eps)
        return ops.rms_norm(x, self.weight, self.eps)

    def add(
        self, ops: LayerOps, x: torch.Tensor, residual: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(norm(residual + x), residual + x)."""
        if self.unit_offset:
            return ops.add_unit_offset_rms_norm(x, residual, self.weight, self.eps)
        return ops.add_rms_norm(x, residual, self.weight, self.eps)


@dataclass(frozen=True, slots=True)
class LayerNorms:
    attention: Norm  # before attention (input_layernorm)
    mlp: Norm  # before the MLP: Llama's post_attention_layernorm, Gemma's pre_feedforward_layernorm
    q: Norm | None  # per head over head_dim, before rotary (Qwen3, Gemma 3)
    k: Norm | None
    attention_out: Norm | None  # on the attention output before its residual add (Gemma 3)
    mlp_out: Norm | None  # on the MLP output before its residual add (Gemma 3)


@dataclass(frozen=True, slots=True)
class Family:
    unit_offset_norms: bool = False
    qk_norm: bool = False
    sandwich_norms: bool = False
    rope_per_layer_type: bool = False  # the rotary module takes a layer type (Gemma 3's local/global)

    def layer_norms(self, layer: Any) -> LayerNorms:
        def norm(module: nn.Module) -> Norm:
            return Norm.of(module, unit_offset=self.unit_offset_norms)

        attn = layer.self_attn
        return LayerNorms(
            attention=norm(layer.input_layernorm),
            mlp=norm(
                layer.pre_feedforward_layernorm if self.sandwich_norms else layer.post_attention_layernorm
            ),
            q=norm(attn.q_norm) if self.qk_norm else None,
            k=norm(attn.k_norm) if self.qk_norm else None,
            attention_out=norm(layer.post_attention_layernorm) if self.sandwich_norms else None,
            mlp_out=norm(layer.post_feedforward_layernorm) if self.sandwich_norms else None,
        )

    def final_norm(self, module: nn.Module) -> Norm:
        return Norm.of(module, unit_offset=self.unit_offset_norms)

    def rope_tables(
        self, inner: Any, config: PretrainedConfig, probe: torch.Tensor, positions: torch.Tensor
    ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per layer, (cos, sin) [max_positions, D] as HF's rotary module computes them for every position
        once: layers of one type share a table."""
        if not self.rope_per_layer_type:
            cos, sin = inner.rotary_emb(probe, positions)
            table = (cos[0].contiguous(), sin[0].contiguous())
            return [table] * len(inner.layers)
        tables = {}
        for kind in sorted(set(config.layer_types)):
            cos, sin = inner.rotary_emb(probe, positions, kind)
            tables[kind] = (cos[0].contiguous(), sin[0].contiguous())
        return [tables[config.layer_types[i]] for i in range(len(inner.layers))]


FAMILIES: dict[str, Family] = {
    "llama": Family(),
    "mistral": Family(),
    "qwen2": Family(),
    "phi3": Family(),  # fused qkv_proj and gate_up_proj: cut per group by fused_linears.py
    "qwen3": Family(qk_norm=True),
    "gemma3_text": Family(
        unit_offset_norms=True, qk_norm=True, sandwich_norms=True, rope_per_layer_type=True
    ),
}


def activation(config: PretrainedConfig) -> Activation | None:
    """The MLP's gated activation (Gemma names it hidden_activation), None when our forward has not got it."""
    name = getattr(config, "hidden_activation", None) or getattr(config, "hidden_act", "silu")
    return _ACTIVATIONS.get(str(name))


def family_reason(config: PretrainedConfig) -> str | None:
    """Why the family's description does not cover this config (None: it does)."""
    kind = getattr(config, "model_type", None)
    family = FAMILIES.get(str(kind))
    if family is None:
        return f"model_type {kind!r} is not one of {tuple(FAMILIES)}"
    name = getattr(config, "hidden_activation", None) or getattr(config, "hidden_act", "silu")
    if activation(config) is None:
        return f"hidden activation {name!r}"
    if getattr(config, "attn_logit_softcapping", None) is not None:
        return "attention logit softcapping (our attention kernels do not cap scores)"
    if getattr(config, "use_bidirectional_attention", False):
        return "bidirectional attention"
    return None
