"""The load itself: locust users in this process for the duration, faults injected meanwhile."""

import logging
import os
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from bench.load.fault_injector import FaultInjector
from bench.load.options import Options, progress
from bench.load.platform import Platform

if TYPE_CHECKING:
    from bench.locustfile import Result


def run_load(
    platform: Platform, plan: Path, options: Options, injector: FaultInjector, stop: Callable[[], bool]
) -> tuple[list["Result"], float, int]:
    """Locust users in this process for the duration (faults injected meanwhile), then a graceful stop:
    no new requests, the running ones finish. Returns (results, load start epoch, still in flight)."""
    os.environ["LORAPLEX_BENCH_PLAN"] = str(plan)
    import gevent
    from locust.env import Environment

    from bench import locustfile

    logging.getLogger("locust").setLevel(logging.WARNING)
    environment = Environment(user_classes=[locustfile.LoraplexUser], host=platform.url)
    runner = environment.create_local_runner()
    recorder = locustfile.RECORDER
    t0 = time.time()
    injector.start(t0)
    runner.start(options.users, spawn_rate=options.users)
    next_report = t0 + 15
    while time.time() < t0 + options.duration and not stop():
        gevent.sleep(0.5)
        if time.time() >= next_report:
            next_report += 15
            counts = Counter(r.outcome for r in recorder.results)
            progress(f"t={time.time() - t0:5.0f}s requests={len(recorder.results)} {dict(counts)}")
    recorder.stopping = True
    deadline = time.time() + 180  # the longest a running request may take to finish
    while recorder.in_flight and time.time() < deadline:
        gevent.sleep(0.2)
    hung = recorder.in_flight
    runner.quit()
    return list(recorder.results), t0, hung
