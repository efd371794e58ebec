"""Writing an adapter into its pages: the exact page contents, and one copy call for every module."""

import torch
from torch import nn
from torch.profiler import ProfilerActivity, profile

from adapters.spec import AdapterSpec
from adapters.weights import AdapterWeights, LoRAModuleWeights
from deployments.engine.model.lora_layers import (
    LoRAContext,
    MultiLoRALinear,
    load_adapter_into_slot,
    prepare_pages,
)

PAGE_RANK = 8
PAGES = 6


def modules() -> dict[str, MultiLoRALinear]:
    gen = torch.Generator().manual_seed(0)
    out: dict[str, MultiLoRALinear] = {}
    for path, (in_f, out_f) in {"q": (16, 24), "v": (16, 8), "o": (24, 16)}.items():
        module = MultiLoRALinear(
            nn.Linear(in_f, out_f, bias=False), in_features=in_f, out_features=out_f, pages=PAGES,
            page_rank=PAGE_RANK, dtype=torch.float32, device=torch.device("cpu"), context=LoRAContext(),
        )  # fmt: skip
        module.lora_a.normal_(generator=gen)  # an earlier adapter's pages: a load must overwrite them all
        module.lora_b.normal_(generator=gen)
        out[path] = module
    return out


def adapter(ranks: dict[str, int]) -> AdapterWeights:
    gen = torch.Generator().manual_seed(1)
    sizes = {"q": (16, 24), "v": (16, 8), "o": (24, 16)}
    spec = AdapterSpec(
        r=max(ranks.values()), lora_alpha=max(ranks.values()), target_modules=tuple(sorted(ranks))
    )
    return AdapterWeights(
        spec,
        {
            path: LoRAModuleWeights(
                torch.randn(r, sizes[path][0], generator=gen), torch.randn(sizes[path][1], r, generator=gen)
            )
            for path, r in ranks.items()
        },
    )


def expected_run(weights: AdapterWeights | None, path: str, module: MultiLoRALinear, pages: int):
    """A [pages, in, page_rank] and B [pages, page_rank, out] as the run should hold them."""
    a = torch.zeros(pages * PAGE_RANK, module.in_features)
    b = torch.zeros(module.out_features, pages * PAGE_RANK)
    w = None if weights is None else weights.modules.get(path)
    if w is not None:
        a[: w.rank] = w.a
        b[:, : w.rank] = w.b
    return (
        a.reshape(pages, PAGE_RANK, module.in_features).transpose(1, 2),
        b.t().reshape(pages, PAGE_RANK, module.out_features),
    )


def test_a_load_writes_every_page_of_its_run_and_nothing_else() -> None:
    mods = modules()
    before = {path: (m.lora_a.clone(), m.lora_b.clone()) for path, m in mods.items()}
    weights = adapter({"q": 12, "v": 3})  # "o" untargeted: zeros; q's second page and v's first padded
    slot, pages = 2, 3  # a run wider than the adapter's own pages (2): its third page is zeros too
    load_adapter_into_slot(mods, slot, pages, weights)
    for path, module in mods.items():
        want_a, want_b = expected_run(weights, path, module, pages)
        assert torch.equal(module.lora_a[slot : slot + pages], want_a), path
        assert torch.equal(module.lora_b[slot : slot + pages], want_b), path
        outside = [p for p in range(PAGES) if not slot <= p < slot + pages]
        assert torch.equal(module.lora_a[outside], before[path][0][outside]), path
        assert torch.equal(module.lora_b[outside], before[path][1][outside]), path
    load_adapter_into_slot(mods, slot, pages, None)  # cleared: zeros, and only there
    for path, module in mods.items():
        want_a, want_b = expected_run(None, path, module, pages)
        assert torch.equal(module.lora_a[slot : slot + pages], want_a), path
        assert torch.equal(module.lora_b[slot : slot + pages], want_b), path


def test_the_page_views_follow_buffers_replaced_by_to() -> None:
    mods = modules()
    module = mods["q"]
    module.to(torch.float64)  # replaces the buffers: cached page views of the old ones would write nowhere
    module.to(torch.float32)
    weights = adapter({"q": 8})
    load_adapter_into_slot(mods, 0, 1, weights)
    want_a, want_b = expected_run(weights, "q", module, 1)
    assert torch.equal(module.lora_a[:1], want_a) and torch.equal(module.lora_b[:1], want_b)


def test_a_load_prepared_off_the_engine_thread_is_one_copy_call() -> None:
    """Each torch op gives the GIL up, and under a busy neighbour thread taking it back waits the switch
    interval: a load of four ops per module took tens of milliseconds inside busy steps."""
    mods = modules()
    weights = adapter({"q": 12, "v": 3, "o": 16})
    prepare_pages(weights, PAGE_RANK)  # what the adapter tiers' loader does as it reads an adapter
    load_adapter_into_slot(mods, 0, 2, None)  # the page views are cached by a first use
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        load_adapter_into_slot(mods, 0, 2, weights)
    top = [e.name for e in prof.events() if e.name.startswith("aten::") and e.cpu_parent is None]
    assert top == ["aten::_foreach_copy_"]
    want_a, want_b = expected_run(weights, "o", mods["o"], 2)
    assert torch.equal(mods["o"].lora_a[:2], want_a) and torch.equal(mods["o"].lora_b[:2], want_b)
