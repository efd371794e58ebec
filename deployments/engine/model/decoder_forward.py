"""DecoderForward: our forward for Llama-shaped decoders (Llama, Mistral, Qwen2, Phi-3, Qwen3, Gemma 3 text),
on HF's weights.

HF's forward spends most of a small batch's step in Python: decorators, keyword plumbing, output classes,
a dozen ops per RMSNorm and rotary. Ours walks the same modules' weights with the step's tensors only:
embed -> per layer [norm, q/k/v projection, rotary + KV write, paged attention, o projection, residual + norm,
gate/up projection, SiLU x up, down projection] -> final norm of the kept rows -> lm_head; what a family adds
to that layer (q/k norms, Gemma's norms around attention and MLP, GeGLU, rope tables per layer type) is
described in decoder_families.py. The arithmetic is HF's, op for op (TorchOps); on CUDA each elementwise
step is one fused kernel (TritonOps, every family's norms and activations included), q/k/v and gate/up are
one GEMM each with one LoRA shrink and expand per group (projection.py), and no step of the forward depends
on a tensor's value on the host, so a decode step can be captured in a CUDA graph.

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
from deployments.engine.model.decoder_families import FAMILIES, LayerNorms, activation, family_reason
from deployments.engine.model.fused_linears import LinearGroup, gate_up_group, qkv_group
from deployments.engine.model.kv_cache import KVCache
from deployments.engine.model.layer_ops import LayerOps
from deployments.engine.model.projection import Projection
from deployments.engine.model.step_inputs import StepInputs

log = logging.getLogger(__name__)


@dataclass(slots=True)
class _Layer:
    norms: LayerNorms
    cos: torch.Tensor  # [max_positions, D]: the layer type's rope table
    sin: torch.Tensor
    qkv: Projection
    o: Projection
    gate_up: Projection
    down: Projection
    num_heads: int
    num_kv_heads: int
    head_dim: int
    scale: float
    sliding_window: int | None


def language_model(model: PreTrainedModel) -> Any:
    """The decoder text runs through: the CausalLM's `model`, or a multimodal checkpoint's text tower
    (`gemma3`: Gemma3ForConditionalGeneration's `model.language_model`; text requests never reach the vision
    tower, so its weights stay idle)."""
    inner = getattr(model, "model", None)
    return getattr(inner, "language_model", inner)


def unsupported_reason(model: PreTrainedModel) -> str | None:
    """Why our forward cannot run this model (None: it can)."""
    config = model.config.get_text_config()
    if (reason := family_reason(config)) is not None:
        return reason
    rotary = getattr(language_model(model), "rotary_emb", None)
    if rotary is None:
        return "no rotary embedding module"
    rope = getattr(rotary, "rope_type", "default")
    for kind in rope.values() if isinstance(rope, dict) else [rope]:  # Gemma 3: one per layer type
        if "dynamic" in kind or kind == "longrope":
            return f"{kind} RoPE scaling (its frequencies change with the sequence length)"
    rope = getattr(config, "rope_parameters", None) or {}
    if float(rope.get("partial_rotary_factor", 1.0) if isinstance(rope, dict) else 1.0) != 1.0:
        return "partial rotary embedding (our rotary kernels turn whole heads)"
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
        inner = language_model(model)  # e.g. LlamaModel, Phi3Model, Qwen3Model, Gemma3TextModel
        config = model.config.get_text_config()
        family = FAMILIES[config.model_type]
        self.embed: nn.Embedding = inner.embed_tokens  # Gemma's scales by sqrt(hidden) in its forward
        self.final_norm = family.final_norm(inner.norm)
        self.lm_head: nn.Module = model.lm_head
        # The head's own model decides: Gemma3ForCausalLM caps with its config's value, while a multimodal
        # Gemma3ForConditionalGeneration (whose top-level config has none) does not.
        self.softcap: float | None = getattr(model.config, "final_logit_softcapping", None)
        self.gelu = activation(config) == "gelu_tanh"
        device = inner.norm.weight.device
        dtype = self.embed.weight.dtype
        # RoPE as HF computes it per step, for every position once: the same float ops per element.
        positions = torch.arange(max_positions, device=device)[None]
        probe = torch.empty(1, dtype=dtype, device=device)
        with torch.inference_mode():
            tables = family.rope_tables(inner, config, probe, positions)

        def group(*members: nn.Module, splits: tuple[int, ...] | None = None) -> Projection:
            return Projection(
                list(members), fuse_base=fuse, group_lora=group_lora, nf4_kernel=nf4_kernel, splits=splits
            )

        def grouped(linears: LinearGroup) -> Projection:  # separate linears, or one fused and cut
            return group(*linears.members, splits=linears.splits)

        every_layer_window = config.model_type in ("mistral", "phi3")  # config.sliding_window, all layers
        mistral_window = getattr(config, "sliding_window", None) if every_layer_window else None
        self.layers = []
        for layer, (cos, sin) in zip(inner.layers, tables, strict=True):
            attn, mlp = layer.self_attn, layer.mlp
            heads = int(config.num_attention_heads)
            self.layers.append(
                _Layer(
                    norms=family.layer_norms(layer),
                    cos=cos,
                    sin=sin,
                    qkv=grouped(qkv_group(attn, q_width=heads * int(attn.head_dim))),
                    o=group(attn.o_proj),
                    gate_up=grouped(gate_up_group(mlp)),
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
            norms = layer.norms
            if residual is None:
                x, residual = norms.attention(ops, hidden), hidden
            else:
                x, residual = norms.attention.add(ops, hidden, residual)
            t = x.shape[0]
            q, k, v = layer.qkv(x, lora)
            if norms.q is not None and norms.k is not None:  # per head, over head_dim: rows of [T * H, D]
                q = norms.q(ops, q.reshape(-1, layer.head_dim))
                k = norms.k(ops, k.reshape(-1, layer.head_dim))
            q = q.view(t, layer.num_heads, layer.head_dim)
            k = k.view(t, layer.num_kv_heads, layer.head_dim)
            v = v.view(t, layer.num_kv_heads, layer.head_dim)
            k_cache, v_cache = self.kv_cache.layers[i]
            ops.rotary_and_cache(
                q, k, v, layer.cos, layer.sin, step.positions, step.slot_mapping, k_cache, v_cache
            )
            attn = attend(
                q, k, v, k_cache, v_cache, meta, scale=layer.scale, window=layer.sliding_window, paged=paged,
                paged_prefill=paged_prefill,
            )  # fmt: skip
            (hidden,) = layer.o(attn.reshape(t, -1), lora)
            if norms.attention_out is not None:
                hidden = norms.attention_out(ops, hidden)
            x, residual = norms.mlp.add(ops, hidden, residual)
            (hidden,) = layer.down(self._gated(layer, x, step), lora)
            if norms.mlp_out is not None:
                hidden = norms.mlp_out(ops, hidden)
        assert residual is not None
        if step.logits_index is not None:  # only the rows whose logits are kept reach the final norm
            hidden = hidden.index_select(0, step.logits_index)
            residual = residual.index_select(0, step.logits_index)
        normed, _ = self.final_norm.add(ops, hidden, residual)
        logits: torch.Tensor = self.lm_head(normed)
        if self.softcap is not None:  # Gemma's final_logit_softcapping, as HF's CausalLM applies it
            logits = torch.tanh(logits / self.softcap) * self.softcap
        return logits

    def _gated(self, layer: _Layer, x: torch.Tensor, step: StepInputs) -> torch.Tensor:
        """act(gate) * up: SiLU, or GELU's tanh approximation (Gemma)."""
        if layer.gate_up.fused:  # gate and up are the two halves of one output: one kernel
            gate_up = layer.gate_up.whole(x, step.lora)
            return self.ops.gelu_tanh_and_mul(gate_up) if self.gelu else self.ops.silu_and_mul(gate_up)
        gate, up = layer.gate_up(x, step.lora)
        return (F.gelu(gate, approximate="tanh") if self.gelu else F.silu(gate)) * up


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
