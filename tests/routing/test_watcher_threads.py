"""The registry watcher reads the registry on its own thread but never touches the engine's adapter tiers
there: every read and write of them happens on the engine's loop thread (they have no lock)."""

import contextlib
import threading
import time
from collections.abc import Callable, Iterator
from types import SimpleNamespace
from typing import Any

import pytest

from adapters.ref import AdapterRef
from billing import adapter_registry
from deployments.engine.interface import AsyncEngine
from deployments.registry_watcher import RegistryWatcher
from tests.engine.helpers import running, tiny_config
from tests.model_fixtures import TinySetup


class ThreadRecorder:
    """Stands in for the engine's AdapterManager and notes the thread of every attribute access."""

    def __init__(self, inner: Any) -> None:
        object.__setattr__(self, "inner", inner)
        object.__setattr__(self, "threads", set())

    def __getattr__(self, name: str) -> Any:
        self.threads.add(threading.current_thread().name)
        return getattr(self.inner, name)

    def __setattr__(self, name: str, value: Any) -> None:
        self.threads.add(threading.current_thread().name)
        setattr(self.inner, name, value)


@pytest.fixture
def engine(llama: TinySetup) -> Iterator[AsyncEngine]:
    with running(tiny_config(llama, num_kv_blocks=64, max_loras=4)) as engine:
        yield engine


def _until(condition: Callable[[], bool], timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


def test_the_watcher_changes_adapter_tiers_only_on_the_loop_thread(
    engine: AsyncEngine, llama: TinySetup, monkeypatch: pytest.MonkeyPatch
) -> None:
    refs = list(llama.refs.values())
    registry: list[tuple[AdapterRef, bool]] = [(refs[0], True), (refs[1], False)]  # (newest version, pinned)

    def list_adapters(session: Any, *, base_model: str) -> list[Any]:
        return [
            SimpleNamespace(adapter=SimpleNamespace(id=ref.adapter_id, pinned=pinned), latest=ref)
            for ref, pinned in registry
        ]

    monkeypatch.setattr(adapter_registry, "list_adapters", list_adapters)
    recorder = ThreadRecorder(engine.adapters)
    engine.run_on_loop(lambda e: setattr(e, "adapters", recorder)).result()

    def on_loop(read: Callable[[Any], bool]) -> Callable[[], bool]:
        return lambda: engine.run_on_loop(lambda e: read(e.adapters)).result()

    watcher = RegistryWatcher(engine, "m", contextlib.nullcontext, interval_s=0.05)  # type: ignore[arg-type]
    watcher.start()
    try:
        _until(on_loop(lambda tiers: refs[0] in tiers.slots.pinned))
        registry[:] = [(refs[1], False), (refs[2], False)]  # refs[0] deleted, refs[2] uploaded
        _until(on_loop(lambda tiers: refs[2] in tiers.held() and refs[0] not in tiers.slots.pinned))
    finally:
        watcher.stop()
    assert recorder.threads == {"engine-loop"}
