"""Platform: everything a load test run starts (services, Ray, `serve run`, helpers), so that `close()`
stops exactly that and nothing else."""

import contextlib
import json
import os
import secrets
import shutil
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import yaml

from bench.load.incidents import (
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
from bench.load.options import (
    DEFAULT_PG_ADMIN,
    ENGINE,
    ENGINE_REPLICAS,
    INGRESS_REPLICAS,
    MODEL,
    ROOT,
    Options,
)


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
        return last_json(stdout, stderr)

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


def last_json(stdout: str, stderr: str) -> dict[str, Any]:
    for line in reversed(stdout.strip().splitlines()):
        if line.startswith("{"):
            with contextlib.suppress(ValueError):
                parsed: dict[str, Any] = json.loads(line)
                return parsed
    return {"ok": False, "error": "no JSON from bench.ray_ops", "stderr": stderr[-1500:]}
