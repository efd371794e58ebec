"""Every multi-LoRA kernel computes the same delta as the plain per-segment reference."""

import random
import threading
import time

import pytest
import torch
from torch import nn

from deployments.engine.model.lora_kernels import (
    LoRABatch,
    _cpu_extension,
    grouped_mm_kernel,
    loop_kernel,
    lora_batch,
    select_kernel,
    sgmv_cpu_kernel,
)
from deployments.engine.model.lora_layers import LoRAContext, MultiLoRALinear, pages_for_rank
from tests.ci import is_ci, missing


def make_batch(lengths: dict[int, int], max_loras: int) -> LoRABatch:
    """Segments in slot order, as the model runner builds them."""
    segments, ends, cursor = [], [], 0
    for slot in range(max_loras):
        n = lengths.get(slot, 0)
        if n:
            segments.append((slot, cursor, cursor + n))
            cursor += n
        ends.append(cursor)
    return LoRABatch(
        num_lora_tokens=cursor,
        offsets=torch.tensor(ends, dtype=torch.int64),  # as StepInputs builds it (its int64 buffer)
        segments=segments,
        segment_table=torch.tensor(segments, dtype=torch.int64).reshape(-1, 3),
    )


KERNELS = {"loop": loop_kernel, "grouped_mm": grouped_mm_kernel, "sgmv_cpu": sgmv_cpu_kernel}


@pytest.mark.parametrize("name", ["grouped_mm", "sgmv_cpu"])
@pytest.mark.parametrize(("dtype", "tol"), [(torch.float32, 1e-4), (torch.bfloat16, 3e-2)])
@pytest.mark.parametrize("case", range(6))
def test_kernel_matches_reference(name: str, dtype: torch.dtype, tol: float, case: int) -> None:
    if name == "sgmv_cpu" and _cpu_extension() is None:
        missing("the native CPU kernel did not build here (the engine falls back to the torch kernels)")
    rnd = random.Random(case)
    # grouped_mm needs 16-byte strides (the engine only picks it then); sgmv_cpu takes any shape.
    max_loras, rank = 6, rnd.choice([8, 16] if name == "grouped_mm" else [3, 8, 16])
    in_f, out_f = rnd.choice([(64, 96), (96, 32), (128, 304)])
    # Decode-like (1-2 tokens per slot), prefill-like (>= 32: the dense path) and mixed; some slots empty.
    lengths = {s: rnd.choice([0, 1, 2, 3, 40]) for s in range(max_loras)}
    lengths[rnd.randrange(max_loras)] = 1
    batch = make_batch(lengths, max_loras)
    gen = torch.Generator().manual_seed(case)
    x = torch.randn(batch.num_lora_tokens, in_f, generator=gen).to(dtype)
    a = (torch.randn(max_loras, in_f, rank, generator=gen) * 0.1).to(dtype)
    b = (torch.randn(max_loras, rank, out_f, generator=gen) * 0.1).to(dtype)
    base = torch.randn(batch.num_lora_tokens + 3, out_f, generator=gen).to(dtype)  # + base-model rows

    want = base.float().clone()
    loop_kernel(want, x.float(), a.float(), b.float(), batch)
    got = base.clone()
    KERNELS[name](got, x, a, b, batch)
    torch.testing.assert_close(got.float(), want, atol=tol * max(1.0, float(want.abs().max())), rtol=tol)
    torch.testing.assert_close(
        got[batch.num_lora_tokens :], base[batch.num_lora_tokens :]
    )  # base rows untouched


@pytest.mark.parametrize("name", ["loop", "grouped_mm", "sgmv_cpu"])
@pytest.mark.parametrize("page_rank", [4, 8, 16])
@pytest.mark.parametrize("case", range(3))
def test_adapters_in_page_runs_equal_each_adapter_alone(name: str, page_rank: int, case: int) -> None:
    """Adapters of mixed ranks written into runs of pages (the last one part zeros) and applied in page
    rounds give each token its own adapter's x A^T B^T, through MultiLoRALinear as the engine calls it."""
    if name == "sgmv_cpu" and _cpu_extension() is None:
        missing("the native CPU kernel did not build here (the engine falls back to the torch kernels)")
    rnd = random.Random(case)
    in_f, out_f = rnd.choice([(64, 96), (96, 32)])
    ranks = [rnd.choice([3, 4, 8, 12, 16]) for _ in range(4)]
    gen = torch.Generator().manual_seed(case)
    context = LoRAContext()
    context.kernel = KERNELS[name]
    base = nn.Linear(in_f, out_f, bias=False)
    module = MultiLoRALinear(
        base, in_features=in_f, out_features=out_f, pages=24, page_rank=page_rank, dtype=torch.float32,
        device=torch.device("cpu"), context=context,
    )  # fmt: skip
    module.lora_a.normal_(generator=gen)  # stale weights of earlier adapters: loads must clear them
    module.lora_b.normal_(generator=gen)
    weights, slots, pages, start = [], [], [], rnd.randrange(3)
    for rank in ranks:
        a = torch.randn(rank, in_f, generator=gen) * 0.1
        b = torch.randn(out_f, rank, generator=gen) * 0.1
        n = pages_for_rank(rank, page_rank)
        module.load_slot(start, n, a, b)
        weights.append((a, b))
        slots.append(start)
        pages.append(n)
        start += n + rnd.randrange(2)  # runs with gaps between them
    lengths = [rnd.choice([1, 2, 40]) for _ in ranks]
    segments, ends, cursor = [], torch.zeros(24, dtype=torch.int64), 0
    for slot, length in zip(slots, lengths, strict=True):
        segments.append((slot, cursor, cursor + length))
        cursor += length
        ends[slot] = length
    x = torch.randn(cursor + 2, in_f, generator=gen)  # two base-model rows last
    context.batch = lora_batch(segments, pages, ends.cumsum(0), cursor)
    got = module(x)
    want = base(x)
    for (_, first, last), (a, b) in zip(segments, weights, strict=True):
        want[first:last] += x[first:last] @ a.t() @ b.t()
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    assert len(context.batch.page_rounds()) == max(pages)


def test_cpu_selects_the_native_kernel_when_it_builds() -> None:
    name, _ = select_kernel(torch.bfloat16, torch.device("cpu"), {64, 128, 16})
    assert name == ("sgmv_cpu" if _cpu_extension() is not None else "grouped_mm")
    if is_ci():  # a broken csrc/sgmv_cpu.cpp must fail CI, not turn into a fallback
        assert name == "sgmv_cpu"


def test_misaligned_shapes_never_get_grouped_mm(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("deployments.engine.model.lora_kernels._cpu_extension", lambda: None)
    assert select_kernel(torch.bfloat16, torch.device("cpu"), {64, 4})[0] == "loop"  # rank 4 = 8 bytes
    assert select_kernel(torch.bfloat16, torch.device("cpu"), {64, 16})[0] == "grouped_mm"


def test_the_native_kernel_lets_other_threads_run_while_it_computes() -> None:
    """The engine loop runs the delta for every projection of every step: holding the GIL meanwhile would
    stall the replica's event loop (token delivery, new requests) for its length, as a pybind call does
    unless told otherwise. A ticking thread must get ticks in while one long call runs."""
    if _cpu_extension() is None:
        missing("the native CPU kernel did not build here (the engine falls back to the torch kernels)")
    gen = torch.Generator().manual_seed(0)
    slots, width, rank, segment = 8, 1024, 64, 16  # decode-sized segments: the kernel's own loops
    a = torch.randn(slots, width, rank, generator=gen)
    b = torch.randn(slots, rank, width, generator=gen)
    ticks: list[float] = []
    stop = threading.Event()

    def tick() -> None:
        while not stop.is_set():
            ticks.append(time.monotonic())

    ticker = threading.Thread(target=tick, daemon=True)
    ticker.start()
    try:
        for tokens in (2048, 8192, 32768):  # until one call lasts long enough to tell
            x = torch.randn(tokens, width, generator=gen)
            y = torch.zeros(tokens, width)
            rows = [(g % slots, g * segment, (g + 1) * segment) for g in range(tokens // segment)]
            table = torch.tensor(rows, dtype=torch.int64)
            offsets = torch.zeros(slots, dtype=torch.int64)  # unread by this kernel
            batch = LoRABatch(num_lora_tokens=tokens, offsets=offsets, segments=[], segment_table=table)
            started = time.monotonic()
            sgmv_cpu_kernel(y, x, a, b, batch)
            ended = time.monotonic()
            if ended - started >= 0.1:
                break
    finally:
        stop.set()
        ticker.join()
    assert ended - started >= 0.1, "no call lasted long enough to tell"
    margin = 0.02  # the interpreter hands the GIL over every 5 ms
    assert any(started + margin < t < ended - margin for t in ticks)
