"""With `admin_listen` set, /admin lives on its own listener (which operators can firewall) and the tenant
port no longer serves it; several ingress replicas of a node share that address. In a replica it serves on
the loop the tenant app runs on: the two share clients bound to that loop."""

import asyncio
import threading

import httpx
from fastapi import FastAPI

from app.admin_listener import AdminListener, parse_address
from app.main import create_app
from bench.live_server import LiveServer
from tests.app.conftest import ADMIN_KEY, MODEL, Served


def test_the_admin_api_moves_to_its_own_listener(served: Served) -> None:
    admin_headers = {"authorization": f"Bearer {ADMIN_KEY}"}
    first = AdminListener(create_app(served.services, routes="admin"), "127.0.0.1:0").start()
    second = AdminListener(create_app(served.services, routes="admin"), f"127.0.0.1:{first.port}").start()
    try:
        with LiveServer(create_app(served.services, routes="tenant")) as tenant_port:
            on_tenant_port = httpx.get(f"{tenant_port.url}/admin/tenants", headers=admin_headers)
            assert on_tenant_port.status_code == 404
            assert on_tenant_port.json()["error"]["type"] == "invalid_request_error"
            admin_url = f"http://127.0.0.1:{first.port}"
            created = httpx.post(
                f"{admin_url}/admin/tenants", json={"name": "via-admin"}, headers=admin_headers
            )
            assert created.status_code == 201, created.text
            key = httpx.post(
                f"{admin_url}/admin/tenants/{created.json()['id']}/keys",
                json={"name": "k"},
                headers=admin_headers,
            ).json()["key"]
            models = httpx.get(f"{tenant_port.url}/v1/models", headers={"authorization": f"Bearer {key}"})
            assert models.status_code == 200 and MODEL in [m["id"] for m in models.json()["data"]]
            assert (
                httpx.get(f"{admin_url}/v1/models", headers={"authorization": f"Bearer {key}"}).status_code
                == 404
            )
            assert httpx.get(f"{admin_url}/healthz").status_code == 200
    finally:
        second.stop()
        first.stop()


def test_admin_listen_must_be_host_and_port() -> None:
    assert parse_address("0.0.0.0:8001") == ("0.0.0.0", 8001)
    assert parse_address("[::1]:8001") == ("::1", 8001)
    for bad in ("8001", "host:", "host:port"):
        try:
            parse_address(bad)
        except ValueError:
            continue
        raise AssertionError(f"{bad!r} was accepted")


def test_it_serves_on_the_loop_that_starts_it() -> None:
    """As in an ingress replica (whose constructor runs on Serve's user-code loop): the admin routes run on
    that loop and thread, so clients bound to it (redis.asyncio pools, Serve handles) are never used from a
    second loop in another thread."""
    app = FastAPI()

    @app.get("/where")
    async def where() -> dict[str, int]:
        return {"loop": id(asyncio.get_running_loop()), "thread": threading.get_ident()}

    async def scenario() -> None:
        listener = AdminListener(app, "127.0.0.1:0").start()
        try:
            async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{listener.port}") as client:
                answer = (await client.get("/where", timeout=10)).json()
            assert answer == {"loop": id(asyncio.get_running_loop()), "thread": threading.get_ident()}
        finally:
            listener.stop()
            for _ in range(100):  # uvicorn's shutdown runs on this loop
                if not listener.server.servers[0].is_serving():
                    break
                await asyncio.sleep(0.05)
            assert not listener.server.servers[0].is_serving()

    asyncio.run(scenario())
