"""MultiLoRALinear: base(x) plus each token's own adapter delta, for a whole mixed batch at once.

Every wrapped linear owns adapter memory as `pages` pages of `page_rank` rank units (A columns, B rows), with
`scaling` already folded into B. An adapter of rank r takes ceil(r / page_rank) consecutive pages, its slot
being the first, the last padded with zeros (so padding adds nothing); adapter memory thus holds the sum of
the resident ranks, not a count of max-rank slots (S-LoRA's unified paging, with runs instead of scattered
pages: the kernels keep reading one page per segment). The model runner orders a step's tokens by slot
(base-model tokens last), so each slot's tokens are one contiguous segment and the delta is a segmented
(SGMV-like) matmul over each adapter's run of pages; lora_kernels.py picks the implementation for the device
and dtype.
MLP linears never see forward kwargs, so all layers read the step's segments from one shared LoRAContext
that the engine owns (no module-level global: two engines in one process stay independent).
"""

from collections.abc import Iterator

import torch
from torch import nn

from adapters.weights import AdapterWeights
from deployments.engine.model.lora_kernels import LoRABatch, LoRAKernel, loop_kernel


class LoRAContext:
    """Per-engine holder of the current step's LoRABatch, shared by every MultiLoRALinear."""

    def __init__(self) -> None:
        self.batch: LoRABatch | None = None
        self.kernel_name: str = "loop"
        self.kernel: LoRAKernel = loop_kernel


class MultiLoRALinear(nn.Module):
    def __init__(
        self,
        base: nn.Module,
        *,
        in_features: int,
        out_features: int,
        pages: int,
        page_rank: int,
        dtype: torch.dtype,
        device: torch.device,
        context: LoRAContext,
    ) -> None:
        super().__init__()
        self.page_rank = page_rank
        self.base = base
        self.in_features = in_features
        self.out_features = out_features
        # Layouts chosen for grouped_mm (mat_b is [groups, K, N]); no transposes in the hot path.
        self.register_buffer("lora_a", torch.zeros(pages, in_features, page_rank, dtype=dtype, device=device))
        self.register_buffer(
            "lora_b", torch.zeros(pages, page_rank, out_features, dtype=dtype, device=device)
        )
        self.lora_a: torch.Tensor
        self.lora_b: torch.Tensor
        self._context = context

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.add_lora(x, self.base(x))

    def add_lora(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """y (the base's output for x) plus the step's adapters' deltas."""
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
        self._context.kernel(y2, x2, self.lora_a, self.lora_b, batch)
        return y

    @torch.no_grad()
    def load_slot(self, slot: int, pages: int, a: torch.Tensor | None, b: torch.Tensor | None) -> None:
        """Write one adapter's A [r, in] and B [out, r] (scaled) into the `pages` pages from `slot` on; None
        clears them. r <= pages x page_rank."""
        run = slice(slot, slot + pages)
        self.lora_a[run].zero_()
        self.lora_b[run].zero_()
        if a is None or b is None:
            return
        r, width = a.shape[0], self.page_rank
        assert r <= pages * width, f"rank {r} does not fit {pages} pages of {width}"
        for page, first in enumerate(range(0, r, width)):
            last = min(r, first + width)
            self.lora_a[slot + page, :, : last - first].copy_(a[first:last].t(), non_blocking=True)
            self.lora_b[slot + page, : last - first, :].copy_(b[:, first:last].t(), non_blocking=True)


def wrap_lora_modules(
    model: nn.Module,
    *,
    targets: tuple[str, ...],
    pages: int,
    page_rank: int,
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
            pages=pages,
            page_rank=page_rank,
            dtype=dtype,
            device=device,
            context=context,
        )
        model.set_submodule(name, wrapper)
        wrapped[name] = wrapper
    return wrapped


def load_adapter_into_slot(
    modules: dict[str, MultiLoRALinear], slot: int, pages: int, weights: AdapterWeights | None
) -> None:
    """Write an adapter into the `pages` pages from `slot` on in every wrapped module (modules it does not
    target get zeros)."""
    for path, module in modules.items():
        w = None if weights is None else weights.modules.get(path)
        module.load_slot(slot, pages, None if w is None else w.a, None if w is None else w.b)


def pages_for_rank(rank: int, page_rank: int) -> int:
    return max(1, -(-rank // page_rank))


def iter_lora_modules(model: nn.Module) -> Iterator[MultiLoRALinear]:
    return (m for m in model.modules() if isinstance(m, MultiLoRALinear))
