"""FaultInjector: the load test's faults on a schedule (engine and Metering replicas killed, database and
Redis outages, a failing Stripe), each recorded with when it started and ended."""

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from bench.load.options import ENGINE, FAULT_GRACE_S
from bench.load.platform import Platform


@dataclass
class FaultRecord:
    name: str
    scheduled_s: float
    started_at: float | None = None  # epoch
    ended_at: float | None = None  # epoch: outage over, or replacement replica running
    ok: bool = False
    details: dict[str, Any] = field(default_factory=dict)

    def as_json(self, t0: float) -> dict[str, Any]:
        def rel(moment: float | None) -> float | None:
            return None if moment is None else round(moment - t0, 2)

        return {"ok": self.ok, "at_s": rel(self.started_at), "until_s": rel(self.ended_at), **self.details}


class FaultInjector:
    """Starts each requested fault at its time, in its own thread (a kill waits for its replacement, an
    outage holds for outage_s), so one slow recovery never delays the next fault."""

    def __init__(
        self, platform: Platform, faults: list[str], duration: float, outage_s: float | None
    ) -> None:
        self.platform = platform
        self.faults = faults
        spacing = duration * 0.7 / max(1, len(faults))
        self.outage_s = outage_s if outage_s is not None else min(10.0, max(3.0, spacing * 0.7))
        self.records = {
            name: FaultRecord(name, round(duration * 0.1 + spacing * i, 2)) for i, name in enumerate(faults)
        }
        self.threads: list[threading.Thread] = []
        self.t0 = 0.0
        self._scheduler = threading.Thread(target=self._schedule, name="faults", daemon=True)
        self._cancel = threading.Event()

    def start(self, t0: float) -> None:
        self.t0 = t0
        self._scheduler.start()

    def join(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        self._scheduler.join(max(0.0, deadline - time.monotonic()))
        for thread in list(self.threads):
            thread.join(max(0.0, deadline - time.monotonic()))

    def cancel(self) -> None:
        self._cancel.set()

    def windows(self) -> list[tuple[float, float]]:
        """Epoch intervals in which a 503 or a mid-stream error is the fault's doing."""
        out = []
        for name, grace in FAULT_GRACE_S.items():
            record = self.records.get(name)
            if record is not None and record.started_at is not None:
                end = record.ended_at or time.time()
                out.append((record.started_at - 1.0, end + grace))
        return out

    def _schedule(self) -> None:
        for name, record in self.records.items():
            if self._cancel.wait(max(0.0, self.t0 + record.scheduled_s - time.time())):
                return
            worker = threading.Thread(target=self._guarded, args=(record,), name=f"fault-{name}", daemon=True)
            self.threads.append(worker)
            worker.start()

    def _guarded(self, record: FaultRecord) -> None:
        inject: dict[str, Callable[[FaultRecord], None]] = {
            "engine": lambda r: self._kill(r, ENGINE),
            "metering": lambda r: self._kill(r, "metering"),
            "db": self._database,
            "redis": self._redis,
            "stripe": self._stripe,
        }
        try:
            inject[record.name](record)
        except Exception as error:
            record.ok = False
            record.details["error"] = f"{type(error).__name__}: {error}"

    def _kill(self, record: FaultRecord, deployment: str) -> None:
        record.started_at = time.time()  # refined below to the moment of the kill
        done = self.platform.ray_ops(
            "--expect", self.platform.expected(), "--timeout", "300", "kill", deployment
        )
        record.started_at = done.get("killed_at") or record.started_at
        record.ended_at = done.get("recovered_at")
        record.ok = bool(done.get("ok"))
        record.details.update(victim=done.get("victim"), replicas_after=done.get("replicas_after"))
        if not record.ok:
            record.details["error"] = done.get("error") or done.get("states")
        if record.ended_at is not None and record.started_at is not None:
            record.details["recovery_s"] = round(record.ended_at - record.started_at, 2)

    def _database(self, record: FaultRecord) -> None:
        with self.platform.database_outage():
            record.started_at = time.time()
            time.sleep(self.outage_s)
        record.ended_at = time.time()
        record.ok = True
        record.details["kind"] = "postgres: connections refused" if self.platform.pg_database else (
            "sqlite: BEGIN EXCLUSIVE held")  # fmt: skip

    def _redis(self, record: FaultRecord) -> None:
        proxy = self.platform.proxy
        if proxy is None:
            raise RuntimeError("the redis fault needs --backend redis")
        proxy.cut()
        record.started_at = time.time()
        try:
            time.sleep(self.outage_s)
        finally:
            proxy.restore()
        record.ended_at = time.time()
        record.ok = True

    def _stripe(self, record: FaultRecord) -> None:
        """Stripe fails (answers lost after recording, 500s, 429s with Retry-After) while an export runs;
        the export must leave what it could not send pending, and a later run must finish the job."""
        stub = self.platform.stub
        stub.fail_next(3, "500", after_record=True)  # Stripe has the event; we never heard: a retry
        stub.fail_next(14, "500")
        stub.fail_next(6, "429", retry_after=1)
        record.started_at = time.time()
        code, summary = self.platform.loraplex("billing", "export")
        record.details.update(
            export_exit=code,
            export={k: summary.get(k) for k in ("created", "sent", "failed", "duplicates", "pending")},
            stub_failures_served=stub.failures_served(),
        )
        record.details["stub_faults_left"] = stub.heal()
        record.ended_at = time.time()
        # Exit 1 (events left pending) or 0 (all delivered despite the faults): anything else is a crash.
        record.ok = code in (0, 1) and "sent" in summary
