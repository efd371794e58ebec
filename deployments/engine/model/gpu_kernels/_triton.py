"""Triton when it is installed, None when not: the kernel modules import it from here so that they import
(and a CPU-only engine starts) without it.

The kernels are decorated when their module is imported: a JITFunction is a definition, nothing compiles
before the first launch. Triton decides at decoration whether a kernel runs through its CPU interpreter
(TRITON_INTERPRET=1), so set that variable before the first import of a kernel module.
"""

import importlib
from collections.abc import Callable
from typing import Any

import torch


def _optional(name: str) -> Any:
    try:
        return importlib.import_module(name)
    except ImportError:
        return None


triton: Any = _optional("triton")
tl: Any = _optional("triton.language")
libdevice: Any = _optional("triton.language.extra.libdevice")


def jit(fn: Callable[..., None]) -> Any:
    """`triton.jit` when Triton is installed; the plain function otherwise (its launcher raises first)."""
    return fn if triton is None else triton.jit(fn)


def require_triton() -> None:
    if triton is None:
        raise RuntimeError("the GPU kernels need Triton, which is not installed in this environment")


def interpreting() -> bool:
    """True when kernels run through Triton's CPU interpreter (libdevice calls are unavailable there)."""
    return bool(triton is not None and triton.knobs.runtime.interpret)


def next_power_of_2(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def rows_out(
    out: torch.Tensor | None, rows: int, cols: int, dtype: torch.dtype, device: torch.device
) -> torch.Tensor:
    """A kernel's [rows, cols] output: out when given (any row stride, checked), else a new tensor."""
    if out is None:
        return torch.empty(rows, cols, dtype=dtype, device=device)
    if out.shape != (rows, cols) or out.dtype != dtype or out.stride(1) != 1:
        raise ValueError(f"out must be {dtype} [{rows}, {cols}] with a contiguous last dimension")
    return out


DEFAULT_SMS = 132  # H100 SXM; stands in when the device has no SM count (the CPU interpreter)


def sm_count(device: torch.device) -> int:
    """Streaming multiprocessors of the device: a property of the machine, so grids sized from it stay
    graph-safe."""
    if device.type == "cuda":
        return int(torch.cuda.get_device_properties(device).multi_processor_count)
    return DEFAULT_SMS


def dot_precision(dtype: torch.dtype) -> str:
    """fp32 operands multiply in IEEE fp32 (Triton's default would round them to tf32 on tensor cores)."""
    return "ieee" if dtype == torch.float32 else "tf32"
