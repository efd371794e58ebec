"""Load test with faults, end to end through `serve run`: mixed tenants, adapters, chat and completions,
streamed and not, for minutes, while an engine replica, the Metering replica, the database and Redis are
knocked out and the Stripe stub fails under `loraplex billing export`; then the books are checked.

It prepares a fresh data dir the way `loraplex up` does (app.demo.prepare: migrations, demo model, public
demo adapters), adds tenants on four tiers (one tight: its 429s are intended) and some closed-hour usage
for the Stripe export, starts a Ray cluster of its own (loopback, free ports, never 6379), runs
`serve run` on a config derived from serve_config.yaml, and drives bench/locustfile.py's users in this
process. Invariants afterwards: only 200s and intended 429s (503s and mid-stream engine errors only for
requests that overlap a fault), no hung request, no concurrency lease left in the limiter, one usage row
per request served (failed/aborted rows only for requests that failed), tokens as answered, and Stripe's
totals equal to the rollups once the stub is healed (`loraplex billing reconcile`).

Run: python -m bench.load_test --duration 300 [--faults engine,metering,db,redis,stripe]
     [--backend ray|redis] [--database sqlite|postgres] [--users 8] [--keep] [--tiny]
The last line is one JSON object; the exit status is 1 if any invariant failed.
"""

import argparse
import contextlib
import json
import logging
import os
import secrets
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING, Any

import httpx
import yaml

from app.modelprep.demo_skills import SKILLS
from bench.load_faults import (
    HealableStripeStub,
    RedisServer,
    TcpProxy,
    free_port,
    postgres_outage,
    spawn,
    sqlite_outage,
    stop_tree,
    wait_for_port,
)
from bench.measure import machine

if TYPE_CHECKING:
    from bench.locustfile import Result

ROOT = Path(__file__).resolve().parents[1]
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


@dataclass
class TenantSetup:
    name: str
    tier: str
    tenant_id: str
    key: str
    users: int
    limited: bool


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


# --- the platform: processes we own -----------------------------------------------------------------------


class Platform:
    """Everything the run starts, so that `close()` stops exactly that and nothing else."""

    def __init__(self, options: Options, workdir: Path) -> None:
        self.options = options
        self.workdir = workdir
        self.data_dir = workdir / "data"
        self.http_port = free_port()
        self.gcs_port = free_port()
        self.url = f"http://127.0.0.1:{self.http_port}"
        self.gcs = f"127.0.0.1:{self.gcs_port}"
        self.admin_key = f"lp-admin-{secrets.token_urlsafe(32)}"
        self.key_secret = secrets.token_urlsafe(32)
        self.redis: RedisServer | None = None
        self.proxy: TcpProxy | None = None
        self.stub = HealableStripeStub()
        self.pg_admin = os.environ.get("LORAPLEX_TEST_POSTGRES_URL", DEFAULT_PG_ADMIN)
        self.pg_database: str | None = None
        self.database_url = f"sqlite:///{self.data_dir / 'loraplex.db'}"
        self.ray: subprocess.Popen[bytes] | None = None
        self.serve: subprocess.Popen[bytes] | None = None
        self.helpers: set[subprocess.Popen[str]] = set()

    # Environment for everything that runs platform code; the caller's LORAPLEX_*/RAY_* stay out of it.
    def env(self, **extra: str) -> dict[str, str]:
        base = {k: v for k, v in os.environ.items() if not k.startswith(("LORAPLEX_", "RAY_"))}
        return {
            **base,
            "RAY_AUTH_MODE": "disabled",  # Ray 2.60 turns token auth on for new clusters; loopback only here
            "RAY_USAGE_STATS_ENABLED": "0",
            "LORAPLEX_DATA_DIR": str(self.data_dir),
            "LORAPLEX_DATABASE_URL": self.database_url,
            "LORAPLEX_ADMIN_KEY": self.admin_key,
            "LORAPLEX_KEY_SECRET": self.key_secret,
            "LORAPLEX_ADAPTER_STORE": str(self.data_dir / "adapters"),
            **extra,
        }

    def start_services(self) -> None:
        self.data_dir.mkdir(parents=True)
        self.stub.__enter__()
        if self.options.backend == "redis":
            self.redis = RedisServer(self.workdir / "redis")
            self.redis.start()
            self.proxy = TcpProxy(self.redis.port)  # the platform talks to Redis through it
            self.proxy.start()
        if self.options.database == "postgres":
            self._create_postgres_database()

    def _create_postgres_database(self) -> None:
        import psycopg
        from psycopg import sql
        from sqlalchemy import make_url

        name = f"loraplex_bench_{uuid.uuid4().hex[:12]}"
        with psycopg.connect(self.pg_admin, autocommit=True, connect_timeout=10) as admin:
            admin.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
        self.pg_database = name
        url = make_url(self.pg_admin).set(drivername="postgresql+psycopg", database=name)
        self.database_url = url.render_as_string(hide_password=False)

    def serve_config(self) -> Path:
        """serve_config.yaml with: our port, our data dir's model, 2 engine and 2 ingress replicas, the
        chosen limiter backend, frequent replica reports."""
        config: dict[str, Any] = yaml.safe_load((ROOT / "serve_config.yaml").read_text())
        config["http_options"] = {
            **config.get("http_options", {}),
            "host": "127.0.0.1",
            "port": self.http_port,
        }
        app = config["applications"][0]
        args = app["args"]
        args["ingress_replicas"] = INGRESS_REPLICAS
        limiter: dict[str, Any] = {"backend": self.options.backend, "fail_open": False}
        if self.proxy is not None:
            limiter["redis_url"] = f"redis://127.0.0.1:{self.proxy.port}/0"
        args["rate_limiter"] = limiter
        models = [m for m in args["models"] if m["name"] == MODEL]
        if not models:
            raise RuntimeError(f"serve_config.yaml has no model {MODEL!r}")
        model = models[0]
        model.update(num_replicas=ENGINE_REPLICAS, report_interval_s=2, drain_timeout_s=30)
        model.pop("autoscaling", None)
        model["engine"]["model"] = str(self.data_dir / "models" / MODEL)
        args["models"] = [model]
        path = self.workdir / "serve_config.yaml"
        path.write_text(yaml.safe_dump(config, sort_keys=False))
        return path

    def start_ray(self) -> None:
        """A head node of our own: our ports, loopback, our temp dir (so no other cluster's address file
        is touched), stopped by process tree at the end, never by `ray stop` (that stops everyone's)."""
        ray = shutil.which("ray", path=str(Path(sys.executable).parent)) or "ray"
        command = [
            ray, "start", "--head", "--block", "--port", str(self.gcs_port), "--node-ip-address", "127.0.0.1",
            "--num-cpus", "2", "--include-dashboard", "false", "--disable-usage-stats",
            "--temp-dir", str(self.workdir / "ray"), "--object-store-memory", str(200 * 1024**2),
            "--ray-client-server-port", str(free_port()),
            "--dashboard-agent-listen-port", str(free_port()),
        ]  # fmt: skip
        self.ray = spawn(command, env=self.env(), log=self.workdir / "ray.log", cwd=ROOT)
        wait_for_port(self.gcs_port, timeout=120)

    def start_serve(self, config: Path) -> None:
        serve = shutil.which("serve", path=str(Path(sys.executable).parent)) or "serve"
        env = self.env(RAY_ADDRESS=self.gcs)
        self.serve = spawn([serve, "run", str(config)], env=env, log=self.workdir / "serve.log", cwd=ROOT)

    def ray_ops(self, *args: str, timeout: float = 400) -> dict[str, Any]:
        """bench.ray_ops in a driver process of its own (this process runs gevent, never Ray's client)."""
        command = [sys.executable, "-m", "bench.ray_ops", "--address", self.gcs, *args]
        process = subprocess.Popen(command, cwd=ROOT, env=self.env(), stdout=subprocess.PIPE,
                                   stderr=subprocess.PIPE, text=True)  # fmt: skip
        self.helpers.add(process)  # close() ends the ones still running (e.g. after a SIGTERM)
        try:
            stdout, stderr = process.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            process.kill()
            process.communicate()
            return {"ok": False, "error": f"bench.ray_ops {' '.join(args)} timed out"}
        finally:
            self.helpers.discard(process)
        return _last_json(stdout, stderr)

    def expected(self) -> str:
        return f"{ENGINE}={ENGINE_REPLICAS},ingress={INGRESS_REPLICAS},metering=1"

    def loraplex(self, *args: str, timeout: float = 300, **extra: str) -> tuple[int, dict[str, Any]]:
        """The `loraplex` CLI against our database (with --json); (exit code, parsed output)."""
        cli = shutil.which("loraplex", path=str(Path(sys.executable).parent)) or "loraplex"
        stripe = {
            "LORAPLEX_STRIPE_API_KEY": self.stub.api_key,
            "LORAPLEX_STRIPE_API_BASE": self.stub.url,
            **extra,
        }
        done = subprocess.run([cli, "--json", *args], cwd=self.workdir, env=self.env(**stripe),
                              capture_output=True, text=True, timeout=timeout, check=False)  # fmt: skip
        try:
            return done.returncode, json.loads(done.stdout)
        except ValueError:
            return done.returncode, {"stdout": done.stdout[-2000:], "stderr": done.stderr[-2000:]}

    @contextlib.contextmanager
    def database_outage(self) -> Iterator[None]:
        if self.pg_database is not None:
            with postgres_outage(self.pg_admin, self.pg_database):
                yield
        else:
            with sqlite_outage(self.data_dir / "loraplex.db"):
                yield

    def close(self) -> None:
        for helper in list(self.helpers):
            with contextlib.suppress(ProcessLookupError):
                helper.kill()
        stop_tree(self.serve, grace_s=60)  # Serve first: its driver asks the cluster to shut the app down
        stop_tree(self.ray, grace_s=30)
        if self.proxy is not None:
            self.proxy.close()
        if self.redis is not None:
            self.redis.stop()
        with contextlib.suppress(Exception):
            self.stub.__exit__(None, None, None)
        if self.pg_database is not None:
            import psycopg
            from psycopg import sql

            with psycopg.connect(self.pg_admin, autocommit=True, connect_timeout=10) as admin:
                admin.execute(sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(
                    sql.Identifier(self.pg_database)))  # fmt: skip


def _last_json(stdout: str, stderr: str) -> dict[str, Any]:
    for line in reversed(stdout.strip().splitlines()):
        if line.startswith("{"):
            with contextlib.suppress(ValueError):
                parsed: dict[str, Any] = json.loads(line)
                return parsed
    return {"ok": False, "error": "no JSON from bench.ray_ops", "stderr": stderr[-1500:]}


# --- preparation ----------------------------------------------------------------------------------------

# name, tier, Tier fields (None: a seeded tier), users, limited (has limits, so its 429s are intended)
TENANTS: tuple[tuple[str, str, dict[str, Any] | None, int, bool], ...] = (
    ("bench-ent", "enterprise", None, 3, False),
    ("bench-pro", "pro", None, 2, True),  # on_limit=queue: bursts wait up to 5 s
    ("bench-free", "free", None, 2, True),
    ("bench-tight", "bench-tight", {"rpm": 15, "max_concurrent": 2, "on_limit": "reject"}, 1, True),
)


def prepare(platform: Platform, config: Path, users: int) -> list[TenantSetup]:
    """`loraplex up`'s preparation (app.demo.prepare), then our tenants, keys and closed-hour usage."""
    from pydantic import SecretStr

    from app.auth import generate_key
    from app.demo import prepare as prepare_demo
    from app.settings import Settings
    from billing import adapter_registry, repository
    from billing.db import make_engine, make_session_factory, session_scope
    from billing.models import PUBLIC_OWNER

    settings = Settings(
        data_dir=platform.data_dir,
        database_url=platform.database_url,
        admin_key=SecretStr(platform.admin_key),
        key_secret=SecretStr(platform.key_secret),
        adapter_store=platform.data_dir / "adapters",
    )
    with contextlib.redirect_stdout(sys.stderr):  # import banners must not mix with the report
        prepare_demo(settings, config)
    engine = make_engine(platform.database_url)
    sessions = make_session_factory(engine)
    tenants: list[TenantSetup] = []
    weights = _user_split(users, [t[3] for t in TENANTS])
    with session_scope(sessions) as session:
        for (name, tier, tier_fields, _, limited), n_users in zip(TENANTS, weights, strict=True):
            if tier_fields is not None:
                repository.create_tier(session, name=tier, description="load test: tight", **tier_fields)
            tenant = repository.create_tenant(session, name=name, tier=tier)
            if name in STRIPE_CUSTOMERS:
                repository.update_tenant(
                    session, tenant_id=tenant.id, stripe_customer_id=STRIPE_CUSTOMERS[name]
                )
            key = generate_key(settings.resolved_key_secret())
            repository.create_api_key(session, tenant_id=tenant.id, prefix=key.prefix, key_hash=key.hash,
                                      name="load-test")  # fmt: skip
            tenants.append(TenantSetup(name, tier, tenant.id, key.plaintext, n_users, limited))
        sql_adapter = adapter_registry.find_live(session, owner=PUBLIC_OWNER, name="demo-sql")
        adapter_id = None if sql_adapter is None else sql_adapter.id
    _seed_closed_hours(sessions, [t for t in tenants if t.name in STRIPE_CUSTOMERS], adapter_id)
    engine.dispose()
    return tenants


def _user_split(users: int, weights: list[int]) -> list[int]:
    """`users` spread over the tenants by weight, at least one each (so every tier sees traffic)."""
    total = sum(weights)
    split = [max(1, round(users * w / total)) for w in weights]
    while sum(split) > max(users, len(weights)):
        split[len(split) - 1 - split[::-1].index(max(split))] -= 1  # the later (smaller) tenants give
    return split


def _seed_closed_hours(sessions: Any, tenants: list[TenantSetup], adapter_id: str | None) -> None:
    """Usage two and three hours back (closed hours: the only ones the Stripe export sends), so the
    export has events to deliver while the stub fails. Marked by their request ids."""
    from billing.db import session_scope
    from billing.usage import UsageRecord, closed_before, hour_of, record_usage, rollup_hours

    now = datetime.now(UTC)
    records = []
    for tenant in tenants:
        for back in (2, 3):
            for adapter in (None, adapter_id):
                for minute in (5, 35):
                    started = hour_of(now) - timedelta(hours=back) + timedelta(minutes=minute)
                    records.append(UsageRecord(
                        request_id=f"{SEED_PREFIX}{uuid.uuid4().hex}", tenant_id=tenant.tenant_id,
                        key_id="seed", model="public/demo-sql" if adapter else MODEL, base_model=MODEL,
                        adapter_id=adapter, adapter_version=1 if adapter else None, status="completed",
                        finish_reason="length", prompt_tokens=40 + back + minute, cached_tokens=8,
                        completion_tokens=12 + back, gpu_ms=25.5 * back, queue_ms=1.0, ttft_ms=5.0,
                        latency_ms=50.0, replica=None, started_at=started,
                        finished_at=started + timedelta(seconds=1),
                    ))  # fmt: skip
    with session_scope(sessions) as session:
        record_usage(session, records)
        rollup_hours(session, start=now - timedelta(hours=6), end=closed_before(now))


def write_plan(platform: Platform, tenants: list[TenantSetup]) -> Path:
    models = [MODEL, *(f"public/{skill.name}" for skill in SKILLS)]  # what `loraplex up` registered
    plan = {
        "tenants": [
            {"name": t.name, "tenant_id": t.tenant_id, "key": t.key, "users": t.users, "limited": t.limited}
            for t in tenants
        ],
        "models": models,
        "max_tokens": [2, 12],
    }
    path = platform.workdir / "plan.json"
    path.write_text(json.dumps(plan, indent=2))
    path.chmod(0o600)  # it holds API keys
    return path


# --- readiness and probes -----------------------------------------------------------------------------------


def one_request(
    url: str, tenant: TenantSetup, model: str, *, stream: bool, phase: str, timeout: float = 120
) -> "Result":
    """A request outside the load (warm-up, probe), recorded the same way so its usage row is expected."""
    from bench.locustfile import Result

    body: dict[str, Any] = {"model": model, "prompt": f"{phase} probe", "max_tokens": 3}
    if stream:
        body.update(stream=True, stream_options={"include_usage": True})
    headers = {"authorization": f"Bearer {tenant.key}"}
    result = Result(tenant.name, "completion", stream, model, 0, "transport", time.time(), 0.0)
    try:
        with (
            httpx.Client(base_url=url, timeout=timeout) as client,
            client.stream("POST", "/v1/completions", json=body, headers=headers) as response,
        ):
            result.status = response.status_code
            text = response.read().decode()
        if result.status == 200 and stream:
            events = [json.loads(line[6:]) for line in text.splitlines() if line.startswith("data: {")]
            error = next((e for e in events if "error" in e), None)
            result.request_id = events[0].get("id") if events else None
            usage = next((e["usage"] for e in events if e.get("usage")), None)
            result.usage = None if usage is None else (usage["prompt_tokens"], usage["completion_tokens"])
            ended = "data: [DONE]" in text
            result.outcome = "stream_error" if error else "ok" if ended else "truncated"
        elif result.status == 200:
            data = json.loads(text)
            result.request_id = data["id"]
            result.usage = (data["usage"]["prompt_tokens"], data["usage"]["completion_tokens"])
            result.outcome = "ok"
        else:
            result.outcome = "unavailable" if result.status == 503 else "other"
            result.detail = text[:300]
    except (httpx.HTTPError, ValueError, KeyError) as error:
        result.detail = f"{type(error).__name__}: {error}"[:300]
    result.ended = time.time()
    return result


def wait_ready(platform: Platform, tenants: list[TenantSetup], extra: list["Result"], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while True:
        if platform.serve is not None and platform.serve.poll() is not None:
            raise RuntimeError(
                f"serve run exited ({platform.serve.returncode}); see {platform.workdir}/serve.log"
            )
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(f"{platform.url}/healthz", timeout=5).status_code == 200:
                break
        if time.monotonic() > deadline:
            raise TimeoutError(f"the platform did not answer /healthz; see {platform.workdir}/serve.log")
        time.sleep(2)
    left = max(30.0, deadline - time.monotonic())
    state = platform.ray_ops(
        "--expect", platform.expected(), "--timeout", str(left), "healthy", timeout=left + 60
    )
    if not state.get("ok"):
        raise TimeoutError(f"deployments not healthy: {state}")
    ent = tenants[0]
    for model in (MODEL, "public/demo-sql"):  # warm: both engines' first batches, an adapter load
        while (warm := one_request(platform.url, ent, model, stream=False, phase="warmup")).outcome != "ok":
            extra.append(warm)
            if time.monotonic() > deadline:
                raise TimeoutError(f"warm-up request failed: {warm.status} {warm.detail}")
            time.sleep(2)
        extra.append(warm)


# --- faults -------------------------------------------------------------------------------------------------


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


# --- the load -----------------------------------------------------------------------------------------------


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
            _log(f"t={time.time() - t0:5.0f}s requests={len(recorder.results)} {dict(counts)}")
    recorder.stopping = True
    deadline = time.time() + 180  # the longest a running request may take to finish
    while recorder.in_flight and time.time() < deadline:
        gevent.sleep(0.2)
    hung = recorder.in_flight
    runner.quit()
    return list(recorder.results), t0, hung


# --- checks -------------------------------------------------------------------------------------------------


def overlaps(result: "Result", windows: list[tuple[float, float]]) -> bool:
    return any(result.started <= end and result.ended >= start for start, end in windows)


def classify(results: list["Result"], windows: list[tuple[float, float]]) -> dict[str, list["Result"]]:
    """ok, intended 429, fault-excused (503/mid-stream error overlapping a fault), unexpected."""
    groups: dict[str, list[Result]] = {"ok": [], "rate_limited": [], "fault": [], "unexpected": []}
    for r in results:
        if r.outcome in ("ok", "rate_limited"):
            groups[r.outcome].append(r)
        elif r.outcome in ("unavailable", "stream_error") and overlaps(r, windows):
            groups["fault"].append(r)
        else:
            groups["unexpected"].append(r)
    return groups


def wait_for_usage(platform: Platform, results: list["Result"], timeout: float) -> dict[str, Any]:
    """Poll the usage table until every answered request has its row and the table has stopped growing
    (late failed/aborted rows from retried outboxes), or the timeout. Returns the rows by request id."""
    from sqlalchemy import select

    from billing.db import make_engine, make_session_factory
    from billing.models import UsageEvent

    wanted = {r.request_id for r in results if r.request_id and r.outcome in ("ok", "stream_error")}
    engine = make_engine(platform.database_url)
    sessions = make_session_factory(engine)
    deadline = time.monotonic() + timeout
    stable_since, last_count = time.monotonic(), -1
    rows: dict[str, Any] = {}
    try:
        while True:
            with contextlib.suppress(Exception), sessions() as session:
                query = select(UsageEvent).where(~UsageEvent.request_id.startswith(SEED_PREFIX))
                rows = {row.request_id: row for row in session.scalars(query)}
            if len(rows) != last_count:
                stable_since, last_count = time.monotonic(), len(rows)
            settled = time.monotonic() - stable_since > 10
            if (wanted <= rows.keys() and settled) or time.monotonic() > deadline:
                return rows
            time.sleep(1)
    finally:
        engine.dispose()


def check_usage(results: list["Result"], rows: dict[str, Any], tenants: list[TenantSetup]) -> dict[str, Any]:
    """Per tenant: a completed row for each 200, a failed/aborted row for each mid-stream failure, no
    other rows but failed/aborted ones for requests that failed on the server, tokens as answered."""
    report: dict[str, Any] = {"tenants": {}, "ok": True, "tokens_ok": True}
    for tenant in tenants:
        mine = [r for r in results if r.tenant == tenant.name]
        theirs = {k: v for k, v in rows.items() if v.tenant_id == tenant.tenant_id}
        served = {r.request_id: r for r in mine if r.outcome == "ok" and r.request_id}
        broken = {r.request_id: r for r in mine if r.outcome == "stream_error" and r.request_id}
        server_failures = sum(1 for r in mine if r.status >= 500 or r.outcome in ("transport", "truncated"))
        missing = sorted(set(served) - theirs.keys())
        missing_failed = sorted(set(broken) - theirs.keys())
        wrong = sorted(i for i in served if i in theirs and theirs[i].status != "completed")
        wrong += sorted(i for i in broken if i in theirs and theirs[i].status not in ("failed", "aborted"))
        extra = sorted(theirs.keys() - served.keys() - broken.keys())
        extra_completed = [i for i in extra if theirs[i].status == "completed"]
        tokens_off = [
            i for i, r in served.items()
            if i in theirs and r.usage is not None
            and (theirs[i].prompt_tokens, theirs[i].completion_tokens) != r.usage
        ]  # fmt: skip
        ok = not (missing or missing_failed or wrong or extra_completed) and len(extra) <= server_failures
        report["tenants"][tenant.name] = {
            "rows": len(theirs),
            "served_200": len(served),
            "failed_mid_stream": len(broken),
            "rows_failed_or_aborted": sum(1 for v in theirs.values() if v.status in ("failed", "aborted")),
            "missing": missing[:5],
            "missing_count": len(missing) + len(missing_failed),
            "wrong_status": wrong[:5],
            "unexplained_rows": len(extra),
            "unexplained_completed": extra_completed[:5],
            "server_failures": server_failures,
            "tokens_mismatch": tokens_off[:5],
            "ok": ok,
        }
        report["ok"] = report["ok"] and ok
        report["tokens_ok"] = report["tokens_ok"] and not tokens_off
    return report


def check_leases(platform: Platform, tenants: list[TenantSetup]) -> dict[str, Any]:
    """Every tenant's live concurrency leases and queued waiters, read from the limiter itself."""
    ids = {t.tenant_id: t.name for t in tenants}
    if platform.redis is not None:
        import redis

        # Straight to the server, not through the proxy the platform uses.
        client = redis.Redis(port=platform.redis.port, socket_timeout=10, decode_responses=True)
        try:
            seconds, micros = client.time()
            now_ms = seconds * 1000 + micros // 1000
            counts: dict[str, dict[str, Any]] = {}
            for tid, name in ids.items():
                live = client.zrangebyscore(f"loraplex:rl:{{{tid}}}:leases", f"({now_ms}", "+inf")
                counts[name] = {
                    "leases": len(live),
                    "queued": int(client.zcard(f"loraplex:rl:{{{tid}}}:queue")),
                    "ids": sorted(str(member) for member in live)[:20],
                }
        finally:
            client.close()
        return {"ok": True, "tenants": counts}
    found = platform.ray_ops("leases", timeout=180)
    if not found.get("ok"):
        return {"ok": False, "error": found.get("error"), "tenants": {}}
    counts = {ids.get(tid, tid): c for tid, c in found.get("tenants", {}).items() if tid in ids}
    return {"ok": True, "tenants": counts}


def check_stripe(platform: Platform, sessions_url: str) -> dict[str, Any]:
    """Stripe healed: a full rollup and export must deliver everything, `billing reconcile` must find no
    discrepancy, and the stub's totals must equal the rollups of every closed hour (nothing lost, nothing
    counted twice)."""
    from sqlalchemy import select

    from billing.db import make_engine, make_session_factory
    from billing.models import Tenant, UsageRollup
    from billing.stripe_config import StripeConfig
    from billing.stripe_export import meter_values
    from billing.usage import closed_before, hour_of

    platform.stub.heal()
    now = datetime.now(UTC)
    rollup_code, _ = platform.loraplex("billing", "rollup", "--hours", "8")
    export_code, summary = platform.loraplex("billing", "export")
    start = (hour_of(now) - timedelta(hours=7)).strftime("%Y-%m-%dT%H:00Z")
    end = (hour_of(now) + timedelta(hours=1)).strftime("%Y-%m-%dT%H:00Z")
    reconcile_code, reconciled = platform.loraplex("billing", "reconcile", "--start", start, "--end", end)
    names = StripeConfig(api_key=platform.stub.api_key).event_names()
    expected: Counter[tuple[str, str]] = Counter()
    engine = make_engine(sessions_url)
    try:
        with make_session_factory(engine)() as session:
            customers = {t.id: t.stripe_customer_id for t in session.scalars(select(Tenant))}
            cutoff = closed_before(datetime.now(UTC))
            for rollup in session.scalars(select(UsageRollup).where(UsageRollup.hour < cutoff)):
                customer = customers.get(rollup.tenant_id)
                if customer:
                    for key, value in meter_values(rollup).items():
                        expected[(customer, names[key])] += value
    finally:
        engine.dispose()
    at_stripe = platform.stub.totals()
    identifiers = [e.identifier for e in list(platform.stub.events)]
    agree = {k: v for k, v in expected.items() if v} == {k: v for k, v in at_stripe.items() if v}
    ok = (
        rollup_code == 0
        and export_code == 0
        and summary.get("failed") == 0
        and summary.get("pending") == 0
        and reconcile_code == 0
        and agree
        and len(identifiers) == len(set(identifiers))
        and bool(expected)
    )
    return {
        "ok": ok,
        "export_exit": export_code,
        "export": {k: summary.get(k) for k in ("created", "sent", "failed", "duplicates", "pending")},
        "reconcile_exit": reconcile_code,
        "discrepancies": reconciled.get("discrepancies", reconciled) if reconcile_code else [],
        "stripe_events": len(identifiers),
        "stub_replays": platform.stub.replays,
        "stub_refused_duplicates": len(platform.stub.duplicates),
        "totals_agree": agree,
        "customers": sorted({c for c, _ in expected}),
    }


def probes(platform: Platform, tenants: list[TenantSetup], timeout: float) -> tuple[bool, list["Result"]]:
    """After the faults, with nothing restarted by hand: the enterprise tenant is served again, base model
    and adapter, streamed and not (a 503 is retried: recovery may still be under way)."""
    done: list[Result] = []
    ent = tenants[0]
    deadline = time.monotonic() + timeout
    for model, stream in ((MODEL, False), ("public/demo-poet", True), ("public/demo-sql", False)):
        while True:
            result = one_request(platform.url, ent, model, stream=stream, phase="probe")
            done.append(result)
            if result.outcome == "ok":
                break
            if time.monotonic() > deadline:
                return False, done
            time.sleep(2)
    return True, done


# --- report -------------------------------------------------------------------------------------------------


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    if len(values) == 1:
        return round(values[0], 1)
    return round(statistics.quantiles(values, n=100, method="inclusive")[int(q) - 1], 1)


def summary_table(results: list["Result"], tenants: list[TenantSetup], groups: dict[str, list["Result"]],
                  usage: dict[str, Any], leases: dict[str, Any]) -> str:  # fmt: skip
    excused = {id(r) for r in groups["fault"]}
    header = f"{'tenant':<12} {'tier':<12} {'users':>5} {'reqs':>6} {'200':>6} {'429':>5} {'503':>5} "
    header += f"{'strm_err':>8} {'excused':>7} {'other':>5} {'rows':>6} {'leases':>6}  usage"
    lines = [header, "-" * len(header)]
    for t in tenants:
        mine = [r for r in results if r.tenant == t.name]
        status = Counter(r.status for r in mine)
        outcomes = Counter(r.outcome for r in mine)
        fault = sum(1 for r in mine if id(r) in excused)
        other = len(mine) - outcomes["ok"] - outcomes["rate_limited"] - fault
        u = usage["tenants"].get(t.name, {})
        lease = leases.get("tenants", {}).get(t.name, {}).get("leases", 0)
        lines.append(
            f"{t.name:<12} {t.tier:<12} {t.users:>5} {len(mine):>6} {status[200]:>6} {status[429]:>5} "
            f"{status[503]:>5} {outcomes['stream_error']:>8} {fault:>7} {other:>5} {u.get('rows', 0):>6} "
            f"{lease:>6}  {'ok' if u.get('ok') else 'MISMATCH'}"
        )
    return "\n".join(lines)


def dump_results(path: Path, results: list["Result"], t0: float) -> None:
    """Every request, one JSON object a line (times relative to the load's start), for a post-mortem."""
    with path.open("w") as out:
        for r in results:
            row = {**vars(r), "started": round(r.started - t0, 3), "ended": round(r.ended - t0, 3)}
            out.write(json.dumps(row) + "\n")


def _log(message: str) -> None:
    print(f"[load_test {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


# --- main ---------------------------------------------------------------------------------------------------


def parse(argv: list[str] | None) -> Options:
    parser = argparse.ArgumentParser(
        prog="python -m bench.load_test", description=__doc__.split("\n\n")[0] if __doc__ else None
    )
    parser.add_argument("--duration", type=float, default=300.0, help="seconds of load (default 300)")
    parser.add_argument("--faults", default="", help=f"comma-separated, in order: {','.join(FAULTS)}")
    parser.add_argument(
        "--backend",
        choices=["ray", "redis"],
        default=None,
        help="rate-limiter backend (default: redis if the redis fault is asked for, else ray)",
    )
    parser.add_argument(
        "--database",
        choices=["sqlite", "postgres"],
        default="sqlite",
        help="postgres: a fresh database on LORAPLEX_TEST_POSTGRES_URL's server",
    )
    parser.add_argument("--users", type=int, default=8, help="concurrent simulated clients (default 8)")
    parser.add_argument("--outage", type=float, default=None, help="seconds each db/redis outage lasts")
    parser.add_argument("--keep", action="store_true", help="keep the work dir (logs, database) afterwards")
    parser.add_argument(
        "--tiny",
        action="store_true",
        help="the least load the checks accept (20 s, 4 users), faults only if asked: checks that it runs; "
        "still a few minutes, as Ray and `serve run` start",
    )
    args = parser.parse_args(argv)
    if args.tiny:
        args.duration, args.users = 20.0, 4
    faults = [f.strip() for f in args.faults.split(",") if f.strip()]
    unknown = [f for f in faults if f not in FAULTS]
    if unknown:
        parser.error(f"unknown fault(s) {unknown}; known: {', '.join(FAULTS)}")
    backend = args.backend or ("redis" if "redis" in faults else "ray")
    if "redis" in faults and backend != "redis":
        parser.error("the redis fault needs --backend redis")
    if args.duration < 20 or args.users < 4:
        parser.error("--duration must be at least 20 and --users at least 4 (one per tenant)")
    return Options(args.duration, faults, backend, args.database, args.users, args.keep, args.outage)


def main(argv: list[str] | None = None) -> int:
    # Before anything imports locust (bench.locustfile): gevent without monkey-patching. The users'
    # FastHttpUser client is gevent-native; the fault threads, Stripe stub and Redis proxy stay real
    # threads and never block the users' hub (patching after threads exist would break them).
    os.environ["LOCUST_SKIP_MONKEY_PATCH"] = "1"
    logging.getLogger("httpx").setLevel(logging.WARNING)
    options = parse(argv)
    workdir = Path(tempfile.mkdtemp(prefix="lpb-", dir="/tmp"))  # short: Ray's socket paths live in it
    platform = Platform(options, workdir)
    terminating = threading.Event()
    in_hub = threading.Event()

    def on_signal(signum: int, _frame: FrameType | None) -> None:
        terminating.set()
        if not in_hub.is_set():  # outside the gevent loop an exception is safe; inside, the loop polls
            raise Interrupted(signal.Signals(signum).name)

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    output: dict[str, Any] = {
        "bench": "load_test", "duration_s": options.duration, "workdir": str(workdir), "machine": machine(),
    }  # fmt: skip
    invariants: dict[str, bool] = {}
    injector = FaultInjector(platform, options.faults, options.duration, options.outage_s)
    try:
        _log(f"work dir {workdir}; backend {options.backend}; database {options.database}; "
             f"faults {options.faults or 'none'}")  # fmt: skip
        platform.start_services()
        config = platform.serve_config()
        _log("preparing data (migrations, demo model and adapters, tenants)...")
        tenants = prepare(platform, config, options.users)
        plan = write_plan(platform, tenants)
        _log(f"starting Ray (GCS {platform.gcs}) and serve run on {platform.url}...")
        platform.start_ray()
        platform.start_serve(config)
        extra: list[Result] = []
        wait_ready(platform, tenants, extra, timeout=600)
        _log(f"ready; load for {options.duration:.0f}s with {options.users} users")
        in_hub.set()
        results, t0, hung = run_load(platform, plan, options, injector, terminating.is_set)
        in_hub.clear()
        if terminating.is_set():
            raise Interrupted("signal during the load")
        _log(f"load done: {len(results)} requests; waiting for faults to finish and the platform to recover")
        injector.join(timeout=420)
        injector.cancel()
        healthy = platform.ray_ops("--expect", platform.expected(), "--timeout", "300", "healthy")
        probed_ok, probe_results = probes(platform, tenants, timeout=180)
        extra += probe_results
        _log("waiting for metering to drain...")
        everything = results + extra
        rows = wait_for_usage(platform, everything, timeout=300)
        leases = check_leases(platform, tenants)
        usage = check_usage(everything, rows, tenants)
        groups = classify(results, injector.windows())
        ids = [r.request_id for r in everything if r.request_id]
        tight = [t for t in tenants if t.name == "bench-tight"]
        invariants = {
            "only_expected_statuses": not groups["unexpected"],
            "no_hung_requests": hung == 0,
            "intended_429s_seen": any(r.tenant in {t.name for t in tight} for r in groups["rate_limited"]),
            "no_leaked_leases": leases.get("ok", False)
            and all(c.get("leases", 0) == 0 and c.get("queued", 0) == 0 for c in leases["tenants"].values()),
            "usage_rows_match_served": usage["ok"],
            "usage_tokens_match": usage["tokens_ok"],
            "no_duplicate_request_ids": len(ids) == len(set(ids)),
            "platform_recovered": bool(healthy.get("ok")) and probed_ok,
            "faults_injected": all(r.ok for r in injector.records.values())
            and all(r.started_at is not None for r in injector.records.values()),
        }
        stripe: dict[str, Any] | None = None
        if "stripe" in options.faults:
            stripe = check_stripe(platform, platform.database_url)
            invariants["stripe_export_reconciled"] = stripe["ok"]
        ok_latency = [r.latency_ms for r in groups["ok"]]
        span = max((r.ended for r in results), default=t0) - t0
        print(summary_table(results, tenants, groups, usage, leases), flush=True)
        for r in groups["unexpected"][:10]:
            print(f"  unexpected: t={r.started - t0:.1f}..{r.ended - t0:.1f}s {r.tenant} {r.kind} "
                  f"stream={r.stream} {r.model} -> {r.status} {r.outcome} {r.error_code or ''} "
                  f"{r.detail[:160]}", flush=True)  # fmt: skip
        for name, held in leases.get("tenants", {}).items():
            for lease_id in held.get("ids", []):
                owner = next((r for r in everything if r.request_id == lease_id), None)
                seen = ""
                if owner is not None:
                    when = f"t={owner.started - t0:.1f}..{owner.ended - t0:.1f}s"
                    seen = f" (its request: {owner.status} {owner.outcome}, {when})"
                print(f"  lease still held: {name} {lease_id}{seen}", flush=True)
        dump_results(workdir / "results.jsonl", everything, t0)
        faults = {name: rec.as_json(t0) for name, rec in injector.records.items()}
        if stripe is not None:
            faults.setdefault("stripe", {})["after_recovery"] = stripe
        output.update(
            requests=len(results),
            rps=round(len(results) / span, 2) if span > 0 else 0.0,
            p50_ms=percentile(ok_latency, 50),
            p95_ms=percentile(ok_latency, 95),
            status_counts={str(k): v for k, v in sorted(Counter(r.status for r in results).items())},
            outcomes={
                "ok": len(groups["ok"]),
                "intended_429": len(groups["rate_limited"]),
                "fault_503": sum(1 for r in groups["fault"] if r.outcome == "unavailable"),
                "fault_stream_error": sum(1 for r in groups["fault"] if r.outcome == "stream_error"),
                "unexpected": len(groups["unexpected"]),
            },
            backend=options.backend,
            database=options.database,
            faults=faults,
            usage_rows=len(rows),
            leases=leases.get("tenants"),
            invariants=invariants,
        )
    except Interrupted as stopped:
        injector.cancel()
        invariants["completed"] = False
        output["error"] = f"interrupted ({stopped})"
    except Exception as error:
        injector.cancel()
        invariants["completed"] = False
        output["error"] = f"{type(error).__name__}: {error}"
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # cleanup must not be cut short
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        platform.close()
    passed = bool(invariants) and all(invariants.values())
    output["invariants"] = invariants
    if passed and not options.keep:
        shutil.rmtree(workdir, ignore_errors=True)
        output.pop("workdir")
    else:
        _log(f"work dir kept: {workdir} (serve.log, ray.log, data/loraplex.db)")
    if not passed:
        (workdir / "report.json").write_text(json.dumps(output, indent=2))
    print(json.dumps(output), flush=True)
    return 0 if passed else 1


if __name__ == "__main__":
    sys.exit(main())
