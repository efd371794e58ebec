"""The admin key: at least 32 bytes or the platform does not start (never echoing the refused key), and
failed admin checks throttled per client address; on the admin listener that address is the peer's, never
a header the caller could write."""

from pathlib import Path

import httpx
import pytest
from pydantic import ValidationError
from typer.testing import CliRunner

from app.admin_listener import AdminListener
from app.cli import build_app as cli_app
from app.main import create_app
from app.settings import Settings
from deployments.builder import build_app
from tests.app.bare_serving import bare_serving
from tests.app.conftest import ADMIN_KEY
from tests.model_fixtures import TinySetup

LIMIT = 3
PEER = "127.0.0.4"  # not 127.0.0.1, whose X-Forwarded-For uvicorn itself trusts
SHORT = "s3cret-" + "x" * 24  # 31 bytes


def test_an_admin_key_under_32_bytes_is_refused_without_being_echoed() -> None:
    with pytest.raises(ValidationError) as refused:
        Settings(admin_key=SHORT)
    assert "at least 32 bytes" in str(refused.value) and SHORT not in str(refused.value)
    assert Settings(admin_key=f"{SHORT}x").admin_key.get_secret_value() == f"{SHORT}x"
    assert Settings(admin_key="é" * 16).admin_key.get_secret_value() == "é" * 16  # bytes, not characters
    assert Settings(admin_key="").admin_key.get_secret_value() == ""  # no admin API at all


def test_a_short_admin_key_stops_the_platform_at_start(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("LORAPLEX_ADMIN_KEY", SHORT)
    with pytest.raises(ValidationError, match="at least 32 bytes"):  # `serve deploy` / `serve run` fail here
        build_app({"models": [{"name": "m", "engine": {"model": "/models/m", "device": "cpu"}}]})
    config = tmp_path / "serve_config.yaml"
    config.write_text("applications: []\n")
    result = CliRunner().invoke(cli_app(), ["up", "--config", str(config)])
    assert result.exit_code == 2 and "at least 32 bytes" in result.output, result.output
    assert SHORT not in result.output and "Traceback" not in result.output


def _admin_call(url: str, key: str, *, source: str = PEER, forwarded: str | None = None) -> httpx.Response:
    headers = {"authorization": f"Bearer {key}"}
    if forwarded is not None:
        headers["x-forwarded-for"] = forwarded
    transport = httpx.HTTPTransport(local_address=source)
    with httpx.Client(transport=transport, timeout=30) as client:
        return client.get(f"{url}/admin/tenants", headers=headers)


def _admin_status(url: str, key: str, *, source: str = PEER, forwarded: str | None = None) -> int:
    return _admin_call(url, key, source=source, forwarded=forwarded).status_code


def test_failed_admin_checks_are_throttled_per_client(llama: TinySetup, tmp_path: Path) -> None:
    with bare_serving(
        llama, tmp_path, admin_auth_failure_limit=LIMIT, client_ip_header="x-forwarded-for"
    ) as bare:
        # Behind the balancer (the tenant port serving /admin too): the client it names is counted.
        wrong = [_admin_status(bare.url, f"{ADMIN_KEY}x", forwarded="10.0.0.1") for _ in range(LIMIT)]
        assert wrong == [401] * LIMIT
        r = _admin_call(bare.url, f"{ADMIN_KEY}x", forwarded="10.0.0.1")
        assert r.status_code == 429, r.text  # before: 401 for ever
        assert r.json()["error"]["code"] == "too_many_failed_authentications"
        assert "admin keys" in r.json()["error"]["message"] and 1 <= int(r.headers["retry-after"]) <= 60
        # Throttled means throttled: the right key too, from there, until the window ends.
        assert _admin_status(bare.url, ADMIN_KEY, forwarded="10.0.0.1") == 429
        assert _admin_status(bare.url, ADMIN_KEY, forwarded="10.0.0.2") == 200

        listener = AdminListener(create_app(bare.services, routes="admin"), "127.0.0.1:0").start()
        try:
            admin_url = f"http://127.0.0.1:{listener.port}"
            # Reached directly: a new address claimed each time is still the one peer.
            claims = [
                _admin_status(admin_url, f"{ADMIN_KEY}x", forwarded=f"10.1.0.{n}") for n in range(LIMIT + 1)
            ]
            assert claims == [401] * LIMIT + [429]
            assert _admin_status(admin_url, ADMIN_KEY, source="127.0.0.5") == 200
        finally:
            listener.stop()
