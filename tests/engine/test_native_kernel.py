"""An engine start never waits on a kernel build: not on a lock a killed build left behind, not on a
broken toolchain. It loads what is built, or runs the torch kernels and says how to build the native one."""

import contextlib
import hashlib
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from deployments.engine.model import native_kernel
from tests.processes import gone_within, running

ROOT = Path(__file__).resolve().parents[2]
SELECT = (
    "import logging, torch; logging.basicConfig(level=logging.WARNING);"
    "from deployments.engine.model.lora_kernels import select_kernel;"
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
        "from deployments.engine.model import native_kernel;"
        "print('built', native_kernel.build(timeout_s=120))"
    )
    cache = tmp_path / "kernels"
    result = run(code, cache, timeout=150, CXX="/bin/false", CC="/bin/false")
    assert result.returncode == 0, result.stderr
    assert "built None" in result.stdout and "did not build" in result.stderr
    assert list(cache.iterdir()) == []  # no half build, no lock for anyone to wait on
    assert run(SELECT, cache).returncode == 0  # and engines still start


def test_a_build_out_of_time_takes_the_compiler_it_started_down_with_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Killing only the build child left its compiler running, reparented to init, after `build` gave up."""
    compiler_pid = tmp_path / "compiler.pid"
    child = tmp_path / "build-child"  # stands in for the Python child: starts a "compiler" and waits on it
    child.write_text(f"#!/bin/sh\nsleep 300 &\necho $! > {compiler_pid}\nwait\n")
    child.chmod(0o755)
    cache = tmp_path / "kernels"
    monkeypatch.setenv("LORAPLEX_KERNEL_CACHE", str(cache))
    monkeypatch.setattr(sys, "executable", str(child))
    started = time.monotonic()
    assert native_kernel.build(timeout_s=2) is None
    assert time.monotonic() - started < 10
    pid = int(compiler_pid.read_text())
    deadline = time.monotonic() + 5
    while running(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    alive = running(pid)
    if alive:
        os.kill(pid, signal.SIGKILL)  # not left behind by this test either
    assert not alive, "the compiler outlived the build"
    assert list(cache.iterdir()) == []


def test_a_build_sweeps_what_builders_killed_outright_left_and_spares_live_ones(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cache = tmp_path / "kernels"
    killed, live = cache / ".build-killed", cache / ".build-live"
    for scratch in (killed, live):
        scratch.mkdir(parents=True)
        (scratch / "half.o").write_text("")
    old = time.time() - native_kernel.SCRATCH_MAX_AGE_S - 60
    os.utime(killed, (old, old))
    monkeypatch.setenv("LORAPLEX_KERNEL_CACHE", str(cache))
    monkeypatch.setattr(sys, "executable", "/bin/false")  # a build that fails at once
    assert native_kernel.build(timeout_s=30) is None
    assert sorted(p.name for p in cache.iterdir()) == [".build-live"]


def test_a_build_killed_outright_takes_its_compiler_down_with_it(tmp_path: Path) -> None:
    """`loraplex kernels build` SIGKILLed mid-compile (an impatient operator, the OOM killer) cannot clean
    up: the compiler it started used to run on, reparented to init. The real build, with a real compiler."""
    loraplex = Path(sys.executable).parent / "loraplex"
    env = {**os.environ, "LORAPLEX_KERNEL_CACHE": str(tmp_path / "kernels"), "PYTHONPATH": str(ROOT)}
    build = subprocess.Popen([str(loraplex), "kernels", "build"], env=env, stdout=subprocess.DEVNULL,
                             stderr=subprocess.DEVNULL, start_new_session=True)  # fmt: skip
    tree: list[psutil.Process] = []
    try:
        deadline = time.monotonic() + 180
        while not any(p.name() == "cc1plus" for p in tree):  # the compiler proper, under ninja and c++
            assert build.poll() is None and time.monotonic() < deadline, "no compiler was started"
            time.sleep(0.1)
            with contextlib.suppress(psutil.NoSuchProcess):
                tree = psutil.Process(build.pid).children(recursive=True)
        build.kill()
        build.wait()
        names = {p.pid: p.name() for p in tree}
        alive = gone_within(list(names), 15)
        assert alive == [], f"outlived the build: {[names[pid] for pid in alive]}"
    finally:
        if build.poll() is None:
            build.kill()
            build.wait()
        for process in tree:  # not left behind by this test either
            with contextlib.suppress(psutil.NoSuchProcess):
                process.kill()
