"""MultiLoRALinear: base(x) plus each token's own adapter delta, for a whole mixed batch at once.

Every wrapped linear owns slot tensors holding up to `max_loras` adapters, padded to `max_rank` with zeros
(so padding adds nothing) and with `scaling` already folded into B. The model runner orders a step's
tokens by slot (base-model tokens last), so each slot's tokens are one contiguous segment and the delta is a
segmented (SGMV-like) matmul: `torch._grouped_mm` where it runs, else a loop over the segments present.
MLP linears never see forward kwargs, so all layers read the step's segments from one shared LoRAContext
that the engine owns (no module-level global: two engines in one process stay independent).
"""

from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch import nn

from adapters.weights import AdapterWeights


@dataclass(slots=True)
class LoRABatch:
    """How this step's tokens map to slots. Tokens [0, num_lora_tokens) carry adapters, sorted by slot."""

    num_lora_tokens: int
    offsets: torch.Tensor  # [max_loras] int32, cumulative end of each slot's segment (on the device)
    segments: list[tuple[int, int, int]]  # (slot, start, end) for the non-empty segments, host-side


class LoRAContext:
    """Per-engine holder of the current step's LoRABatch, shared by every MultiLoRALinear."""

    def __init__(self) -> None:
        self.batch: LoRABatch | None = None
        self.use_grouped_mm = False


class MultiLoRALinear(nn.Module):
    def __init__(
        self,
        base: nn.Module,
        *,
        in_features: int,
        out_features: int,
        max_loras: int,
        max_rank: int,
        dtype: torch.dtype,
        device: torch.device,
        context: LoRAContext,
    ) -> None:
        super().__init__()
        self.base = base
        self.in_features = in_features
        self.out_features = out_features
        # Layouts chosen for grouped_mm (mat_b is [groups, K, N]); no transposes in the hot path.
        self.register_buffer(
            "lora_a", torch.zeros(max_loras, in_features, max_rank, dtype=dtype, device=device)
        )
        self.register_buffer(
            "lora_b", torch.zeros(max_loras, max_rank, out_features, dtype=dtype, device=device)
        )
        self.lora_a: torch.Tensor
        self.lora_b: torch.Tensor
        self._context = context

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y: torch.Tensor = self.base(x)
        batch = self._context.batch
        if batch is None or batch.num_lora_tokens == 0:
            return y
        n = batch.num_lora_tokens
        if not y.is_contiguous():  # some quantized kernels return strided outputs
            y = y.contiguous()
        x2 = x.reshape(-1, self.in_features)[:n]  # [n, in]
        y2 = y.view(-1, self.out_features)  # [T, out]
        if x2.dtype != self.lora_a.dtype:  # quantized bases may compute in another dtype
            x2 = x2.to(self.lora_a.dtype)
        if self._context.use_grouped_mm:
            h = torch._grouped_mm(x2, self.lora_a, offs=batch.offsets)  # [n, R]
            delta = torch._grouped_mm(h, self.lora_b, offs=batch.offsets)  # [n, out]
            y2[:n] += delta.to(y2.dtype)
        else:
            for slot, start, end in batch.segments:
                h = x2[start:end] @ self.lora_a[slot]  # [seg, R]
                y2[start:end] += (h @ self.lora_b[slot]).to(y2.dtype)
        return y

    @torch.no_grad()
    def load_slot(self, slot: int, a: torch.Tensor | None, b: torch.Tensor | None) -> None:
        """Write one adapter's A [r, in] and B [out, r] (scaled) into a slot; None clears the slot."""
        self.lora_a[slot].zero_()
        self.lora_b[slot].zero_()
        if a is None or b is None:
            return
        r = a.shape[0]
        self.lora_a[slot, :, :r].copy_(a.t(), non_blocking=True)
        self.lora_b[slot, :r, :].copy_(b.t(), non_blocking=True)


def wrap_lora_modules(
    model: nn.Module,
    *,
    targets: tuple[str, ...],
    max_loras: int,
    max_rank: int,
    dtype: torch.dtype,
    device: torch.device,
    context: LoRAContext,
) -> dict[str, MultiLoRALinear]:
    """Replace every targeted linear with a MultiLoRALinear around it. Call after weights are loaded
    (wrapping renames state_dict keys). Returns path -> wrapper, paths as in the unwrapped model."""
    found = [(name, mod) for name, mod in model.named_modules() if name.rsplit(".", 1)[-1] in targets]
    wrapped: dict[str, MultiLoRALinear] = {}
    for name, module in found:
        in_features = int(getattr(module, "in_features"))  # noqa: B009  (quantized linears have no .weight shape)
        out_features = int(getattr(module, "out_features"))  # noqa: B009
        wrapper = MultiLoRALinear(
            module,
            in_features=in_features,
            out_features=out_features,
            max_loras=max_loras,
            max_rank=max_rank,
            dtype=dtype,
            device=device,
            context=context,
        )
        model.set_submodule(name, wrapper)
        wrapped[name] = wrapper
    return wrapped


def load_adapter_into_slot(
    modules: dict[str, MultiLoRALinear], slot: int, weights: AdapterWeights | None
) -> None:
    """Write an adapter into `slot` of every wrapped module (modules it does not target get zeros)."""
    for path, module in modules.items():
        w = None if weights is None else weights.modules.get(path)
        module.load_slot(slot, None if w is None else w.a, None if w is None else w.b)


def iter_lora_modules(model: nn.Module) -> Iterator[MultiLoRALinear]:
    return (m for m in model.modules() if isinstance(m, MultiLoRALinear))


def probe_grouped_mm(dtype: torch.dtype, device: torch.device) -> bool:
    """Whether torch._grouped_mm runs (and agrees with the segment loop) for this dtype and device.
    CUDA needs sm90+ and bf16 for it; elsewhere torch may fall back or refuse."""
    try:
        gen = torch.Generator(device="cpu").manual_seed(0)
        x = torch.randn(6, 16, generator=gen).to(device=device, dtype=dtype)
        a = torch.randn(3, 16, 8, generator=gen).to(device=device, dtype=dtype)
        offs = torch.tensor([2, 2, 6], dtype=torch.int32, device=device)  # includes an empty group
        got = torch._grouped_mm(x, a, offs=offs)
        want = torch.cat([x[:2] @ a[0], x[2:6] @ a[2]])
        return bool(torch.allclose(got.float(), want.float(), atol=1e-2, rtol=1e-2))
    except (RuntimeError, NotImplementedError, TypeError):
        return False
