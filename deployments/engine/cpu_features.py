"""What the host CPU offers: its model name and the vector ISA that decides the fast compute dtype.

bf16 GEMMs are native only with AVX512-BF16 or AMX-BF16; on AVX2-only CPUs oneDNN emulates them and they
run ~3.5x slower than fp32, so `dtype: auto` needs to know which kind of machine it is on.
"""

import os
import platform
from dataclasses import dataclass
from functools import cache
from pathlib import Path

_REPORTED = ("avx2", "avx512f", "avx512_bf16", "amx_bf16")


@dataclass(frozen=True)
class CpuFeatures:
    model: str
    cores: int
    flags: frozenset[str]

    @property
    def isa(self) -> list[str]:
        """The vector extensions that matter for GEMM speed, in ascending order."""
        return [name for name in _REPORTED if name in self.flags]

    @property
    def native_bf16(self) -> bool:
        return "avx512_bf16" in self.flags or "amx_bf16" in self.flags


@cache
def cpu_features() -> CpuFeatures:
    model, flags = platform.processor() or platform.machine(), set[str]()
    info = Path("/proc/cpuinfo")
    if info.exists():
        for line in info.read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "model name" and value.strip():
                model = value.strip()
            elif key.strip() == "flags" and not flags:
                flags = set(value.split())
    return CpuFeatures(model=model, cores=os.cpu_count() or 1, flags=frozenset(flags))


def engine_threads(configured: int | None) -> int:
    """Intra-op threads for a served engine: `configured`, else the cores this process may use less one
    (EngineConfig.cpu_threads says why), at least one."""
    if configured is not None:
        return configured
    return max(1, len(os.sched_getaffinity(0)) - 1)
