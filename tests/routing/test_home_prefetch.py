"""RegistryWatcher prefetches a newly uploaded adapter only on its rendezvous home replica (the one the
router will pick), so an upload costs one load per deployment; without peers it prefetches everywhere."""

import contextlib
from collections.abc import Iterator
from concurrent.futures import Future
from types import SimpleNamespace
from typing import Any

import pytest

from adapters.ref import AdapterRef
from billing import adapter_registry
from deployments.registry_watcher import RegistryWatcher
from deployments.rendezvous import rendezvous_order

REPLICAS = ["r1", "r2", "r3"]


class FakeEngine:
    """What the watcher drives on AsyncEngine: one reconciliation per pass (drops, pins, prefetches)."""

    def __init__(self) -> None:
        self.prefetched: list[AdapterRef] = []

    def reconcile_adapters(
        self, *, live: set[str], pinned: set[AdapterRef], prefetch: list[AdapterRef]
    ) -> "Future[None]":
        self.prefetched += prefetch
        done: Future[None] = Future()
        done.set_result(None)
        return done


@pytest.fixture
def registry(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    ids: list[str] = []

    def list_adapters(session: Any, *, base_model: str) -> list[Any]:
        latest = SimpleNamespace(version=1)
        return [SimpleNamespace(adapter=SimpleNamespace(id=i, pinned=False), latest=latest) for i in ids]

    monkeypatch.setattr(adapter_registry, "list_adapters", list_adapters)
    return ids


@contextlib.contextmanager
def no_session() -> Iterator[None]:
    yield None


def watcher(engine: FakeEngine, replica: str | None, peers: list[str] | None) -> RegistryWatcher:
    return RegistryWatcher(
        engine,  # type: ignore[arg-type]
        "m",
        no_session,  # type: ignore[arg-type]
        replica_id=replica,
        peers=(lambda: list(peers)) if peers is not None else None,
    )


def test_each_upload_is_prefetched_by_its_home_replica_alone(registry: list[str]) -> None:
    engines = {name: FakeEngine() for name in REPLICAS}
    watchers = [watcher(engines[name], name, REPLICAS) for name in REPLICAS]
    for w in watchers:
        w.sync_once()  # the first pass prefetches nothing
    registry.extend(f"adapter-{i}" for i in range(30))
    for w in watchers:
        w.sync_once()
    for name, engine in engines.items():
        assert {ref.adapter_id for ref in engine.prefetched} == {
            i for i in registry if rendezvous_order(i, REPLICAS)[0] == name
        }
    assert sum(len(e.prefetched) for e in engines.values()) == 30  # once per deployment
    assert all(e.prefetched for e in engines.values())


def test_a_replica_not_yet_in_the_peer_list_counts_itself(registry: list[str]) -> None:
    engine = FakeEngine()
    w = watcher(engine, "r3", ["r1", "r2"])  # its first report has not landed yet
    w.sync_once()
    registry.extend(f"adapter-{i}" for i in range(30))
    w.sync_once()
    assert {ref.adapter_id for ref in engine.prefetched} == {
        i for i in registry if rendezvous_order(i, REPLICAS)[0] == "r3"
    }


def test_without_peers_every_upload_is_prefetched(registry: list[str]) -> None:
    engine = FakeEngine()
    w = watcher(engine, None, None)
    w.sync_once()
    registry.extend(["a", "b"])
    w.sync_once()
    assert [ref.adapter_id for ref in engine.prefetched] == ["a", "b"]
