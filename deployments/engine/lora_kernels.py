"""The multi-LoRA delta kernels, picked once per engine for its device and dtype.

- `sgmv_cpu`: our C++ segment kernel (csrc/sgmv_cpu.cpp), built on first use with the machine's compiler
  and cached per CPU type; near the memory-traffic floor where library calls are dominated by overhead.
- `grouped_mm`: torch._grouped_mm (CUDA sm90+ in bf16; a C++ loop elsewhere).
- `loop`: one pair of matmuls per segment present; always works.
All compute y[:n] += (x @ A[slot]) @ B[slot] per segment, with scaling already folded into B.
"""

import hashlib
import logging
import platform
from collections.abc import Callable
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from types import ModuleType

import torch

log = logging.getLogger(__name__)


@dataclass(slots=True)
class LoRABatch:
    """How this step's tokens map to slots. Tokens [0, num_lora_tokens) carry adapters, sorted by slot."""

    num_lora_tokens: int
    offsets: torch.Tensor  # [max_loras] int32, cumulative end of each slot's segment (on the device)
    segments: list[tuple[int, int, int]]  # (slot, start, end) for the non-empty segments, host-side
    segment_table: torch.Tensor  # [G, 3] int64 on the host: the same segments, for the C++ kernel


LoRAKernel = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, LoRABatch], None]
SOURCE = Path(__file__).parent / "csrc" / "sgmv_cpu.cpp"


def loop_kernel(y: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, batch: LoRABatch) -> None:
    for slot, start, end in batch.segments:
        y[start:end] += ((x[start:end] @ a[slot]) @ b[slot]).to(y.dtype)


def grouped_mm_kernel(
    y: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, batch: LoRABatch
) -> None:
    h = torch._grouped_mm(x, a, offs=batch.offsets)  # [n, R]
    y[: batch.num_lora_tokens] += torch._grouped_mm(h, b, offs=batch.offsets).to(y.dtype)


def _cpu_tag() -> str:
    """Identifies the instruction set the kernel is compiled for (-march=native), so a shared cache
    directory never hands one CPU type a binary built for another."""
    try:
        flags = next(
            line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags")
        )
    except (OSError, StopIteration):
        flags = platform.processor()
    return hashlib.sha256(flags.encode()).hexdigest()[:10]


@cache
def _cpu_extension() -> ModuleType | None:
    from torch.utils.cpp_extension import load

    try:
        module: ModuleType = load(
            name=f"loraplex_sgmv_{_cpu_tag()}",
            sources=[str(SOURCE)],
            extra_cflags=["-O3", "-march=native", "-fopenmp"],
            extra_ldflags=["-fopenmp"],
            verbose=False,
        )
        return module
    except Exception as error:  # no compiler, no headers: the library kernels still work
        log.warning("CPU multi-LoRA kernel unavailable (%s); using torch kernels", error)
        return None


def sgmv_cpu_kernel(
    y: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, batch: LoRABatch
) -> None:
    ext = _cpu_extension()
    assert ext is not None
    if x.dtype != y.dtype:  # quantized bases may return another dtype than their input
        loop_kernel(y, x, a, b, batch)
        return
    ext.sgmv(y, x.contiguous(), a, b, batch.segment_table)


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
    """The fastest kernel that runs here, by name. `dims`: every in/out width and the slot rank."""
    if device.type == "cpu" and dtype in (torch.float32, torch.bfloat16, torch.float16) and _cpu_extension():
        return "sgmv_cpu", sgmv_cpu_kernel
    aligned = all(d * dtype.itemsize % 16 == 0 for d in dims)  # grouped_mm wants 16-byte strides
    if aligned and _probe_grouped_mm(dtype, device):
        return "grouped_mm", grouped_mm_kernel
    return "loop", loop_kernel
