"""The elementwise and attention operations of our decoder forward, per device.

`TorchOps` is plain torch with HF's exact arithmetic (the CPU path, and the reference the kernels are tested
against). `TritonOps` (CUDA) replaces each with one fused kernel from `gpu_kernels/`: a decode layer is then
a fixed, short list of launches that a CUDA graph replays. Both read and write the same tensors, so the
forward is written once.
"""

from typing import Protocol

import torch
import torch.nn.functional as F


class LayerOps(Protocol):
    name: str
    paged_decode: bool  # decode attention reads the block tables directly (no gathered context)
    paged_prefill: bool  # a general step's chunks attend in one launch (the step is built as StepChunks)

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor: ...

    def add_rms_norm(
        self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(rms_norm(x + residual), x + residual): HF's `residual + hidden` then the next norm."""
        ...

    def rotary_and_cache(
        self,
        q: torch.Tensor,  # [T, H, D], rotated in place
        k: torch.Tensor,  # [T, Hkv, D], rotated in place
        v: torch.Tensor,  # [T, Hkv, D]
        cos: torch.Tensor,  # [max_pos, D] in the model dtype
        sin: torch.Tensor,
        positions: torch.Tensor,  # [T] int64
        slot_mapping: torch.Tensor,  # [T] int64
        k_cache: torch.Tensor,  # [slots, Hkv, D]
        v_cache: torch.Tensor,
    ) -> None: ...

    def unit_offset_rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """Gemma's RMSNorm: the fp32 normed x times `weight`, HF's fp32 (1 + w), then x's dtype."""
        ...

    def add_unit_offset_rms_norm(
        self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]: ...

    def silu_and_mul(self, gate_up: torch.Tensor) -> torch.Tensor: ...

    def gelu_tanh_and_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """GeGLU with HF's `gelu_pytorch_tanh` (Gemma): gelu(gate, approximate="tanh") * up."""
        ...

    def paged_decode_attention(
        self,
        q: torch.Tensor,  # [B, H, D]
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        block_tables: torch.Tensor,  # [B, W] int32
        context_lens: torch.Tensor,  # [B] int32
        *,
        block_size: int,
        scale: float,
        sliding_window: int | None,
        out: torch.Tensor,  # [B, H, D]
    ) -> None: ...

    def paged_prefill_attention(
        self,
        q: torch.Tensor,  # [T, H, D]
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        *,
        query_start: torch.Tensor,  # [N] int64: each chunk's rows in q ...
        query_len: torch.Tensor,  # [N]
        context_len: torch.Tensor,  # [N] ... are its last positions
        block_tables: torch.Tensor,  # [N, W]
        block_size: int,
        scale: float,
        sliding_window: int | None,
        out: torch.Tensor,  # [T, H, D]
    ) -> None: ...


class TorchOps:
    """HF LlamaRMSNorm / Gemma3RMSNorm / apply_rotary_pos_emb / SiLU- and GELU-gated MLP arithmetic, op for
    op."""

    name = "torch"
    paged_decode = False  # decode attention gathers each context and runs SDPA (attention.py)
    paged_prefill = False  # one SDPA call per prefill span, the reference the kernel is tested against

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        h = x.to(torch.float32)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
        return weight * h.to(x.dtype)

    def add_rms_norm(
        self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        summed = residual + x
        return self.rms_norm(summed, weight, eps), summed

    def unit_offset_rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
        return (h * weight).type_as(x)

    def add_unit_offset_rms_norm(
        self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        summed = residual + x
        return self.unit_offset_rms_norm(summed, weight, eps), summed

    def rotary_and_cache(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        positions: torch.Tensor,
        slot_mapping: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
    ) -> None:
        c = cos.index_select(0, positions)[:, None, :]  # [T, 1, D]
        s = sin.index_select(0, positions)[:, None, :]
        q.copy_(q * c + _rotate_half(q) * s)
        k.copy_(k * c + _rotate_half(k) * s)
        k_cache.index_copy_(0, slot_mapping, k)
        v_cache.index_copy_(0, slot_mapping, v)

    def silu_and_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate) * up

    def gelu_tanh_and_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        gate, up = gate_up.chunk(2, dim=-1)
        return F.gelu(gate, approximate="tanh") * up

    def paged_decode_attention(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        block_tables: torch.Tensor,
        context_lens: torch.Tensor,
        *,
        block_size: int,
        scale: float,
        sliding_window: int | None,
        out: torch.Tensor,
    ) -> None:
        raise NotImplementedError("TorchOps gathers decode contexts (attention.decode_attention)")

    def paged_prefill_attention(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        *,
        query_start: torch.Tensor,
        query_len: torch.Tensor,
        context_len: torch.Tensor,
        block_tables: torch.Tensor,
        block_size: int,
        scale: float,
        sliding_window: int | None,
        out: torch.Tensor,
    ) -> None:
        raise NotImplementedError("TorchOps attends per prefill span (attention.attend)")


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class TritonOps(TorchOps):
    """One fused Triton kernel per operation (CUDA), Gemma's (1 + w) norms and GeGLU included. Imported only
    on CUDA machines (and by tests, through Triton's interpreter on CPU)."""

    name = "triton"
    paged_decode = True
    paged_prefill = True

    def __init__(self) -> None:
        from deployments.engine.model.gpu_kernels import (
            activation,
            paged_attention,
            prefill_attention,
            rms_norm,
            rotary_cache,
        )

        self._rms = rms_norm
        self._rotary = rotary_cache
        self._act = activation
        self._attn = paged_attention
        self._prefill = prefill_attention
        self._tables: dict[int, torch.Tensor] = {}  # id(cos) -> the kernel's [max_pos, 2, D] cos/sin table

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        out = self._rms.rms_norm(x, weight, eps)
        assert isinstance(out, torch.Tensor)
        return out

    def add_rms_norm(
        self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        out = self._rms.rms_norm(x, weight, eps, residual=residual)
        assert isinstance(out, tuple)
        return out[0], out[1]

    def unit_offset_rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        out = self._rms.rms_norm(x, weight, eps, unit_offset=True)
        assert isinstance(out, torch.Tensor)
        return out

    def add_unit_offset_rms_norm(
        self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        out = self._rms.rms_norm(x, weight, eps, residual=residual, unit_offset=True)
        assert isinstance(out, tuple)
        return out[0], out[1]

    def rotary_and_cache(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        positions: torch.Tensor,
        slot_mapping: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
    ) -> None:
        table = self._tables.get(id(cos))
        if table is None:  # built once per model: the forward passes the same tables every step
            table = self._tables[id(cos)] = self._rotary.rotary_table(cos, sin)
        self._rotary.rotary_and_cache(q, k, v, table, positions, slot_mapping, k_cache, v_cache)

    def silu_and_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self._act.silu_and_mul(gate_up)
        return out

    def gelu_tanh_and_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self._act.gelu_tanh_and_mul(gate_up)
        return out

    def paged_decode_attention(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        block_tables: torch.Tensor,
        context_lens: torch.Tensor,
        *,
        block_size: int,
        scale: float,
        sliding_window: int | None,
        out: torch.Tensor,
    ) -> None:
        self._attn.paged_decode_attention(
            q,
            k_cache,
            v_cache,
            block_tables,
            context_lens,
            block_size=block_size,
            scale=scale,
            sliding_window=sliding_window,
            out=out,
        )

    def paged_prefill_attention(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        *,
        query_start: torch.Tensor,
        query_len: torch.Tensor,
        context_len: torch.Tensor,
        block_tables: torch.Tensor,
        block_size: int,
        scale: float,
        sliding_window: int | None,
        out: torch.Tensor,
    ) -> None:
        self._prefill.paged_prefill_attention(
            q,
            k_cache,
            v_cache,
            query_start=query_start,
            query_len=query_len,
            context_len=context_len,
            block_tables=block_tables,
            block_size=block_size,
            scale=scale,
            sliding_window=sliding_window,
            out=out,
        )


def layer_ops_for(device: torch.device) -> LayerOps:
    """Triton kernels on CUDA when Triton is there; torch everywhere else."""
    if device.type == "cuda":
        try:
            return TritonOps()
        except ImportError:
            pass
    return TorchOps()
