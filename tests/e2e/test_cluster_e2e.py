"""loraplex on a real multi-node Ray cluster on this host, deployed as README "Running on a cluster" says:
`ray start --head` (node A: ingress, metering, Serve's controller and proxy), `ray start --address` for an
engine node B, `serve deploy docs/cluster/serve_config.yaml` through the head's dashboard, PostgreSQL
and Redis from the environment, adapters in S3 (moto's server) that every node reads, each node with its
own adapter cache directory (set in the environment of its `ray start`, which its workers inherit). Ray's
token auth is on (one token file for every node and `serve deploy`); only node A's environment has the
admin key and the key secret.

An adapter uploaded through A's admin listener with the CLI is served by the engine replica on B exactly
as HF PEFT generates it. Then node B is killed (its raylet and every process it started: one process
session) while a stream runs on it: the stream ends with a clear error, Serve restarts the engine replica
on node C (started once the app ran on B, offering the same engine resource), which loads the adapter
again from the store into its own empty cache; serving resumes with the same output, and every request
that reached an engine has exactly one usage row in PostgreSQL.
"""

import contextlib
import functools
import json
import os
import random
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import boto3
import httpx
import psutil
import psycopg
import pytest
import redis
import yaml
from moto.server import ThreadedMotoServer
from psycopg import sql
from ray.serve.schema import ServeDeploySchema
from sqlalchemy import make_url, select
from typer.testing import CliRunner

from app.cli import build_app as cli_app
from app.schemas.openai import ChatMessage
from app.served_models.prompts import PromptBuilder
from billing.db import make_engine, make_session_factory
from billing.models import UsageEvent
from deployments.builder import build_app
from tests.app.conftest import ADMIN_KEY
from tests.ci import missing
from tests.conftest import POSTGRES_ADMIN_URL
from tests.e2e.conftest import wait_for
from tests.e2e.test_adapters_e2e import LONG, LONG_PROMPT
from tests.engine.reference import PeftReference
from tests.model_fixtures import TinySetup

_PORTS = iter(random.Random().sample(range(20000, 32000), 2000))


def free_port() -> int:
    """A free port outside Linux's ephemeral range (32768-60999, which Ray's own processes bind port 0 in)
    and Ray's worker ports (10002-19999): picked here, bound later by a process we start, so no Ray process
    started in between can have taken it."""
    for port in _PORTS:
        with socket.socket() as probe:
            try:
                probe.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError("no free port in 20000-32000")


ROOT = Path(__file__).resolve().parents[2]
CONFIG = ROOT / "docs" / "cluster" / "serve_config.yaml"
BIN = Path(sys.executable).parent
MODEL = "tiny-llama"
ADAPTER = "demo-sql"  # greedy on it runs all of LONG for LONG_PROMPT
SHORT = 24  # tokens compared with PEFT
REDIS_URL = os.environ.get("LORAPLEX_TEST_REDIS_URL", "redis://127.0.0.1:6379/0")


@dataclass
class Node:
    """One `ray start --block`, the leader of a process session of its own: its raylet, agents and every
    worker it starts stay in that session (workers get process groups of their own, not sessions), so
    the session is exactly this node's processes."""

    name: str
    process: subprocess.Popen[bytes]
    log: Path
    cache_dir: Path
    # A worker node's `ray start` again, on new ports: one that exits before starting (a probed port taken
    # by another cluster of the suite meanwhile) is started again, twice at most.
    relaunch: Callable[[], tuple[subprocess.Popen[bytes], Path]] | None = None
    relaunched: int = 0

    def cached(self) -> list[str]:
        """The adapter versions in this node's cache: `<adapter id>/v<N>`, from its directory names."""
        return sorted(str(p.parent.relative_to(self.cache_dir)).split(".")[0]
                      for p in self.cache_dir.glob("*/v*/adapter_model.safetensors"))  # fmt: skip

    def pids(self) -> list[int]:
        found = []
        for proc in psutil.process_iter():
            try:
                if os.getsid(proc.pid) == self.process.pid:
                    found.append(proc.pid)
            except (ProcessLookupError, PermissionError):
                continue
        return found

    def kill(self, first: int | None = None) -> int:
        """SIGKILL every process of this node, as a machine that is lost: `first` (the engine replica
        streaming, say) before scanning for the rest, which takes a while on a loaded host (on a fast CPU the
        stream would otherwise be over by then)."""
        if first is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(first, signal.SIGKILL)
        pids = self.pids()
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        self.process.wait(timeout=30)
        return len(pids)

    def started(self) -> bool:
        if self.process.poll() is not None:
            output = self.log.read_text()[-3000:]
            if self.relaunch is None or self.relaunched >= 2 or "Ray runtime started" in output:
                raise AssertionError(f"ray start for node {self.name} exited: {output}")
            print(f"ray start for node {self.name} exited before starting; again on new ports: {output}")
            self.relaunched += 1
            self.process, self.log = self.relaunch()
            return False
        return "Ray runtime started" in self.log.read_text()


@dataclass
class Cluster:
    root: Path
    env: dict[str, str]  # every node's, and `serve deploy`'s
    ingress_env: dict[str, str]  # over it on node A, where the ingress runs: the secrets
    ray_token: str
    gcs_port: int
    dashboard: str
    url: str
    admin_url: str
    database_url: str
    nodes: dict[str, Node] = field(default_factory=dict)

    def start_node(self, name: str, resources: dict[str, float], *, head: bool = False) -> Node:
        """`ray start` as the README has it, plus the ports one host needs apart for several nodes."""
        cache_dir = self.root / f"cache-{name}"
        process, log = self._launch(name, resources, head, cache_dir)
        relaunch = None if head else functools.partial(self._launch, name, resources, head, cache_dir)
        node = self.nodes[name] = Node(name, process, log, cache_dir, relaunch)
        return node

    def _launch(
        self, name: str, resources: dict[str, float], head: bool, cache_dir: Path
    ) -> tuple[subprocess.Popen[bytes], Path]:
        args = [f"--resources={json.dumps(resources)}", "--num-cpus=1", "--disable-usage-stats", "--block"]
        args += [f"--{port}={free_port()}" for port in (
            "dashboard-agent-listen-port", "dashboard-agent-grpc-port", "runtime-env-agent-port",
            "metrics-export-port", "node-manager-port", "object-manager-port",
        )]  # fmt: skip
        if head:
            args += [
                "--head", f"--port={self.gcs_port}", f"--temp-dir={self.root / 'ray'}",
                "--include-dashboard=true", "--dashboard-host=127.0.0.1",
                f"--dashboard-port={self.dashboard.rsplit(':', 1)[1]}",
                f"--ray-client-server-port={free_port()}",
            ]  # fmt: skip
        else:
            args.append(f"--address=127.0.0.1:{self.gcs_port}")
        log = self.root / f"node-{name}-{uuid.uuid4().hex[:6]}.log"
        own = {**self.env, **(self.ingress_env if head else {}), "LORAPLEX_ADAPTER_CACHE_DIR": str(cache_dir)}
        process = subprocess.Popen(
            [str(BIN / "ray"), "start", *args],
            env=_environment(own),
            stdout=log.open("wb"),
            stderr=subprocess.STDOUT,
            start_new_session=True,  # the node's session: see Node
        )
        return process, log

    def api(self, path: str) -> Any:
        headers = {"authorization": f"Bearer {self.ray_token}"}
        return httpx.get(f"{self.dashboard}{path}", headers=headers, timeout=10).json()

    def engine_replicas(self, deployment: str = f"engine-{MODEL}") -> list[dict[str, Any]]:
        """A deployment's running replicas (id, pid, node) as Serve's controller has them."""
        try:
            apps = self.api("/api/serve/applications/")["applications"]
        except (httpx.HTTPError, ValueError):
            return []
        found = apps.get("loraplex", {}).get("deployments", {}).get(deployment, {})
        return [r for r in found.get("replicas", []) if r["state"] == "RUNNING"]

    def node_of(self, pid: int) -> str:
        session = os.getsid(pid)
        return next(name for name, node in self.nodes.items() if node.process.pid == session)

    def admin(self) -> httpx.Client:
        return httpx.Client(
            base_url=self.admin_url, headers={"authorization": f"Bearer {ADMIN_KEY}"}, timeout=60
        )

    def cli(self, *args: str) -> Any:
        """The admin CLI (`loraplex --url <node A's admin listener> ...`), in this process."""
        result = CliRunner().invoke(
            cli_app(), ["--json", "--url", self.admin_url, "--admin-key", ADMIN_KEY, *args]
        )
        assert result.exit_code == 0, result.output
        return json.loads(result.stdout)

    def stop(self) -> None:
        for node in self.nodes.values():
            if node.process.poll() is None:
                node.kill()


@contextlib.contextmanager
def _postgres_database() -> Iterator[str]:
    """A fresh database on the test server, dropped afterwards."""
    try:
        admin = psycopg.connect(POSTGRES_ADMIN_URL, autocommit=True, connect_timeout=5)
    except psycopg.OperationalError as exc:
        missing(f"PostgreSQL unreachable at {POSTGRES_ADMIN_URL}: {' '.join(str(exc).split())}")
    name = f"loraplex_cluster_{uuid.uuid4().hex[:12]}"
    with admin:
        admin.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
        try:
            url = make_url(POSTGRES_ADMIN_URL).set(drivername="postgresql+psycopg", database=name)
            yield url.render_as_string(hide_password=False)
        finally:
            admin.execute(sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name)))


@contextlib.contextmanager
def _s3_bucket() -> Iterator[dict[str, str]]:
    """moto's S3 server on a free port with one bucket, `adapters`; the AWS environment that reaches it."""
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=free_port(), verbose=False)
    server.start()
    try:
        host, port = server.get_host_and_port()
        aws = {"AWS_ENDPOINT_URL": f"http://{host}:{port}", "AWS_ACCESS_KEY_ID": "testing",
               "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1"}  # fmt: skip
        boto3.client(
            "s3", endpoint_url=aws["AWS_ENDPOINT_URL"], region_name="us-east-1",
            aws_access_key_id="testing", aws_secret_access_key="testing",
        ).create_bucket(Bucket="adapters")  # fmt: skip
        yield aws
    finally:
        server.stop()


def _serve_config(setup: TinySetup, http_port: int, admin_port: int) -> dict[str, Any]:
    """docs/cluster/serve_config.yaml with this host's changes: one proxy (HeadOnly: the nodes share a
    host, so EveryNode proxies would fight over the port), a free port for the admin listener, the tiny
    model, one engine."""
    config: dict[str, Any] = yaml.safe_load(CONFIG.read_text())
    config["proxy_location"] = "HeadOnly"
    config["http_options"] = {"host": "127.0.0.1", "port": http_port}
    config["logging_config"]["encoding"] = "TEXT"
    args = config["applications"][0]["args"]
    args["ingress_replicas"] = 1
    # The recipe's ingress settings, as they are: admin on a loopback listener, the balancer's header,
    # nothing on the public port that describes the API or names a model.
    ingress = args["ingress_settings"]
    assert ingress["admin_listen"].startswith("127.0.0.1:")
    assert ingress["client_ip_header"] == "x-forwarded-for"
    assert ingress["public_docs"] is False and ingress["public_readiness_checks"] is False
    ingress["admin_listen"] = f"127.0.0.1:{admin_port}"
    assert "redis_url" not in args["rate_limiter"]  # from LORAPLEX_REDIS_URL, on every node
    [model] = args["models"]
    model.update(name=MODEL, num_replicas=1, report_interval_s=1.0)
    model["engine"] = {
        "model": str(setup.model_dir), "num_kv_blocks": 256, "block_size": 4, "max_num_seqs": 16,
        "max_num_batched_tokens": 128, "max_loras": 4,
    }  # fmt: skip
    return config


@pytest.fixture(scope="module")
def cluster(tiny_setups: dict[str, TinySetup]) -> Iterator[Cluster]:
    try:
        redis.Redis.from_url(REDIS_URL, socket_connect_timeout=2).ping()
    except redis.RedisError as exc:
        missing(f"Redis unreachable at {REDIS_URL}: {exc}")
    with contextlib.ExitStack() as cleanup:
        database_url = cleanup.enter_context(_postgres_database())
        migrated = CliRunner().invoke(
            cli_app(), ["db", "upgrade"], env={"LORAPLEX_DATABASE_URL": database_url}
        )
        assert migrated.exit_code == 0, migrated.output
        aws = cleanup.enter_context(_s3_bucket())
        root = Path(tempfile.mkdtemp(prefix="lpx-cluster-"))  # short: Ray's socket paths live under it
        cleanup.callback(shutil.rmtree, root, ignore_errors=True)
        admin_port, http_port = free_port(), free_port()
        ray_token = secrets.token_hex(32)
        token_path = root / "ray_token"
        token_path.touch(mode=0o600)
        token_path.write_text(ray_token)
        env = {
            **aws,
            "RAY_AUTH_MODE": "token",  # as the recipe has it: the same token file for every node
            "RAY_AUTH_TOKEN_PATH": str(token_path),
            "LORAPLEX_DATABASE_URL": database_url,
            "LORAPLEX_DATA_DIR": str(root / "data"),
            "LORAPLEX_ADAPTER_STORE": "s3://adapters/store",
            "LORAPLEX_REDIS_URL": REDIS_URL,  # the docs config leaves the limiter to the environment
            "LORAPLEX_AUTH_CACHE_TTL_S": "0.2",
            # The GCS declares a lost node dead within ~2 s instead of Ray's default ~30 s.
            "RAY_health_check_period_ms": "500",
            "RAY_health_check_timeout_ms": "500",
            "RAY_health_check_failure_threshold": "3",
        }
        # Only where the ingress runs (node A): engine nodes need neither.
        ingress_env = {"LORAPLEX_ADMIN_KEY": ADMIN_KEY, "LORAPLEX_KEY_SECRET": "cluster-test-secret"}
        cluster = Cluster(
            root, env, ingress_env, ray_token, free_port(), f"http://127.0.0.1:{free_port()}",
            f"http://127.0.0.1:{http_port}", f"http://127.0.0.1:{admin_port}", database_url,
        )  # fmt: skip
        cleanup.callback(cluster.stop)
        head = cluster.start_node("a", {"loraplex_ingress": 1, "node_a": 1}, head=True)
        wait_for(lambda: _listening(cluster.gcs_port) or head.started(), "the head's GCS", 60)
        b = cluster.start_node("b", {"loraplex_engine": 1, "node_b": 1})
        wait_for(lambda: head.started() and b.started(), "nodes A and B", 90)
        config = root / "serve_config.yaml"
        config.write_text(yaml.safe_dump(_serve_config(tiny_setups["llama"], http_port, admin_port)))
        deployed = subprocess.run(
            [str(BIN / "serve"), "deploy", str(config), "--address", cluster.dashboard],
            env=_environment(env), capture_output=True, text=True, timeout=120,
        )  # fmt: skip
        assert deployed.returncode == 0, deployed.stderr
        wait_for(lambda: _ready(cluster), "the application on the cluster", 180, every=0.5)
        # Node C offers the engine resource too, from now on: where the replica goes when B is lost.
        cluster.start_node("c", {"loraplex_engine": 1, "node_c": 1})
        yield cluster


@pytest.fixture(autouse=True)
def _serve_logs_on_failure(request: pytest.FixtureRequest) -> Iterator[None]:
    """A failed cluster test prints the tails of the ingress and engine replicas' Serve logs and of the
    nodes' `ray start` output: the cluster's directory is gone by the time anyone reads the CI log."""
    yield
    report = getattr(request.node, "rep_call", None)
    if "cluster" not in request.fixturenames or report is None or not report.failed:
        return
    cluster: Cluster = request.getfixturevalue("cluster")
    logs = sorted((cluster.root / "ray" / "session_latest").glob("logs/serve/replica_loraplex_*.log"))
    for log in [*logs, *(node.log for node in cluster.nodes.values())]:
        tail = log.read_text(errors="replace").splitlines()[-40:]
        print(f"--- {log.name} (last {len(tail)} lines)", *tail, sep="\n")


def _environment(own: dict[str, str]) -> dict[str, str]:
    """This process's environment without what an earlier test left for its own app or cluster."""
    inherited = {k: v for k, v in os.environ.items() if not k.startswith(("LORAPLEX_", "AWS_", "RAY_"))}
    return {**inherited, **own}


def _listening(port: int) -> bool:
    try:
        socket.create_connection(("127.0.0.1", port), timeout=1).close()
    except OSError:
        return False
    return True


def _ready(cluster: Cluster) -> bool:
    try:
        return httpx.get(f"{cluster.url}/readyz", timeout=5).status_code == 200
    except httpx.HTTPError:
        return False


@dataclass
class Uploaded:
    tenant_id: str
    key: str
    name: str
    adapter_id: str
    expected: str  # PEFT's greedy text for LONG_PROMPT, SHORT tokens
    upload_s: float  # `loraplex adapters upload`, start to stored
    servable_s: float  # stored to the first completion on node B
    answered: list[str]  # ids of the requests answered 200 so far


@pytest.fixture(scope="module")
def uploaded(cluster: Cluster, tiny_setups: dict[str, TinySetup]) -> Uploaded:
    setup = tiny_setups["llama"]
    with cluster.admin() as admin:
        tenant = admin.post(
            "/admin/tenants", json={"name": f"cl-{uuid.uuid4().hex[:8]}", "tier": "enterprise"}
        )
        tenant_id = tenant.json()["id"]
        key = admin.post(f"/admin/tenants/{tenant_id}/keys", json={}).json()["key"]
    warm = chat(cluster, key, MODEL, 2)  # the engine's first request: not the adapter's time to count
    assert warm.status_code == 200, warm.text
    started = time.monotonic()
    made = cluster.cli(
        "adapters", "upload", str(setup.adapter_dirs[ADAPTER]), "--name", "story", "--owner", tenant_id,
        "--base-model", MODEL,
    )  # fmt: skip
    stored = time.monotonic()

    sent = [0.0]

    def served() -> dict[str, Any] | None:  # 404 until the ingress sees the new adapter: no engine reached
        sent[0] = time.monotonic()
        r = chat(cluster, key, "story", SHORT)
        assert r.status_code in (200, 404), r.text
        return r.json() if r.status_code == 200 else None

    first = wait_for(served, "the uploaded adapter served", 60, every=0.05)
    servable = time.monotonic()
    print(f"cluster timings: the first completion on B took {servable - sent[0]:.2f} s")
    assert made["name"] == "story"
    prompts = PromptBuilder(setup.model_dir)
    tokens = PeftReference(setup.model_dir, {ADAPTER: setup.adapter_dirs[ADAPTER]}).greedy(
        prompts.chat([ChatMessage(**m) for m in LONG_PROMPT]), ADAPTER, SHORT
    )
    expected = prompts.tokenizer.decode(tokens, skip_special_tokens=True)
    assert isinstance(expected, str)  # one sequence of ids decodes to one string
    assert first["choices"][0]["message"]["content"] == expected
    return Uploaded(
        tenant_id,
        key,
        "story",
        made["id"],
        expected,
        stored - started,
        servable - stored,
        [warm.json()["id"], first["id"]],
    )


def chat(cluster: Cluster, key: str, model: str, max_tokens: int) -> httpx.Response:
    return httpx.post(
        f"{cluster.url}/v1/chat/completions",
        json={"model": model, "messages": LONG_PROMPT, "max_tokens": max_tokens, "temperature": 0},
        headers={"authorization": f"Bearer {key}"},
        timeout=60,
    )


@pytest.mark.slow
def test_served_on_the_engine_node_as_peft(cluster: Cluster, uploaded: Uploaded) -> None:
    [replica] = cluster.engine_replicas()
    assert cluster.node_of(replica["pid"]) == "b"
    # Every worker of a node inherits its `ray start` environment: B's engine has B's cache directory.
    engine_env = psutil.Process(replica["pid"]).environ()
    assert engine_env["LORAPLEX_ADAPTER_CACHE_DIR"] == str(cluster.nodes["b"].cache_dir)
    assert engine_env["LORAPLEX_DATABASE_URL"] == cluster.database_url
    # Neither secret on the engine node; both where the ingress runs.
    assert not engine_env.get("LORAPLEX_ADMIN_KEY") and not engine_env.get("LORAPLEX_KEY_SECRET")
    [ingress] = cluster.engine_replicas("ingress")
    assert psutil.Process(ingress["pid"]).environ()["LORAPLEX_ADMIN_KEY"] == ADMIN_KEY
    # The adapter came from the object store into B's own cache, and no other node's.
    assert cluster.nodes["b"].cached() == [f"{uploaded.adapter_id}/v1"]
    assert cluster.nodes["c"].cached() == []
    r = chat(cluster, uploaded.key, uploaded.name, SHORT)
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] == uploaded.expected
    uploaded.answered.append(r.json()["id"])
    took = {"upload_s": round(uploaded.upload_s, 2), "stored_to_served_on_b_s": round(uploaded.servable_s, 2)}
    print(f"cluster timings: {json.dumps(took)}")


@pytest.mark.slow
def test_the_recipe_keeps_the_cluster_closed(cluster: Cluster) -> None:
    """Ray's dashboard runs nothing for a caller without the cluster's token; the public port has no admin
    API, no API docs, and a /readyz that names no model; the admin listener has all three."""
    job, jobs = {"entrypoint": "cat /proc/self/environ"}, f"{cluster.dashboard}/api/jobs/"
    assert httpx.post(jobs, json=job, timeout=10).status_code == 401
    wrong = {"authorization": f"Bearer {secrets.token_hex(32)}"}
    assert httpx.post(jobs, json=job, headers=wrong, timeout=10).status_code == 403
    assert httpx.get(f"{cluster.dashboard}/api/serve/applications/", timeout=10).status_code == 401
    admin = {"authorization": f"Bearer {ADMIN_KEY}"}
    assert httpx.get(f"{cluster.url}/admin/tenants", headers=admin, timeout=10).status_code == 404
    for path in ("/docs", "/openapi.json"):
        assert httpx.get(f"{cluster.url}{path}", timeout=10).status_code == 404, path
        assert httpx.get(f"{cluster.admin_url}{path}", timeout=10).status_code == 200, path
    ready = httpx.get(f"{cluster.url}/readyz", timeout=10)
    assert ready.json() == {"status": "ready"} and MODEL not in ready.text
    checks = httpx.get(f"{cluster.admin_url}/readyz", timeout=10).json()["checks"]
    assert checks[f"engine:{MODEL}"] == "ok"


@pytest.mark.slow
def test_engine_node_lost_mid_stream(cluster: Cluster, uploaded: Uploaded) -> None:
    [before] = cluster.engine_replicas()
    assert cluster.node_of(before["pid"]) == "b"
    wait_for(lambda: cluster.nodes["c"].started(), "node C", 90)
    body = {"model": uploaded.name, "messages": LONG_PROMPT, "max_tokens": LONG, "stream": True}
    events: list[dict[str, Any]] = []
    killed_at = None
    with httpx.stream(
        "POST", f"{cluster.url}/v1/chat/completions", json=body,
        headers={"authorization": f"Bearer {uploaded.key}"}, timeout=60,
    ) as stream:  # fmt: skip
        for line in stream.iter_lines():
            if line.startswith("data: {"):
                events.append(json.loads(line[6:]))
                if len(events) == 3:
                    killed_at = time.monotonic()
                    assert cluster.nodes["b"].kill(first=before["pid"]) > 3  # raylet, agents, workers
    assert killed_at is not None and len(events) < LONG // 2, "the stream ended before node B was lost"
    error = events[-1].get("error")
    assert error is not None and error["code"] == "engine_unavailable", events[-1]
    assert "retry" in error["message"]

    # Serve restarts the replica on the node that still offers the engine resource: C, not A.
    def replaced() -> dict[str, Any] | None:
        return next((r for r in cluster.engine_replicas() if r["replica_id"] != before["replica_id"]), None)

    after = wait_for(replaced, "the engine replica restarted", 120)
    assert cluster.node_of(after["pid"]) == "c"
    restarted_at = time.monotonic()
    refused = []

    def served() -> dict[str, Any] | None:  # 503 engine_unavailable while the router still has B's replica
        r = chat(cluster, uploaded.key, uploaded.name, SHORT)
        assert r.status_code in (200, 503), r.text
        refused.append(r.status_code == 503)
        return r.json() if r.status_code == 200 else None

    resumed = wait_for(served, "serving on node C", 60)
    assert resumed["choices"][0]["message"]["content"] == uploaded.expected
    assert cluster.nodes["c"].cached() == [f"{uploaded.adapter_id}/v1"]  # fetched again, into C's cache
    resumed_at = time.monotonic()
    took = {"lost_to_running_on_c_s": round(restarted_at - killed_at, 2),
            "lost_to_served_on_c_s": round(resumed_at - killed_at, 2)}  # fmt: skip
    print(f"cluster timings: {json.dumps(took)}")

    # Exactly once: each request that reached an engine has one usage row (the table's key forbids two):
    # the answered ones, the lost stream as failed on B's replica, and at most the refused retries besides.
    stream_id = events[0]["id"]
    answered = [*uploaded.answered, stream_id, resumed["id"]]
    sessions = make_session_factory(make_engine(cluster.database_url))

    def rows() -> dict[str, UsageEvent] | None:
        with sessions() as session:
            found = session.scalars(select(UsageEvent).where(UsageEvent.tenant_id == uploaded.tenant_id))
            by_id = {r.request_id: r for r in found}
        return by_id if set(answered) <= by_id.keys() else None

    by_id = wait_for(rows, "a usage row for every answered request", 60)
    others = [r for r in by_id.values() if r.request_id not in answered]
    assert len(others) <= sum(refused) and all(r.status == "failed" for r in others)
    assert by_id[stream_id].status == "failed"
    assert by_id[stream_id].replica == f"{MODEL}:{before['replica_id']}"
    assert by_id[resumed["id"]].status == "completed"
    assert by_id[resumed["id"]].replica == f"{MODEL}:{after['replica_id']}"


def test_placement_options_reach_each_deployment(monkeypatch: pytest.MonkeyPatch) -> None:
    """The cluster config is one `serve deploy` accepts, and its `ray_actor_options` go over the builder's
    defaults (num_cpus 0, num_gpus)."""
    monkeypatch.setenv("LORAPLEX_REDIS_URL", REDIS_URL)  # as every node's environment has it
    config = yaml.safe_load(CONFIG.read_text())
    ServeDeploySchema.model_validate(config)
    args = config["applications"][0]["args"]
    ingress = build_app(
        {**args, "models": [{**args["models"][0], "engine": {"model": "/m", "device": "cpu"}}]}
    )
    init: tuple[Any, ...] = ingress._bound_deployment.init_args  # (handles, models, limiter, metering)
    handles, metering = init[0], init[3]
    options = {
        "ingress": ingress._bound_deployment.ray_actor_options,
        "metering": metering._bound_deployment.ray_actor_options,
        "engine": handles["demo-llama"]._bound_deployment.ray_actor_options,
    }
    assert options == {
        "ingress": {"num_cpus": 0, "resources": {"loraplex_ingress": 0.01}},
        "metering": {"num_cpus": 0, "resources": {"loraplex_ingress": 0.01}},
        "engine": {
            "num_cpus": 0, "num_gpus": 0, "resources": {"loraplex_engine": 1},
            "runtime_env": {"env_vars": {"LORAPLEX_ADMIN_KEY": "", "LORAPLEX_KEY_SECRET": ""}},
        },
    }  # fmt: skip
