"""DecoderForward: our forward for Llama-shaped decoders (Llama, Mistral, Qwen2), on the HF model's weights.

HF's forward spends most of a small batch's step in Python: decorators, keyword plumbing, output classes,
a dozen ops per RMSNorm and rotary. Ours walks the same modules' weights with the step's tensors only:
embed -> per layer [norm, q/k/v projection, rotary + KV write, paged attention, o projection, residual + norm,
gate/up projection, SiLU x up, down projection] -> final norm of the kept rows -> lm_head. The arithmetic
is HF's, op for op (TorchOps); on CUDA each elementwise step is one fused kernel (TritonOps), q/k/v and
gate/up are one GEMM each with one LoRA shrink and expand per group (projection.py), and no step of the
forward depends on a tensor's value on the host, so a decode step can be captured in a CUDA graph.

Other architectures keep HF's forward (`HFForward`), with our paged attention inside it.
"""

import logging
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from transformers import PreTrainedModel

from deployments.engine.model.attention import METADATA_KWARG, attend
from deployments.engine.model.kv_cache import KVCache
from deployments.engine.model.layer_ops import LayerOps
from deployments.engine.model.projection import Projection
from deployments.engine.model.step_inputs import StepInputs

log = logging.getLogger(__name__)
FAMILY = ("llama", "mistral", "qwen2")


@dataclass(slots=True)
class _Layer:
    input_norm: torch.Tensor
    input_eps: float
    post_norm: torch.Tensor
    post_eps: float
    qkv: Projection
    o: Projection
    gate_up: Projection
    down: Projection
    num_heads: int
    num_kv_heads: int
    head_dim: int
    scale: float
    sliding_window: int | None


def unsupported_reason(model: PreTrainedModel) -> str | None:
    """Why our forward cannot run this model (None: it can)."""
    config = model.config
    kind = getattr(config, "model_type", None)
    if kind not in FAMILY:
        return f"model_type {kind!r} is not one of {FAMILY}"
    if getattr(config, "hidden_act", "silu") != "silu":
        return f"hidden_act {config.hidden_act!r}"
    rotary = getattr(getattr(model, "model", None), "rotary_emb", None)
    if rotary is None:
        return "no rotary embedding module"
    if getattr(rotary, "rope_type", "default") == "dynamic":
        return "dynamic RoPE scaling (its frequencies change with the sequence length)"
    if int(getattr(config, "pretraining_tp", 1) or 1) != 1:
        return "pretraining_tp > 1"
    return None


class DecoderForward:
    name = "decoder"

    def __init__(
        self,
        model: PreTrainedModel,
        kv_cache: KVCache,
        ops: LayerOps,
        *,
        fuse: bool,
        group_lora: bool,
        max_positions: int,
        nf4_kernel: bool = False,
    ) -> None:
        self.ops = ops
        self.kv_cache = kv_cache
        inner: Any = model.model  # LlamaModel / MistralModel / Qwen2Model
        config = model.config
        self.embed: nn.Embedding = inner.embed_tokens
        self.final_norm = inner.norm.weight
        self.final_eps = float(inner.norm.variance_epsilon)
        self.lm_head: nn.Module = model.lm_head
        device = self.final_norm.device
        dtype = self.embed.weight.dtype
        # RoPE as HF computes it per step, for every position once: the same float ops per element.
        positions = torch.arange(max_positions, device=device)[None]
        probe = torch.empty(1, dtype=dtype, device=device)
        with torch.inference_mode():
            cos, sin = inner.rotary_emb(probe, positions)
        self.cos, self.sin = cos[0].contiguous(), sin[0].contiguous()  # [max_positions, D]

        def group(*members: nn.Module) -> Projection:
            return Projection(list(members), fuse_base=fuse, group_lora=group_lora, nf4_kernel=nf4_kernel)

        mistral_window = getattr(config, "sliding_window", None) if config.model_type == "mistral" else None
        self.layers = []
        for layer in inner.layers:
            attn, mlp = layer.self_attn, layer.mlp
            heads = int(config.num_attention_heads)
            self.layers.append(
                _Layer(
                    input_norm=layer.input_layernorm.weight,
                    input_eps=float(layer.input_layernorm.variance_epsilon),
                    post_norm=layer.post_attention_layernorm.weight,
                    post_eps=float(layer.post_attention_layernorm.variance_epsilon),
                    qkv=group(attn.q_proj, attn.k_proj, attn.v_proj),
                    o=group(attn.o_proj),
                    gate_up=group(mlp.gate_proj, mlp.up_proj),
                    down=group(mlp.down_proj),
                    num_heads=heads,
                    num_kv_heads=int(getattr(config, "num_key_value_heads", None) or heads),
                    head_dim=int(attn.head_dim),
                    scale=float(attn.scaling),
                    sliding_window=mistral_window or getattr(attn, "sliding_window", None),
                )
            )

    @torch.inference_mode()
    def __call__(self, step: StepInputs) -> torch.Tensor:
        """Logits [N, V] in the model dtype for the kept rows (every row of a decode step)."""
        ops, meta, lora = self.ops, step.attention, step.lora
        paged = ops.paged_decode_attention if ops.paged_decode else None
        paged_prefill = ops.paged_prefill_attention if ops.paged_prefill else None
        hidden = self.embed(step.input_ids)  # [T, hidden]
        residual: torch.Tensor | None = None
        for i, layer in enumerate(self.layers):
            if residual is None:
                x, residual = ops.rms_norm(hidden, layer.input_norm, layer.input_eps), hidden
            else:
                x, residual = ops.add_rms_norm(hidden, residual, layer.input_norm, layer.input_eps)
            t = x.shape[0]
            q, k, v = layer.qkv(x, lora)
            q = q.view(t, layer.num_heads, layer.head_dim)
            k = k.view(t, layer.num_kv_heads, layer.head_dim)
            v = v.view(t, layer.num_kv_heads, layer.head_dim)
            k_cache, v_cache = self.kv_cache.layers[i]
            ops.rotary_and_cache(
                q, k, v, self.cos, self.sin, step.positions, step.slot_mapping, k_cache, v_cache
            )
            attn = attend(
                q, k, v, k_cache, v_cache, meta, scale=layer.scale, window=layer.sliding_window, paged=paged,
                paged_prefill=paged_prefill,
            )  # fmt: skip
            (hidden,) = layer.o(attn.reshape(t, -1), lora)
            x, residual = ops.add_rms_norm(hidden, residual, layer.post_norm, layer.post_eps)
            if layer.gate_up.fused:  # gate and up are the two halves of one output: one kernel
                act = ops.silu_and_mul(layer.gate_up.whole(x, lora))
            else:
                gate, up = layer.gate_up(x, lora)
                act = F.silu(gate) * up
            (hidden,) = layer.down(act, lora)
        assert residual is not None
        if step.logits_index is not None:  # only the rows whose logits are kept reach the final norm
            hidden = hidden.index_select(0, step.logits_index)
            residual = residual.index_select(0, step.logits_index)
        normed, _ = ops.add_rms_norm(hidden, residual, self.final_norm, self.final_eps)
        logits: torch.Tensor = self.lm_head(normed)
        return logits


class HFForward:
    """HF's own forward with our paged attention inside (models DecoderForward does not cover)."""

    name = "hf"

    def __init__(self, model: PreTrainedModel) -> None:
        self.model = model

    @torch.inference_mode()
    def __call__(self, step: StepInputs) -> torch.Tensor:
        logits_to_keep: Any = step.logits_index
        if logits_to_keep is None:
            logits_to_keep = 0  # every row
        out = self.model(
            input_ids=step.input_ids[None],
            position_ids=step.positions[None],
            use_cache=False,
            logits_to_keep=logits_to_keep,
            **{METADATA_KWARG: step.attention},
        )
        logits: torch.Tensor = out.logits[0]
        return logits
