"""Which client a failed-authentication throttle counts against, through the real HTTP app: the peer, or
the last entry of a trusted proxy's header when one is configured; never the caller's own claims."""

import secrets
from pathlib import Path

import httpx

from tests.app.bare_serving import Bare, bare_serving
from tests.model_fixtures import TinySetup

LIMIT = 3
# Not 127.0.0.1: uvicorn (here and in Serve's proxy) itself trusts X-Forwarded-For from 127.0.0.1 (its
# forwarded_allow_ips default), rewriting the peer before the app sees it.
PEER = "127.0.0.4"


def _bogus(client: httpx.Client, forwarded: str | None = None) -> int:
    key = f"sk-lp-{secrets.token_hex(6)}_{secrets.token_urlsafe(32)}"
    headers = {"authorization": f"Bearer {key}"}
    if forwarded is not None:
        headers["x-forwarded-for"] = forwarded
    return client.get("/v1/models", headers=headers).status_code


def _flood(bare: Bare, forwarded: str) -> None:
    with bare.client(source=PEER) as client:
        assert [_bogus(client, forwarded) for _ in range(LIMIT + 2)] == [401] * LIMIT + [429] * 2


def test_behind_a_trusted_proxy_its_last_entry_names_the_client(llama: TinySetup, tmp_path: Path) -> None:
    with bare_serving(llama, tmp_path, auth_failure_limit=LIMIT, client_ip_header="x-forwarded-for") as bare:
        _flood(bare, "10.0.0.1")
        with bare.client(source=PEER) as client:
            assert _bogus(client, "10.0.0.1, 10.0.0.2") == 401  # the proxy says 10.0.0.2: another client
            assert _bogus(client, "10.0.0.7, 10.0.0.1") == 429  # a made-up first entry changes nothing
            assert _bogus(client, "10.0.0.3") == 401


def test_without_a_trusted_proxy_forwarded_headers_are_ignored(llama: TinySetup, tmp_path: Path) -> None:
    with bare_serving(llama, tmp_path, auth_failure_limit=LIMIT) as bare:
        with bare.client(source=PEER) as client:  # a new address claimed each time: still one peer
            assert [_bogus(client, f"10.0.0.{n}") for n in range(LIMIT + 2)] == [401] * LIMIT + [429] * 2
        with bare.client(source="127.0.0.5") as other:
            assert _bogus(other) == 401


def _status(client: httpx.Client, key: str, forwarded: str) -> int:
    headers = {"authorization": f"Bearer {key}", "x-forwarded-for": forwarded}
    return client.get("/v1/models", headers=headers).status_code


def test_one_clients_spray_does_not_lock_out_its_neighbours_behind_one_address(
    llama: TinySetup, tmp_path: Path
) -> None:
    """An office behind one NAT: one client sprays bad keys; a neighbour whose key authenticated here
    before still gets its lookups (no auth cache here: every request is one)."""
    with bare_serving(
        llama, tmp_path, auth_failure_limit=LIMIT, auth_cache_ttl_s=0.0, client_ip_header="x-forwarded-for"
    ) as bare:
        _, neighbour = bare.new_tenant("neighbour")
        _, newcomer = bare.new_tenant("newcomer")
        with bare.client(source=PEER) as client:
            assert _status(client, neighbour, "10.0.0.9") == 200
            assert [_bogus(client, "10.0.0.9") for _ in range(LIMIT + 1)] == [401] * LIMIT + [429]
            assert _status(client, neighbour, "10.0.0.9") == 200  # before: 429 until the window ended
            # A prefix never seen on this replica waits out the window with the culprit: it could be one more
            # of the spray's keys.
            assert _status(client, newcomer, "10.0.0.9") == 429
            assert _status(client, newcomer, "10.0.0.10") == 200


def test_one_key_failing_again_and_again_is_throttled_on_its_own(llama: TinySetup, tmp_path: Path) -> None:
    with bare_serving(
        llama, tmp_path, auth_cache_ttl_s=0, auth_failure_limit_per_key=2, client_ip_header="x-forwarded-for"
    ) as bare:
        revoked = f"sk-lp-{secrets.token_hex(6)}_{secrets.token_urlsafe(32)}"
        with bare.client(source=PEER) as client:
            assert [_status(client, revoked, "10.0.0.1") for _ in range(4)] == [401, 401, 429, 429]
            assert _bogus(client, "10.0.0.1") == 401  # another key from that address still gets its lookup
            assert _status(client, revoked, "10.0.0.2") == 401  # and that key from another address
