"""The multi-LoRA delta kernels, picked once per engine for its device and dtype.

- `sgmv_cpu`: our C++ segment kernel (csrc/sgmv_cpu.cpp), built ahead of serving per CPU type
  (native_kernel.py); near the memory-traffic floor where library calls are dominated by overhead.
- `grouped_mm`: torch._grouped_mm (CUDA sm90+ in bf16; a C++ loop elsewhere).
- `loop`: one pair of matmuls per segment present; always works.
All compute y[:n] += (x @ A[page]) @ B[page] per segment, with scaling already folded into B. An adapter wider
than one page (lora_layers.py) is a run of pages: the C++ kernel takes each run whole (shrinking page by page
into one h, expanding once over the run's stacked B), the others add the pages' deltas in rounds (round j
applies each adapter's j-th page).
"""

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from types import ModuleType

import torch

from deployments.engine.model import native_kernel

log = logging.getLogger(__name__)


@dataclass(slots=True)
class LoRABatch:
    """How this step's tokens map to adapter pages. Tokens [0, num_lora_tokens) carry adapters, sorted by
    slot (an adapter's slot is its first page, so round 0, the offsets and `segments`, covers every such
    token; a later round only the tokens whose adapter has that many pages, which is why only kernels that
    read segments, not the offsets, run later rounds). segment_table also gives each run's pages."""

    num_lora_tokens: int
    offsets: torch.Tensor  # [pages] cumulative end of each page's segment in round 0 (on the device; int64)
    segments: list[tuple[int, int, int]]  # (page, start, end) for the non-empty segments, host-side
    segment_table: torch.Tensor  # [G, 3] or [G, 4] int64 on the host: the same, [+ run pages], for C++
    later_pages: list[list[tuple[int, int, int]]] = field(default_factory=list)  # rounds 1..: their segments
    runs: torch.Tensor | None = None  # [pages] on the device: each run's pages at its first page (Triton)
    max_pages: int = 1  # the widest run the engine's memory allows (a fixed bound: graphs bake it in)

    def page_rounds(self) -> list[list[tuple[int, int, int]]]:
        return [self.segments, *self.later_pages]


def lora_batch(
    segments: list[tuple[int, int, int]],
    pages: list[int],
    offsets: torch.Tensor,
    num_lora_tokens: int,
    *,
    runs: torch.Tensor | None = None,
    max_pages: int = 1,
) -> LoRABatch:
    """The step's rounds from its segments (slot, start, end) sorted by slot and each one's adapter's
    pages: round j adds page slot + j of every adapter with more than j pages."""
    later = [
        [(slot + j, start, end) for (slot, start, end), n in zip(segments, pages, strict=True) if n > j]
        for j in range(1, max(pages, default=1))
    ]
    table = [(*segment, n) for segment, n in zip(segments, pages, strict=True)]
    return LoRABatch(
        num_lora_tokens=num_lora_tokens,
        offsets=offsets,
        segments=segments,
        segment_table=torch.tensor(table, dtype=torch.int64).reshape(-1, 4),
        later_pages=later,
        runs=runs,
        max_pages=max_pages,
    )


LoRAKernel = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, LoRABatch], None]


def _add_segments(
    y: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, segments: list[tuple[int, int, int]]
) -> None:
    for page, start, end in segments:
        y[start:end] += ((x[start:end] @ a[page]) @ b[page]).to(y.dtype)


def loop_kernel(y: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, batch: LoRABatch) -> None:
    for segments in batch.page_rounds():
        _add_segments(y, x, a, b, segments)


def grouped_mm_kernel(
    y: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, batch: LoRABatch
) -> None:
    offs = batch.offsets.to(torch.int32)  # grouped_mm takes int32 only; the step's buffer is int64
    h = torch._grouped_mm(x, a, offs=offs)  # [n, R]
    y[: batch.num_lora_tokens] += torch._grouped_mm(h, b, offs=offs).to(y.dtype)
    for segments in batch.later_pages:  # later rounds cover some tokens only; grouped_mm's offsets cover all
        _add_segments(y, x, a, b, segments)


def _cpu_extension() -> ModuleType | None:
    """The native kernel if it was built for this machine (native_kernel.py); never builds here."""
    return native_kernel.load()


def sgmv_cpu_kernel(
    y: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, batch: LoRABatch
) -> None:
    ext = _cpu_extension()
    assert ext is not None
    if x.dtype != y.dtype:  # quantized bases may return another dtype than their input
        loop_kernel(y, x, a, b, batch)
        return
    ext.sgmv(y, x.contiguous(), a, b, batch.segment_table)  # every run whole, one call


def _probe_grouped_mm(dtype: torch.dtype, device: torch.device) -> bool:
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


def select_kernel(dtype: torch.dtype, device: torch.device, dims: set[int]) -> tuple[str, LoRAKernel]:
    """The fastest kernel that runs here, by name. `dims`: every in/out width and the page rank."""
    if device.type == "cpu" and dtype in (torch.float32, torch.bfloat16, torch.float16) and _cpu_extension():
        return "sgmv_cpu", sgmv_cpu_kernel
    aligned = all(d * dtype.itemsize % 16 == 0 for d in dims)  # grouped_mm wants 16-byte strides
    if aligned and _probe_grouped_mm(dtype, device):
        return "grouped_mm", grouped_mm_kernel
    return "loop", loop_kernel
