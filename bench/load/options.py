"""A load test run's options and constants, and its progress lines on stderr."""

import sys
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
FAULTS = ("engine", "metering", "db", "redis", "stripe")
MODEL = "demo-llama"
ENGINE = f"engine-{MODEL}"
ENGINE_REPLICAS = 2  # a killed replica must leave one serving
INGRESS_REPLICAS = 2  # limits must hold across ingress replicas
SEED_PREFIX = "bench-seed-"  # closed-hour usage rows made for the Stripe export, not by requests
STRIPE_CUSTOMERS = {"bench-ent": "cus_benchent", "bench-pro": "cus_benchpro"}
# Requests that overlap one of these faults may get a 503 or a mid-stream error; how long after the
# fault's end (or the replacement replica's start) that still counts as overlapping.
FAULT_GRACE_S = {"engine": 10.0, "db": 10.0, "redis": 5.0}
DEFAULT_PG_ADMIN = "postgresql://postgres@127.0.0.1:5432/test"


class Interrupted(Exception):
    """SIGTERM/SIGINT: stop, clean up our processes, report."""


@dataclass
class Options:
    duration: float
    faults: list[str]
    backend: str
    database: str
    users: int
    keep: bool
    outage_s: float | None


def progress(message: str) -> None:
    print(f"[load_test {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)
