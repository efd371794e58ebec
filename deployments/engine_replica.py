"""EngineReplica: the Ray Serve deployment that hosts one base model's engine.

Streams RequestOutput for each EngineRequest. When the caller closes the stream (its client went away),
Serve cancels this generator and AsyncEngine.generate aborts the request, freeing KV blocks and slot.
"""

import logging
from collections.abc import AsyncIterator
from datetime import timedelta
from typing import Any

from app import log_context
from app.dependency_noise import quiet_dependencies
from app.settings import Settings
from billing.adapter_digests import RegistryDigests
from billing.db import make_engine, make_session_factory
from billing.routing_report import live_replicas
from deployments.abort_request import AbortRequest
from deployments.engine.interface import (
    EngineConfig,
    EngineRequest,
    EngineStats,
    EngineStopped,
    RequestOutput,
)
from deployments.engine_metrics import EngineMetrics
from deployments.engine_reporter import EngineReporter
from deployments.registry_watcher import RegistryWatcher


def _replica_name(model: str) -> str:
    """Serve's replica id when running as a replica, else host and process."""
    try:
        from ray import serve

        return f"{model}:{serve.get_replica_context().replica_id.unique_id}"
    except Exception:  # not inside a Serve replica
        import os
        import socket

        return f"{model}:{socket.gethostname()}:{os.getpid()}"


log = logging.getLogger(__name__)


def _node_local(engine_config: dict[str, Any]) -> dict[str, Any]:
    """The adapter cache settings the model's config leaves unset, from this node's environment
    (LORAPLEX_ADAPTER_CACHE_DIR, LORAPLEX_ADAPTER_CACHE_MB: what its `ray start` was given)."""
    settings = Settings()
    return {
        "adapter_cache_dir": str(settings.resolved_adapter_cache_dir().resolve()),
        "adapter_cache_mb": settings.adapter_cache_mb,
        **engine_config,
    }


class EngineReplica:
    def __init__(
        self,
        engine_config: dict[str, Any],
        *,
        watch_registry: bool = True,
        report_interval_s: float = 15.0,
        metrics_interval_s: float = 5.0,
    ) -> None:
        log_context.route_to_serve()
        quiet_dependencies()  # before this replica imports the ML stack
        self.config = EngineConfig(**_node_local(engine_config))
        # Imported here, after quiet_dependencies: the model stack is this replica's, not its module's (the
        # application builder imports this module too, and needs none of it).
        from deployments.engine.interface import AsyncEngine

        sessions = None
        if watch_registry:
            sessions = make_session_factory(make_engine(Settings().resolved_database_url()))
        self.engine = AsyncEngine(
            self.config,
            replica_name=_replica_name(self.config.name),
            # Adapters read from an object store are checked against what the registry recorded.
            adapter_digests=None if sessions is None else RegistryDigests(sessions),
        )
        self.metrics = EngineMetrics(self.engine, base_model=self.config.name, interval_s=metrics_interval_s)
        self.metrics.start()
        self.watcher: RegistryWatcher | None = None
        self.reporter: EngineReporter | None = None
        if sessions is not None:
            name, prefix = self.engine.replica_name, f"{self.config.name}:"
            self.reporter = EngineReporter(
                self.engine,
                replica=name,
                base_model=self.config.name,
                session_factory=sessions,
                interval_s=report_interval_s,
            )
            self.reporter.start()  # reports at once, so peers count this replica when prefetching

            def peers() -> list[str]:  # replicas whose reports are fresh: the ones the router can choose
                with sessions() as session:
                    names = live_replicas(
                        session,
                        base_model=self.config.name,
                        within=timedelta(seconds=3 * report_interval_s + 5),
                    )
                return [n.removeprefix(prefix) for n in names]

            self.watcher = RegistryWatcher(
                self.engine, self.config.name, sessions, replica_id=name.removeprefix(prefix), peers=peers
            )
            self.watcher.start()
        log.info("engine replica for %s ready", self.config.name)

    async def generate(self, request: EngineRequest) -> AsyncIterator[RequestOutput]:
        # This request's log lines here carry the ids the ingress's carry (cache_salt is the tenant).
        log_context.bind(
            request_id=request.request_id,
            tenant=request.cache_salt,
            adapter=None if request.adapter is None else str(request.adapter),
        )
        async for output in self.engine.generate(request):
            yield output

    async def abort(self, request: AbortRequest) -> bool:
        """Stop a request this replica runs; its stream ends with the ABORT output and usage."""
        return await self.engine.abort(request.request_id)

    def stats(self) -> EngineStats:
        return self.engine.stats()

    def record_routing_stats(self) -> dict[str, Any]:
        """What the adapter-aware router needs, polled by Serve every few seconds."""
        s = self.engine.stats()
        return {
            "device_adapters": s.device_adapters,
            "cpu_adapters": s.cpu_adapters,
            "free_slots": s.free_slots,
            "running": s.running,
            "waiting": s.waiting,
            "kv_usage": s.kv_usage,
            "max_num_seqs": self.config.max_num_seqs,
        }

    def ready(self) -> bool:
        """For the ingress's /readyz: the model is loaded (the constructor did it) and the loop runs."""
        return self.engine.running

    def check_health(self) -> None:
        """Serve restarts the replica if the engine loop has died."""
        if self.engine.error is not None:
            raise EngineStopped(f"engine loop died: {self.engine.error}")

    def report_now(self) -> None:
        """Write the busy/wall totals now (tests, and shutdown)."""
        if self.reporter is not None:
            self.reporter.report_once()

    def __del__(self) -> None:
        metrics = getattr(self, "metrics", None)
        if metrics is not None:
            metrics.stop()
        watcher = getattr(self, "watcher", None)
        if watcher is not None:
            watcher.stop()
        reporter = getattr(self, "reporter", None)
        if reporter is not None:
            reporter.stop()
        engine = getattr(self, "engine", None)
        if engine is not None:
            engine.shutdown()
