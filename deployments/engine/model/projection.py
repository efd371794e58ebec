"""Projection: the linears of one layer that read the same input (q/k/v, gate/up, or one alone), with their
LoRA deltas, computed together.

Picked once at load, each part on its own:
- **fused base** (CUDA, plain linears): the members share one concatenated weight, so q/k/v is one GEMM and
  gate/up another; their own `weight` becomes a view of it (no second copy).
- **group LoRA** (CUDA with Triton): the members' adapter slots live in one concatenated A [slots, in,
  members x rank] and one B [slots, rank, total out], so the group's adapters cost one launch, shrink and
  expand fused (gpu_kernels/lora_delta.py); with a quantized base, whose members write separate outputs,
  one launch per member. Each
  member's `lora_a`/`lora_b` become views of those buffers: adapter loads still write through
  `MultiLoRALinear.load_slot`, in place, so a captured CUDA graph that reads them stays valid when a slot
  changes.
- **nf4 bases** (CUDA with Triton): a member whose base is a bitsandbytes nf4 `Linear4bit` runs our
  Triton NF4 GEMM on the module's own packed weights (nf4_base.py) instead of the module's forward, which
  at batch > 1 dequantizes the whole weight to 16 bits and then multiplies.
- **one fused linear** (Phi-3's qkv_proj, gate_up_proj): a single member whose output is cut into `splits`
  (q, k, v; gate, up) after its LoRA delta is added, so its adapter is PEFT's one A and one B, unsplit.
- otherwise (CPU) each member runs as its module does (base, then its own LoRA kernel from the step's
  LoRAContext), which keeps the CPU kernel's speed.
"""

from typing import Any

import torch
from torch import nn

from deployments.engine.model.lora_kernels import LoRABatch
from deployments.engine.model.lora_layers import MultiLoRALinear
from deployments.engine.model.nf4_base import NF4Base


class Projection:
    def __init__(
        self,
        members: list[nn.Module],
        *,
        fuse_base: bool,
        group_lora: bool,
        nf4_kernel: bool = False,
        splits: tuple[int, ...] | None = None,
    ) -> None:
        self.members = members
        # The outputs' widths: one per member, or the cuts of one fused member's output (fused_linears.py).
        self.splits = None if splits is None else list(splits)
        # Per member: our kernel in place of its base's forward, or None (the module runs itself).
        self.kernels = [NF4Base.of(_base(m)) if nf4_kernel else None for m in members]
        self.widths = [_out_features(m) for m in members]
        self.weight: torch.Tensor | None = None
        self.bias: torch.Tensor | None = None
        self.lora_a: torch.Tensor | None = None
        self.lora_b: torch.Tensor | None = None
        wrapped = [isinstance(m, MultiLoRALinear) for m in members]
        # Every member an adapter target or none (the usual case); a mixed group runs per member.
        if len(set(wrapped)) == 1:
            if fuse_base and all(type(_base(m)) is nn.Linear for m in members):
                self._fuse_base()
            if group_lora and wrapped[0]:
                self._fuse_lora()

    @property
    def fused(self) -> bool:
        return self.weight is not None

    def __call__(self, x: torch.Tensor, lora: LoRABatch | None) -> list[torch.Tensor]:
        """Each output [T, out_i] (views of one [T, sum(out)] tensor when fused), adapters included."""
        if self.weight is not None:
            y = self.whole(x, lora)
            widths = self.splits or self.widths
            return [y] if len(widths) == 1 else list(torch.split(y, widths, dim=-1))
        if self.lora_a is None:
            outs = [self._member(i, x) for i in range(len(self.members))]
        else:
            outs = [self._base_out(i, x) for i in range(len(self.members))]  # quantized bases, then deltas
            if lora is not None:
                self._member_lora(x, outs, lora)
        return outs if self.splits is None else list(torch.split(outs[0], self.splits, dim=-1))

    def whole(self, x: torch.Tensor, lora: LoRABatch | None) -> torch.Tensor:
        """The fused group's output [T, sum(out)], adapters included."""
        assert self.weight is not None, "only a fused projection has one output"
        y = torch.nn.functional.linear(x, self.weight, self.bias)
        if lora is not None and self.lora_a is not None:
            self._fused_lora(x, y, lora)
        return y

    def _base_out(self, i: int, x: torch.Tensor) -> torch.Tensor:
        kernel = self.kernels[i]
        return _base(self.members[i])(x) if kernel is None else kernel(x)

    def _member(self, i: int, x: torch.Tensor) -> torch.Tensor:
        """Member i's output with its own adapters (the module's LoRAContext kernel)."""
        member = self.members[i]
        if self.kernels[i] is None:
            out: torch.Tensor = member(x)
            return out
        y = self._base_out(i, x)
        return member.add_lora(x, y) if isinstance(member, MultiLoRALinear) else y

    def _fused_lora(self, x: torch.Tensor, y: torch.Tensor, lora: LoRABatch) -> None:
        from deployments.engine.model.gpu_kernels.lora_delta import lora_delta

        assert self.lora_a is not None and self.lora_b is not None
        lora_delta(x, self.lora_a, self.lora_b, lora.offsets, y, splits=tuple(self.widths), **_runs(lora))

    def _member_lora(self, x: torch.Tensor, outs: list[torch.Tensor], lora: LoRABatch) -> None:
        """Each member's output is its own base's tensor: one launch per member, each reading only its
        own R columns of the group's A."""
        from deployments.engine.model.gpu_kernels.lora_delta import lora_delta

        assert self.lora_a is not None and self.lora_b is not None
        rank = self.lora_b.shape[1]
        at = 0
        for i, (y, width) in enumerate(zip(outs, self.widths, strict=True)):
            a = self.lora_a[:, :, i * rank : (i + 1) * rank]
            b = self.lora_b[:, :, at : at + width]
            lora_delta(x, a, b, lora.offsets, y, splits=(width,), **_runs(lora))
            at += width

    def _fuse_base(self) -> None:
        bases = [_base(m) for m in self.members]
        weights: list[torch.Tensor] = [b.weight for b in bases]  # type: ignore[misc]
        self.weight = torch.cat([w.detach() for w in weights])  # [sum(out), in]
        if any(b.bias is not None for b in bases):
            self.bias = torch.cat(
                [
                    b.bias.detach() if isinstance(b.bias, torch.Tensor) else torch.zeros_like(w[:, 0])
                    for b, w in zip(bases, weights, strict=True)
                ]
            )
        at = 0
        for base, width in zip(bases, self.widths, strict=True):  # members keep views: no second copy
            base.weight = nn.Parameter(self.weight[at : at + width], requires_grad=False)
            if self.bias is not None and base.bias is not None:
                base.bias = nn.Parameter(self.bias[at : at + width], requires_grad=False)
            at += width

    def _fuse_lora(self) -> None:
        members = [m for m in self.members if isinstance(m, MultiLoRALinear)]
        first = members[0]
        slots, fan_in, rank = first.lora_a.shape
        dtype, device = first.lora_a.dtype, first.lora_a.device
        self.lora_a = torch.zeros(slots, fan_in, rank * len(members), dtype=dtype, device=device)
        self.lora_b = torch.zeros(slots, rank, sum(self.widths), dtype=dtype, device=device)
        at = 0
        for i, (member, width) in enumerate(zip(members, self.widths, strict=True)):
            a = self.lora_a[:, :, i * rank : (i + 1) * rank]
            b = self.lora_b[:, :, at : at + width]
            a.copy_(member.lora_a)
            b.copy_(member.lora_b)
            member.lora_a = a  # views: load_slot writes into the group's buffers
            member.lora_b = b
            at += width


def _base(module: nn.Module) -> nn.Module:
    return module.base if isinstance(module, MultiLoRALinear) else module


def _out_features(module: nn.Module) -> int:
    if isinstance(module, MultiLoRALinear):
        return module.out_features
    return int(getattr(module, "out_features"))  # noqa: B009  (quantized linears have no .weight shape)


def _runs(lora: LoRABatch) -> dict[str, Any]:
    """The Triton kernel reads adapters wider than a page as runs (its `runs` on the device, the widest a
    fixed bound, so a graph captured once replays any layout); with one page per adapter, the plain kernel."""
    if lora.max_pages == 1 or lora.runs is None:
        return {}
    return {"runs": lora.runs, "max_pages": lora.max_pages}
