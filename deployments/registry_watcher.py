"""RegistryWatcher: keeps one engine replica in line with the adapter registry.

Every replica polls the registry (a small indexed query every couple of seconds) instead of being told:
Ray Serve has no broadcast to all replicas of a deployment, and a replica that starts or restarts later
catches up by itself. Each pass: adapters deleted since -> dropped from CPU memory and device slots (running
requests finish on what they hold); pinned adapters -> their newest version pinned in a slot, older pins
released; versions uploaded since the first pass -> prefetched into the CPU tier, by the adapter's home
replica only when the replica knows its peers (deployments.rendezvous, as the router chooses), so an
upload costs one load in the deployment, not one per replica.
"""

import logging
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING

from sqlalchemy.orm import Session

from adapters.ref import AdapterRef
from billing import adapter_registry

if TYPE_CHECKING:  # the engine's model stack is imported by the replica that runs it, not by this module
    from deployments.engine.interface import AsyncEngine
from deployments.rendezvous import rendezvous_order

log = logging.getLogger(__name__)
SYNC_TIMEOUT_S = 60.0  # the loop applies it between steps; a step is far shorter than this


class RegistryWatcher:
    def __init__(
        self,
        engine: "AsyncEngine",
        base_model: str,
        session_factory: Callable[[], Session],
        *,
        interval_s: float = 2.0,
        replica_id: str | None = None,
        peers: Callable[[], list[str]] | None = None,
    ) -> None:
        self._engine = engine
        self._base_model = base_model
        self._sessions = session_factory
        self._interval = interval_s
        self._replica_id = replica_id
        self._peers = peers  # the deployment's live replica ids (this one's included or not)
        self._live: dict[str, AdapterRef] = {}  # adapter id -> newest version, as of the last pass
        self._first = True
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="registry-watcher", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=10)

    def sync_once(self) -> None:
        """One pass: read the registry here, then change the engine's adapter tiers on its loop thread
        (they belong to that thread: this one never reads or writes them)."""
        with self._sessions() as session:
            rows = adapter_registry.list_adapters(session, base_model=self._base_model)
        live = {r.adapter.id: AdapterRef(r.adapter.id, r.latest.version) for r in rows}
        wanted_pins = {live[r.adapter.id] for r in rows if r.adapter.pinned}
        prefetch: list[AdapterRef] = []
        if not self._first:
            uploaded = [ref for i, ref in live.items() if self._live.get(i) != ref and ref not in wanted_pins]
            prefetch = self._homed_here(uploaded)
        done = self._engine.reconcile_adapters(live=set(live), pinned=wanted_pins, prefetch=prefetch)
        done.result(timeout=SYNC_TIMEOUT_S)
        self._live = live
        self._first = False

    def _homed_here(self, refs: list[AdapterRef]) -> list[AdapterRef]:
        if not refs or self._peers is None or self._replica_id is None:
            return refs
        replicas = sorted({*self._peers(), self._replica_id})
        return [ref for ref in refs if rendezvous_order(ref.adapter_id, replicas)[0] == self._replica_id]

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self.sync_once()
            except Exception:  # the database may be away for a while: keep serving, try again
                log.exception("registry sync failed")
            self._stop.wait(self._interval)
