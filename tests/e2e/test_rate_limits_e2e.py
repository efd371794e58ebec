"""Rate limits on Ray Serve across two ingress replicas, on both backends: 200 concurrent requests from
one tenant with rpm=50 admit exactly 50; a Redis outage gives fast 503s, and service resumes by itself."""

import asyncio
import shutil
import socket
import subprocess
import time
import uuid
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from billing.models import Tier
from tests.app.conftest import free_port
from tests.e2e.conftest import ServeApp, engine_settings

BURST = 200
RPM = 50


def deploy(serve_app: ServeApp, rate_limiter: dict[str, object]) -> None:
    serve_app.deploy(
        {
            "ingress_replicas": 2,
            "rate_limiter": rate_limiter,
            "models": [{"name": "tiny-llama", "engine": engine_settings(serve_app.setups["llama"])}],
        }
    )


def limited_tenant(serve_app: ServeApp, **limits: object) -> str:

    tier = f"e2e-{uuid.uuid4().hex[:8]}"
    sessions = serve_app.sessions()  # the app's own database: PostgreSQL under CI
    with sessions() as session, session.begin():
        session.add(Tier(name=tier, description="e2e", **limits))
    return serve_app.new_tenant(f"rl-{uuid.uuid4().hex[:8]}", tier=tier)[1]


async def burst(url: str, key: str, n: int) -> list[httpx.Response]:
    body = {"model": "tiny-llama", "prompt": "hi", "max_tokens": 1, "temperature": 0}
    limits = httpx.Limits(max_connections=n)
    async with httpx.AsyncClient(base_url=url, timeout=120, limits=limits) as client:
        return await asyncio.gather(
            *(
                client.post("/v1/completions", json=body, headers={"authorization": f"Bearer {key}"})
                for _ in range(n)
            )
        )


def check_burst(responses: list[httpx.Response]) -> None:
    codes = [r.status_code for r in responses]
    others = [(r.status_code, r.text[:300]) for r in responses if r.status_code not in (200, 429)]
    assert codes.count(200) == RPM, (Counter(codes), others)  # exactly the limit across the two replicas
    assert codes.count(429) == BURST - RPM, (Counter(codes), others)
    for refused in (r for r in responses if r.status_code == 429):
        assert refused.json()["error"]["code"] == "rate_limit_exceeded"
        assert 1 <= int(refused.headers["retry-after"]) <= 60
        assert 0 < int(refused.headers["retry-after-ms"]) <= 60_000


@pytest.fixture(scope="module")
def restore_default(serve_app: ServeApp) -> Iterator[None]:
    yield
    serve_app.deploy_default()


@pytest.mark.slow
def test_ray_backend_holds_the_limit_across_two_ingress_replicas(
    serve_app: ServeApp, restore_default: None
) -> None:
    deploy(serve_app, {"backend": "ray"})
    key = limited_tenant(serve_app, rpm=RPM)
    check_burst(asyncio.run(burst(serve_app.url, key, BURST)))


class RedisServer:
    """A Redis of our own on a free port, so the test can stop and restart it."""

    def __init__(self, workdir: Path) -> None:
        self.port = free_port()
        self.workdir = workdir
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        binary = shutil.which("redis-server")
        assert binary, "redis-server is not installed"
        self.process = subprocess.Popen(
            [binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
             "--dir", str(self.workdir)],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )  # fmt: skip
        deadline = time.monotonic() + 10
        while True:
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=0.2).close()
                return
            except OSError:
                assert time.monotonic() < deadline, "redis-server did not start"
                time.sleep(0.05)

    def stop(self) -> None:
        if self.process is not None:
            self.process.terminate()
            self.process.wait(10)
            self.process = None


@pytest.mark.slow
def test_redis_backend_holds_the_limit_and_survives_an_outage(
    serve_app: ServeApp, restore_default: None, tmp_path: Path
) -> None:
    redis = RedisServer(tmp_path)
    redis.start()
    try:
        deploy(serve_app, {"backend": "redis", "redis_url": redis.url})
        key = limited_tenant(serve_app, rpm=RPM)
        check_burst(asyncio.run(burst(serve_app.url, key, BURST)))

        other = limited_tenant(serve_app, rpm=1000)
        redis.stop()
        start = time.monotonic()
        down = asyncio.run(burst(serve_app.url, other, 10))
        assert [r.status_code for r in down] == [503] * 10  # fail closed
        assert all(r.json()["error"]["code"] == "rate_limiter_unavailable" for r in down)
        assert time.monotonic() - start < 10  # never hangs

        redis.start()  # same port, empty state
        deadline = time.monotonic() + 20
        while (back := asyncio.run(burst(serve_app.url, other, 1))[0]).status_code != 200:
            assert time.monotonic() < deadline, back.text  # resumes without a restart
            time.sleep(0.2)
    finally:
        redis.stop()
