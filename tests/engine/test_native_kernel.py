"""An engine start never waits on a kernel build: not on a lock a killed build left behind, not on a
broken toolchain. It loads what is built, or runs the torch kernels and says how to build the native one."""

import hashlib
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

from deployments.engine import native_kernel

ROOT = Path(__file__).resolve().parents[2]
SELECT = (
    "import logging, torch; logging.basicConfig(level=logging.WARNING);"
    "from deployments.engine.lora_kernels import select_kernel;"
    "print('kernel', select_kernel(torch.float32, torch.device('cpu'), {64, 8})[0])"
)


def run(code: str, cache: Path, timeout: float = 60, **env: str) -> subprocess.CompletedProcess[str]:
    environment = {
        **os.environ,
        "LORAPLEX_KERNEL_CACHE": str(cache),
        "TORCH_EXTENSIONS_DIR": str(cache.parent / "torch_extensions"),  # torch's JIT build root, if used
        "PYTHONPATH": str(ROOT),
        **env,
    }
    return subprocess.run(
        [sys.executable, "-c", code], env=environment, capture_output=True, text=True, timeout=timeout
    )


def stale_locks(cache: Path) -> None:
    """What a build killed midway leaves: torch's lock in its JIT build directory (named as the JIT build
    named it, per CPU type), and a half build in our cache."""
    tag = hashlib.sha256(native_kernel._cpu_flags().encode()).hexdigest()[:10]
    torch_dir = cache.parent / "torch_extensions" / f"loraplex_sgmv_{tag}"
    torch_dir.mkdir(parents=True, exist_ok=True)
    (torch_dir / "lock").write_text("")
    half = cache / ".build-killed"
    half.mkdir(parents=True, exist_ok=True)
    (half / "lock").write_text("")


def test_an_engine_without_a_built_kernel_starts_at_once_on_torch_kernels(tmp_path: Path) -> None:
    cache = tmp_path / "kernels"
    stale_locks(cache)
    started = time.monotonic()
    result = run(SELECT, cache)
    assert result.returncode == 0, result.stderr
    assert "kernel grouped_mm" in result.stdout or "kernel loop" in result.stdout
    assert "loraplex kernels build" in result.stderr  # the operator is told how to get the fast one
    assert time.monotonic() - started < 45  # an interpreter and torch import, nothing more


def test_a_built_kernel_is_loaded_whatever_locks_lie_around(tmp_path: Path) -> None:
    library = native_kernel.built_library()
    assert library is not None, "the session fixture builds it"
    cache = tmp_path / "kernels"
    shutil.copytree(library.parent, cache / library.parent.name)
    stale_locks(cache)
    result = run(SELECT, cache)
    assert result.returncode == 0, result.stderr
    assert "kernel sgmv_cpu" in result.stdout


def test_a_broken_toolchain_fails_the_build_quickly_and_leaves_nothing(tmp_path: Path) -> None:
    code = (
        "import logging; logging.basicConfig(level=logging.WARNING);"
        "from deployments.engine import native_kernel; print('built', native_kernel.build(timeout_s=120))"
    )
    cache = tmp_path / "kernels"
    result = run(code, cache, timeout=150, CXX="/bin/false", CC="/bin/false")
    assert result.returncode == 0, result.stderr
    assert "built None" in result.stdout and "did not build" in result.stderr
    assert list(cache.iterdir()) == []  # no half build, no lock for anyone to wait on
    assert run(SELECT, cache).returncode == 0  # and engines still start
