"""The native CPU multi-LoRA kernel (csrc/sgmv_cpu.cpp): built once, ahead of serving, loaded by engines.

torch's JIT build (`cpp_extension.load`) guards a shared build directory with a lock file: a build killed
midway leaves the lock behind and every later engine start waits on it forever, and its directory is keyed
by the checkout path, so each new clone builds again. Here instead:
- a build happens in a private temporary directory, in a child process with a time bound, and the result
  is renamed into place atomically, so there is no shared lock to go stale and nobody sees half a build;
- the cache is keyed by what the binary depends on (source, torch version, compiler flags, CPU features),
  never by path, under LORAPLEX_KERNEL_CACHE (default ~/.cache/loraplex/kernels);
- an engine only loads what is already built (`load`): it never waits on a build. Without one it logs how
  to build it and runs the library kernels. `loraplex kernels build` (and `loraplex up`, and the test
  suite) build ahead of time;
- nothing the build started outlives it: the build child leads its own session, and whoever ends the
  build ends every process of that session (ninja starts each compiler in a process group of its own,
  so killing a group is not enough). The builder out of time or interrupted does it itself; the builder
  killed outright (SIGKILL) cannot, so the child gets SIGTERM when it dies (PR_SET_PDEATHSIG, Linux)
  and does it instead.
"""

import contextlib
import ctypes
import ctypes.util
import hashlib
import importlib.machinery
import importlib.util
import logging
import os
import platform
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from functools import cache
from pathlib import Path
from types import ModuleType

import torch

log = logging.getLogger(__name__)
SOURCE = Path(__file__).parent / "csrc" / "sgmv_cpu.cpp"
CFLAGS = ("-O3", "-march=native", "-fopenmp")
LDFLAGS = ("-fopenmp",)
BUILD_TIMEOUT_S = 600.0
SCRATCH_MAX_AGE_S = 24 * 3600.0  # far beyond any build: a scratch directory this old has no live builder
PR_SET_PDEATHSIG = 1  # prctl(2) option: the signal a process gets when its parent dies


def cache_root() -> Path:
    configured = os.environ.get("LORAPLEX_KERNEL_CACHE")
    return Path(configured) if configured else Path.home() / ".cache" / "loraplex" / "kernels"


def _cpu_flags() -> str:
    """The instruction set the binary is compiled for (-march=native): one CPU type never gets another's."""
    try:
        return next(
            line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags")
        )
    except (OSError, StopIteration):
        return platform.processor()


def build_key() -> str:
    digest = hashlib.sha256()
    for part in (SOURCE.read_bytes(), torch.__version__.encode(), " ".join(CFLAGS + LDFLAGS).encode()):
        digest.update(part)
    digest.update(_cpu_flags().encode())
    return digest.hexdigest()[:16]


def module_name() -> str:
    return f"loraplex_sgmv_{build_key()}"


def built_library() -> Path | None:
    """The built extension for this source, torch and CPU, if there is one."""
    directory = cache_root() / build_key()
    found = sorted(directory.glob(f"{module_name()}*.so")) if directory.is_dir() else []
    return found[0] if found else None


@cache
def load() -> ModuleType | None:
    """The built kernel, or None (with a log line saying how to build it). Never builds, never waits."""
    library = built_library()
    if library is None:
        log.warning(
            "native CPU LoRA kernel not built for this machine; using the torch kernels. "
            "Build it once with `loraplex kernels build` (cache: %s)",
            cache_root(),
        )
        return None
    try:
        loader = importlib.machinery.ExtensionFileLoader(module_name(), str(library))
        spec = importlib.util.spec_from_file_location(module_name(), library, loader=loader)
        assert spec is not None
        module = importlib.util.module_from_spec(spec)
        loader.exec_module(module)
        return module
    except Exception as error:  # a corrupt or foreign binary: the library kernels still work
        log.warning(
            "native CPU LoRA kernel at %s failed to load (%s); using the torch kernels", library, error
        )
        return None


def build(timeout_s: float = BUILD_TIMEOUT_S) -> Path | None:
    """Build the kernel unless it is built; returns the library, or None if this machine cannot build it
    (no compiler, no headers, out of time), saying why in the log."""
    existing = built_library()
    if existing is not None:
        return existing
    root = cache_root()
    root.mkdir(parents=True, exist_ok=True)
    _sweep_scratch(root)
    scratch = Path(tempfile.mkdtemp(prefix=".build-", dir=root))
    try:
        output = _run_bounded(
            [sys.executable, "-m", "deployments.engine.model.native_kernel", str(scratch), module_name()],
            timeout_s,
        )
        if output is None:
            log.warning("native CPU LoRA kernel build took over %.0f s; gave up", timeout_s)
            return None
        if output.returncode != 0:
            tail = output.stdout.strip().splitlines()[-5:]
            log.warning("native CPU LoRA kernel did not build: %s", " | ".join(tail) or output.returncode)
            return None
        final = root / build_key()
        with contextlib.suppress(OSError):  # OSError: another builder got there first; theirs is as good
            scratch.rename(final)  # atomic: readers see the whole build or none
        return built_library()
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def _sweep_scratch(root: Path) -> None:
    """Remove what builders killed outright (SIGKILL, a lost node) left: they never got to clean up."""
    cutoff = time.time() - SCRATCH_MAX_AGE_S
    for scratch in root.glob(".build-*"):
        with contextlib.suppress(OSError):  # gone already: another builder swept it
            if scratch.stat().st_mtime < cutoff:
                shutil.rmtree(scratch)


def _run_bounded(command: list[str], timeout_s: float) -> subprocess.CompletedProcess[str] | None:
    """Run the build child in its own session; None if out of time. Out of time (or interrupted), the
    whole session is killed: killing only the child left the ninja and compiler it started running on,
    reparented to init, writing into a scratch directory being removed."""
    child = subprocess.Popen(
        command,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
        preexec_fn=_terminated_with(os.getpid()),
    )
    try:
        output, _ = child.communicate(timeout=timeout_s)
        return subprocess.CompletedProcess(command, child.returncode, output)
    except subprocess.TimeoutExpired:
        return None
    finally:
        if child.returncode is None:  # not reaped yet, so its pid still names its session
            kill_session(child.pid)
            child.wait()
        if child.stdout is not None:
            child.stdout.close()


def _terminated_with(parent: int) -> Callable[[], None]:
    """The build child's setup before exec (after setsid): SIGTERM when the thread that started it ends,
    which, as `build` waits for the child, is when its process dies."""

    def arm() -> None:
        with contextlib.suppress(OSError, AttributeError):  # not Linux: the builder's own cleanup only
            libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
            libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
        if os.getppid() != parent:  # the builder died before the signal was armed
            os.kill(os.getpid(), signal.SIGKILL)

    return arm


def kill_session(session: int) -> None:
    """SIGKILL every process of `session` but the caller (its leader's pid names it while the leader is
    alive or unreaped). Passes again until none is left: one may have forked while we looked. Without
    /proc (not Linux), the leader's process group only."""
    if not Path("/proc/self/stat").exists():
        with contextlib.suppress(ProcessLookupError):
            os.killpg(session, signal.SIGKILL)
        return
    for _ in range(10):
        members = [pid for pid in _session_members(session) if pid != os.getpid()]
        if not members:
            return
        for pid in members:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
    log.warning("processes of build session %d kept appearing while it was killed", session)


def _session_members(session: int) -> list[int]:
    members = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:  # fields after "(comm)": state, ppid, pgrp, session
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue  # gone meanwhile
        if int(fields[3]) == session and fields[0] not in ("Z", "X"):
            members.append(int(entry.name))
    return members


def _end_build(directory: Path) -> Callable[[int, object], None]:
    """In the build child, on SIGTERM (its builder died): take down what it started, then its files."""

    def end(signum: int, _: object) -> None:
        kill_session(os.getsid(0))
        shutil.rmtree(directory, ignore_errors=True)
        os._exit(128 + signum)

    return end


def _build_into(directory: Path, name: str) -> None:
    """In the child process: torch's JIT build, into a directory no one else uses."""
    from torch.utils.cpp_extension import load as jit_load

    jit_load(
        name=name,
        sources=[str(SOURCE)],
        extra_cflags=list(CFLAGS),
        extra_ldflags=list(LDFLAGS),
        build_directory=str(directory),
        verbose=False,
    )
    for leftover in directory.iterdir():  # keep the library alone
        if not leftover.name.endswith(".so"):
            if leftover.is_dir():
                shutil.rmtree(leftover)
            else:
                leftover.unlink()


if __name__ == "__main__":
    signal.signal(signal.SIGTERM, _end_build(Path(sys.argv[1])))
    _build_into(Path(sys.argv[1]), sys.argv[2])
