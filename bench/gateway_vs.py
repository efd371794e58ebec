"""Ingress overhead against another revision of this repository, interleaved in one run.

bench.gateway measures one tree. On a shared 2-core VM its figure drifts by 2x between runs of the same
code (blocks of 100 requests range 1.3-2.7 ms), so comparing two trees with two runs measures the
neighbours. Here both trees serve at once, each in its own process over an engine that answers at once
(bench.gateway's stub), and take turns: a few requests in one, then in the other, the order alternating,
for many turns. Each turn's median ratio is a paired sample; the headline is the median of those ratios.

The other tree is the revision's committed files (`git archive`), imported in its own process, so the
comparison needs nothing but git and that the revision's bench/gateway.py has its stub client. Requests
are bench.gateway's: a 60-word chat, 16 tokens asked, a tenant with no rate limits; through httpx's ASGI
transport (`chat`, as bench.gateway) and as one bare ASGI call (`asgi`, the ingress alone, no client).

Run: python -m bench.gateway_vs --rev bb2d60e [--turns 60] [--per-turn 10]; the last line is one JSON
object, `ratio_vs_rev` being this tree's time over the revision's.
"""

import argparse
import asyncio
import contextlib
import json
import os
import secrets
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import MutableMapping
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
KINDS = ("chat", "asgi")


def child(model_dir: Path) -> None:
    """Serves the tree on PYTHONPATH: prints `ready <its app folder>`, then answers each line `K` on stdin
    with K requests of each kind, as {kind: [ms, ...]} on one line; an empty line ends it."""
    import app

    asyncio.run(_serve_turns(model_dir, Path(app.__file__).resolve().parents[1]))


async def _serve_turns(model_dir: Path, tree: Path) -> None:
    import httpx

    from app.bootstrap import build_services
    from app.main import create_app
    from app.settings import Settings
    from bench.gateway import LocalInstantClient, instant_outputs  # the revision's own stub
    from billing import repository
    from billing.db import make_engine, make_session_factory, session_scope
    from billing.migrate import upgrade
    from deployments.engine.request import EngineRequest
    from deployments.engine.sampling_params import SamplingParams

    try:
        from app.auth.api_keys import generate_key
        from app.served_models.catalog import BaseModelSpec
    except ImportError:  # revisions before the house moves (issue 33)
        from app.catalog import BaseModelSpec  # type: ignore[no-redef]

        from app.auth import generate_key  # type: ignore[attr-defined,no-redef]

    work = Path(tempfile.mkdtemp(prefix="gateway-vs-"))
    url = f"sqlite:///{work / 'db.sqlite'}"
    upgrade(url)
    settings = Settings(data_dir=work, database_url=url, admin_key=secrets.token_urlsafe(32))
    services = build_services(settings, LocalInstantClient(), {"bench": BaseModelSpec(model_dir)})
    key = generate_key(services.key_secret)
    with session_scope(make_session_factory(make_engine(url))) as session:
        tenant = repository.create_tenant(session, name="bench", tier="enterprise")  # no rate limits
        repository.create_api_key(session, tenant_id=tenant.id, prefix=key.prefix, key_hash=key.hash)
    application = create_app(services)
    body = {"model": "bench", "messages": [{"role": "user", "content": "hello " * 60}], "max_tokens": 16}
    raw = json.dumps(body).encode()
    bearer = f"Bearer {key.plaintext}"
    http = httpx.AsyncClient(transport=httpx.ASGITransport(app=application), base_url="http://bench")

    async def chat() -> None:
        response = await http.post("/v1/chat/completions", json=body, headers={"authorization": bearer})
        assert response.status_code == 200, response.text

    async def asgi() -> None:
        headers = [
            (b"host", b"bench"),
            (b"authorization", bearer.encode()),
            (b"content-type", b"application/json"),
            (b"content-length", str(len(raw)).encode()),
        ]
        scope = {
            "type": "http",
            "asgi": {"version": "3.0"},
            "http_version": "1.1",
            "method": "POST",
            "scheme": "http",
            "path": "/v1/chat/completions",
            "raw_path": b"/v1/chat/completions",
            "query_string": b"",
            "root_path": "",
            "headers": headers,
            "client": ("127.0.0.1", 1),
            "server": ("bench", 80),
        }
        messages = [{"type": "http.request", "body": raw, "more_body": False}]
        statuses: list[int] = []

        async def receive() -> dict[str, Any]:
            if messages:
                return messages.pop()
            await asyncio.Event().wait()  # nothing more: the client stays
            raise AssertionError

        async def send(message: MutableMapping[str, Any]) -> None:
            if message["type"] == "http.response.start":
                statuses.append(message["status"])

        await application(scope, receive, send)
        assert statuses == [200], statuses

    async def direct() -> None:  # what bench.gateway subtracts: the stub engine alone
        async for _ in instant_outputs(EngineRequest("x", [1] * 70, SamplingParams(max_tokens=16))):
            pass

    calls = {"chat": chat, "asgi": asgi, "direct": direct}
    for _ in range(40):  # warm: caches, first-call paths
        for call in calls.values():
            await call()
    print("ready", tree, flush=True)
    loop = asyncio.get_running_loop()
    while line := (await loop.run_in_executor(None, sys.stdin.readline)).strip():
        times: dict[str, list[float]] = {name: [] for name in calls}
        for _ in range(int(line)):
            for name, call in calls.items():
                start = time.perf_counter()
                await call()
                times[name].append((time.perf_counter() - start) * 1e3)
        print(json.dumps(times), flush=True)


def checkout(rev: str, into: Path) -> str:
    """The revision's committed files under `into`; returns its commit."""
    commit = subprocess.run(
        ["git", "rev-parse", "--verify", f"{rev}^{{commit}}"],
        cwd=ROOT,
        check=True,
        capture_output=True,
        text=True,
    ).stdout.strip()
    archive = subprocess.run(["git", "archive", commit], cwd=ROOT, check=True, capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", str(into)], input=archive, check=True)
    return commit


def start(tree: Path, model_dir: Path) -> subprocess.Popen[str]:
    env = {**os.environ, "PYTHONPATH": str(tree)}
    return subprocess.Popen(
        [sys.executable, str(Path(__file__).resolve()), "--child", str(model_dir)],
        cwd=tree, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
    )  # fmt: skip


def ready(process: subprocess.Popen[str], tree: Path) -> subprocess.Popen[str]:
    assert process.stdout is not None
    for line in process.stdout:
        if line.startswith("ready "):
            served = Path(line.split(" ", 1)[1].strip())
            # The editable install must not have won over PYTHONPATH: each process serves its own tree.
            assert served == tree.resolve(), f"{tree} imported app from {served}"
            return process
    raise RuntimeError(f"the server of {tree} ended before it was ready (exit {process.wait()})")


def turn(process: subprocess.Popen[str], requests: int) -> dict[str, list[float]]:
    assert process.stdin is not None and process.stdout is not None
    process.stdin.write(f"{requests}\n")
    process.stdin.flush()
    times: dict[str, list[float]] = json.loads(process.stdout.readline())
    return times


def compare(rev: str, turns: int, per_turn: int) -> dict[str, Any]:
    from app.modelprep.demo_model import ensure_model

    model_dir = ensure_model(ROOT / "var/bench/tiny-llama", arch="llama", preset="tiny").resolve()
    with tempfile.TemporaryDirectory(prefix="gateway-vs-rev-") as scratch:
        other = Path(scratch)
        commit = checkout(rev, other)
        trees = {"rev": other, "this": ROOT}
        servers = {side: start(tree, model_dir) for side, tree in trees.items()}  # both start at once
        try:
            for side, tree in trees.items():
                ready(servers[side], tree)
            samples: dict[str, dict[str, list[float]]] = {side: {k: [] for k in KINDS} for side in servers}
            ratios: dict[str, list[float]] = {k: [] for k in KINDS}
            for i in range(turns):
                order = ("rev", "this") if i % 2 == 0 else ("this", "rev")
                got = {side: turn(servers[side], per_turn) for side in order}
                for kind in KINDS:
                    overhead = {side: _overhead(got[side], kind) for side in servers}
                    for side in servers:
                        samples[side][kind] += overhead[side]
                    ratios[kind].append(
                        statistics.median(overhead["this"]) / statistics.median(overhead["rev"])
                    )
        finally:
            for process in servers.values():
                with contextlib.suppress(OSError):  # one that died has no stdin to read the end from
                    assert process.stdin is not None
                    process.stdin.write("\n")
                    process.stdin.close()
                try:
                    process.wait(timeout=60)
                except subprocess.TimeoutExpired:
                    process.kill()
    result: dict[str, Any] = {"rev": rev, "rev_commit": commit, "turns": turns, "per_turn": per_turn}
    for kind in KINDS:
        result[kind] = {
            "rev_overhead_p50_ms": round(statistics.median(samples["rev"][kind]), 3),
            "this_overhead_p50_ms": round(statistics.median(samples["this"][kind]), 3),
            "ratio_vs_rev": round(statistics.median(ratios[kind]), 3),  # median of the turns' ratios
            "ratio_quartiles": [round(q, 3) for q in statistics.quantiles(ratios[kind], n=4)],
        }
    result["ratio_vs_rev"] = result["chat"]["ratio_vs_rev"]
    return result


def _overhead(times: dict[str, list[float]], kind: str) -> list[float]:
    """The kind's times less the stub engine's own (the turn's median), as bench.gateway subtracts it."""
    engine = statistics.median(times["direct"])
    return [t - engine for t in times[kind]]


def main() -> None:
    if len(sys.argv) == 3 and sys.argv[1] == "--child":
        sys.path.remove(str(Path(__file__).resolve().parent))  # bench/'s scripts are no top-level modules
        child(Path(sys.argv[2]))
        return
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rev", default="HEAD", help="the revision to compare this working tree with")
    parser.add_argument("--turns", type=int, default=60, help="turns of each tree (paired samples)")
    parser.add_argument("--per-turn", type=int, default=10, help="requests of each kind in a turn")
    parser.add_argument(
        "--tiny", action="store_true", help="4 turns of 3 against HEAD: checks the bench runs"
    )
    args = parser.parse_args()
    if args.tiny:
        args.rev, args.turns, args.per_turn = "HEAD", 4, 3
    from bench.measure import machine

    result = compare(args.rev, args.turns, args.per_turn)
    result["machine"] = machine()
    print(json.dumps(result))


if __name__ == "__main__":
    main()
