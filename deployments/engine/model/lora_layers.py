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

Writing an adapter into its pages is one `torch._foreach_copy_` over every module's pages, from page-shaped
sources prepared off the engine's thread (`prepare_pages`, on the adapter tiers' loader): a torch op
releases the GIL, and taking it back waits for the switch interval (5 ms) while another thread of the
process runs Python (the app's event loop, a Serve replica's), so a load of four small ops per module took
tens of milliseconds inside busy steps where it takes one on an idle process (bench/slot_load.py).
"""

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import cast

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
        self._pages: PageViews | None = None

    def page_views(self) -> "PageViews":
        """Each page of A and B as a view, and a zero page of each (cached until the buffers are replaced,
        e.g. by `.to()`), so a load indexes them instead of slicing at every call."""
        views = self._pages
        if views is None or views.a is not self.lora_a or views.b is not self.lora_b:
            a, b = self.lora_a, self.lora_b
            views = self._pages = PageViews(
                a, b, a.unbind(0), b.unbind(0), torch.zeros_like(a[0]), torch.zeros_like(b[0])
            )
        return views

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
        clears them; r <= pages x page_rank. The engine loads all modules at once: load_adapter_into_slot."""
        own = [] if a is None or b is None else module_pages(a, b, self.page_rank, pin=False)
        assert len(own) <= pages, f"rank {a.shape[0] if a is not None else 0} does not fit {pages} pages"
        dst, src = self._page_copies(slot, pages, own)
        torch._foreach_copy_(dst, src, non_blocking=True)

    def _page_copies(
        self, slot: int, pages: int, own: Sequence[tuple[torch.Tensor, torch.Tensor]]
    ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Destination pages and their sources: the adapter's own pages, then zero pages to the run's end."""
        views = self.page_views()
        dst: list[torch.Tensor] = []
        src: list[torch.Tensor] = []
        for j in range(pages):
            a, b = own[j] if j < len(own) else (views.zero_a, views.zero_b)
            dst += (views.a_pages[slot + j], views.b_pages[slot + j])
            src += (a, b)
        return dst, src


@dataclass(frozen=True, slots=True)
class PageViews:
    """A module's adapter buffers, each page of them as a view, and one zero page of each."""

    a: torch.Tensor
    b: torch.Tensor
    a_pages: tuple[torch.Tensor, ...]  # [in, page_rank] each
    b_pages: tuple[torch.Tensor, ...]  # [page_rank, out] each
    zero_a: torch.Tensor
    zero_b: torch.Tensor


PagedSources = dict[str, list[tuple[torch.Tensor, torch.Tensor]]]  # module path -> its pages' (A, B)


def module_pages(
    a: torch.Tensor, b: torch.Tensor, page_rank: int, *, pin: bool
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """A [r, in] and B [out, r] as page-shaped sources, (A^T [in, page_rank], B^T [page_rank, out]) a page:
    views of full pages, a zero-padded copy of a last partial one (pinned with `pin`, for a device copy)."""
    r = a.shape[0]
    pages: list[tuple[torch.Tensor, torch.Tensor]] = []
    for first in range(0, r, page_rank):
        last = min(r, first + page_rank)
        a_page, b_page = a[first:last].t(), b[:, first:last].t()
        if last - first < page_rank:  # padding: zeros add nothing to the delta
            a_pad = a.new_zeros(a.shape[1], page_rank, pin_memory=pin)
            b_pad = b.new_zeros(page_rank, b.shape[0], pin_memory=pin)
            a_pad[:, : last - first] = a_page
            b_pad[: last - first] = b_page
            a_page, b_page = a_pad, b_pad
        pages.append((a_page, b_page))
    return pages


def prepare_pages(weights: AdapterWeights, page_rank: int, *, pin: bool = False) -> PagedSources:
    """The adapter's page-shaped sources for every module it targets, cached on `weights` (by page rank):
    the adapter tiers call this as they read an adapter, off the engine's thread."""
    cached = weights.page_sources.get(page_rank)
    if cached is None:
        cached = {path: module_pages(w.a, w.b, page_rank, pin=pin) for path, w in weights.modules.items()}
        weights.page_sources[page_rank] = cached
    return cast(PagedSources, cached)


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


@torch.no_grad()
def load_adapter_into_slot(
    modules: dict[str, MultiLoRALinear], slot: int, pages: int, weights: AdapterWeights | None
) -> None:
    """Write an adapter into the `pages` pages from `slot` on in every wrapped module (modules it does not
    target get zeros), or clear them: one copy call for all of them (the module docstring says why)."""
    if not modules:
        return
    page_rank = next(iter(modules.values())).page_rank
    sources: PagedSources = {} if weights is None else prepare_pages(weights, page_rank)
    dst: list[torch.Tensor] = []
    src: list[torch.Tensor] = []
    for path, module in modules.items():
        own = sources.get(path, [])
        assert len(own) <= pages, f"{path}: {len(own)} pages do not fit a run of {pages}"
        d, s = module._page_copies(slot, pages, own)
        dst += d
        src += s
    torch._foreach_copy_(dst, src, non_blocking=True)


def pages_for_rank(rank: int, page_rank: int) -> int:
    return max(1, -(-rank // page_rank))


def iter_lora_modules(model: nn.Module) -> Iterator[MultiLoRALinear]:
    return (m for m in model.modules() if isinstance(m, MultiLoRALinear))
