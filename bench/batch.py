"""The Batch API against the same requests sent interactively (issue 37's goal), in process: the HTTP app
under uvicorn over one in-process engine and SQLite, the batch runner on the app's own event loop. With
`--serve`: the same through the app graph `serve run` deploys, on a local Ray cluster of this process's own
(bench/serve_platform.py): the runner in the ingress replica, the engine in its own replica, sharing the
machine's cores.

Workload: N /v1/completions requests over A adapters (the tenant's own, uploaded through the admin API)
and P shared prompt prefixes (each request: a prefix of `--prefix-words` words, a short unique tail),
greedy, a fixed output length (`ignore_eos`). The order is shuffled, so adapters and prefixes are interleaved.
  batch        the N requests as one JSONL file: upload, batch create, poll until `completed`; timed from
               the upload to `completed` (the runner sorts lines by model; at most `max_in_flight_per_tenant`
               in flight).
  interactive  the same N requests sent at once (full concurrency) to the same app; timed to the last
               answer.
Peers run interleaved (`--repeats` rounds, order rotated); the ratio batch/interactive of requests per
second is per round, summarised by its median (goal: >= 1.0).

With `--ttft`: an interactive streaming load (`--ttft-users` users, each sending `--ttft-requests`
requests one after another, cold adapters among them) runs alone and beside a running batch, in turns;
its TTFT p99 and inter-token p99 beside/alone (goal: <= 1.2) and the batch lines done meanwhile; from the
engine's side, its queue waits (usage rows: p50/p90/max, how many over 100 ms) and, in process, its mean
whole step (plan to outputs) beside/alone, what the batch class's share of a step costs every stream. With
`--batch-policies none:0,0.1:2` (in process), one "beside" peer per setting of the engine's
`batch_step_slack:batch_interactive_window_s` (a third part `:tokens`: its step-cost fit by tokens alone),
set between runs, all interleaved round by round with the "alone" peer.
Run:  python -m bench.batch [--requests 1000 --adapters 8 --prefixes 4] [--ttft [--batch-policies ...]]
      [--serve] [--tiny]
The last line is one JSON object.
"""

import argparse
import asyncio
import itertools
import json
import logging
import os
import random
import secrets
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
from sqlalchemy import select
from sqlalchemy.orm import Session

from app.bootstrap import build_services
from app.main import create_app
from app.modelprep.demo_model import ensure_model
from app.served_models.catalog import BaseModelSpec
from app.settings import Settings
from bench.admin_upload import post_adapter
from bench.live_server import LiveServer
from bench.measure import Interleaved, machine, spread
from bench.serve_platform import build_adapters, local_platform
from billing.adapter_digests import RegistryDigests
from billing.db import make_engine, make_session_factory
from billing.migrate import upgrade
from billing.models import UsageEvent
from deployments.engine.async_engine import AsyncEngine
from deployments.engine.config import EngineConfig
from deployments.engine.interface import LocalEngineClient
from deployments.engine.outputs import EngineStats
from deployments.registry_watcher import RegistryWatcher

MODEL = "bench-base"
ENDPOINT = "/v1/completions"
FINAL = ("completed", "failed", "expired", "cancelled")
LONG_WAIT_MS = 100  # an engine queue wait the TTFT goal cannot absorb (the load's TTFT alone: ~30-60 ms)
WORDS = [
    "alpha",
    "beta",
    "gamma",
    "delta",
    "epsilon",
    "zeta",
    "eta",
    "theta",
    "iota",
    "kappa",
    "lambda",
    "mu",
    "nu",
    "xi",
    "omicron",
    "pi",
    "rho",
    "sigma",
]


@dataclass
class Platform:
    url: str
    key: str
    adapters: list[str]
    sessions: Callable[[], Session]  # the platform's database: the engine's own queue and TTFT per request
    # Sets the engine's batch policy between runs (in process only; None: the configured one only).
    set_policy: Callable[["Policy"], None] | None = None
    # The engine's stats (in process only): its busy seconds and steps while a load runs.
    stats: Callable[[], EngineStats] | None = None


def _model_dir(args: argparse.Namespace) -> Path:
    return ensure_model(Path(f"var/bench/{args.preset}"), arch="llama", preset=args.preset).resolve()


def _engine_settings(args: argparse.Namespace) -> dict[str, Any]:
    """EngineConfig fields of both modes, over its model and store."""
    return {"num_kv_blocks": args.kv_blocks, "max_num_seqs": args.max_num_seqs,
            "max_num_batched_tokens": args.max_num_batched_tokens, "max_loras": args.slots,
            "max_lora_rank": 16, "batch_step_tokens": args.batch_step_tokens,
            "cpu_threads": args.cpu_threads}  # fmt: skip


def _ingress_settings(args: argparse.Namespace) -> dict[str, Any]:
    """Settings fields of both modes. Reads unlimited: the bench polls its batch, and the read limiter is
    not what is measured."""
    batches = {"max_in_flight_per_tenant": args.in_flight, "max_in_flight": max(64, args.in_flight)}
    return {"batches": batches, "read_rpm": 1_000_000, "read_burst": 1_000}


def _adapters(args: argparse.Namespace, model_dir: Path, work: Path) -> dict[str, Path]:
    """The tenant's adapters by name: A real PEFT adapters of ranks 8 and 16 in turn."""
    dirs = build_adapters(model_dir, [8, 16] * ((args.adapters + 1) // 2), work / "peft")[: args.adapters]
    return {f"ad{i:02d}": path for i, path in enumerate(dirs)}


@contextmanager
def serve_platform(args: argparse.Namespace, work: Path) -> Iterator[Platform]:
    """The app graph of `serve run` on a local Ray cluster, over the same engine settings, a fresh database
    and store; the same tenant and adapters, uploaded through the admin API."""
    model_dir = _model_dir(args)
    with local_platform(model_dir, MODEL) as served:
        model = served.model_spec(MODEL, "adapter_aware", 1, 1.5, _engine_settings(args))
        served.deploy_models([model], ingress_settings=_ingress_settings(args))
        tenant = served.tenant("bench")
        adapters = _adapters(args, model_dir, work)
        for name, path in adapters.items():
            served.upload(name, tenant.id, path)
        database = make_engine(os.environ["LORAPLEX_DATABASE_URL"])  # local_platform's, in its environment
        try:
            yield Platform(served.url, tenant.key, list(adapters), make_session_factory(database))
        finally:
            database.dispose()


@contextmanager
def platform(args: argparse.Namespace, work: Path) -> Iterator[Platform]:
    """The app over a fresh engine and database; an enterprise tenant (no rate limits) and A
    adapters it owns, uploaded through the admin API."""
    model_dir = _model_dir(args)
    url = f"sqlite:///{work / 'db.sqlite'}"
    upgrade(url)
    admin_key = secrets.token_urlsafe(32)
    settings = Settings(data_dir=work, database_url=url, admin_key=admin_key, adapter_store=work / "store",
                        adapter_cache_dir=work / "ingress-cache", **_ingress_settings(args))  # fmt: skip
    engine = AsyncEngine(
        EngineConfig(
            model=model_dir,
            served_model_name=MODEL,
            adapter_store=work / "store",
            adapter_cache_dir=work / "engine-cache",
            **_engine_settings(args),
        ),
        adapter_digests=RegistryDigests(make_session_factory(make_engine(url))),  # as on a replica
    )
    services = build_services(settings, LocalEngineClient({MODEL: engine}), {MODEL: BaseModelSpec(model_dir)})
    watcher = RegistryWatcher(engine, MODEL, services.session_factory, interval_s=0.5)
    watcher.start()
    adapters = _adapters(args, model_dir, work)
    try:
        with LiveServer(create_app(services)) as server:
            headers = {"authorization": f"Bearer {admin_key}"}
            with httpx.Client(base_url=server.url, headers=headers, timeout=60) as admin:
                tenant = admin.post("/admin/tenants", json={"name": "bench", "tier": "enterprise"}).json()
                key = admin.post(f"/admin/tenants/{tenant['id']}/keys", json={"name": "bench"}).json()["key"]
                for name, path in adapters.items():
                    reply = post_adapter(admin, name, tenant["id"], path, base_model=MODEL)
                    assert reply.status_code == 201, reply.text
            yield Platform(
                server.url,
                key,
                list(adapters),
                services.session_factory,
                _policy_setter(engine),
                engine.stats,
            )
    finally:
        watcher.stop()
        engine.shutdown()


@dataclass(frozen=True)
class Policy:
    """The engine's batch-class settings a "beside" peer runs under."""

    slack: float | None  # batch_step_slack
    window_s: float  # batch_interactive_window_s
    rows_apart: bool = True  # the step-cost fit reads sampled rows apart from tokens (False: tokens alone)

    @property
    def label(self) -> str:
        slack = "none" if self.slack is None else f"{self.slack:g}"
        fit = "" if self.rows_apart else ",fit=tokens"
        return f"slack={slack},window={self.window_s:g}{fit}"

    @staticmethod
    def parse(text: str) -> "Policy":
        slack, window, fit, *_ = [*text.split(":"), "", ""]
        default_window = EngineConfig.model_fields["batch_interactive_window_s"].default
        slack_s = None if slack.strip() == "none" else float(slack)
        return Policy(slack_s, float(window or default_window), fit.strip() != "tokens")

    @staticmethod
    def configured() -> "Policy":
        fields = EngineConfig.model_fields
        return Policy(fields["batch_step_slack"].default, fields["batch_interactive_window_s"].default)


def _policy_setter(engine: AsyncEngine) -> Callable[[Policy], None]:
    def set_policy(policy: Policy) -> None:
        def change(llm: Any) -> None:
            llm.scheduler.batch_step_slack = policy.slack
            llm.scheduler.batch_interactive_window_s = policy.window_s
            llm.scheduler.step_cost.rows_apart = policy.rows_apart

        engine.run_on_loop(change).result(timeout=60)

    return set_policy


def workload(args: argparse.Namespace, adapters: list[str], seed: int, tag: str) -> list[dict[str, Any]]:
    """N completions bodies: adapters and shared prefixes interleaved, each with its own tail."""
    rng = random.Random(seed)
    prefixes = [" ".join(rng.choice(WORDS) for _ in range(args.prefix_words)) for _ in range(args.prefixes)]
    bodies = []
    for i in range(args.requests):
        tail = " ".join(rng.choice(WORDS) for _ in range(4))
        prompt = f"{prefixes[i % args.prefixes]} {tail} {tag}{i}"
        bodies.append({"model": adapters[i % len(adapters)], "prompt": prompt, "max_tokens": args.max_tokens,
                       "temperature": 0, "ignore_eos": True})  # fmt: skip
    rng.shuffle(bodies)
    return bodies


async def interactive(http: httpx.AsyncClient, bodies: list[dict[str, Any]]) -> tuple[float, int]:
    """(seconds to the last answer, completion tokens) with every request sent at once."""

    async def one(body: dict[str, Any]) -> int:
        reply = await http.post(ENDPOINT, json=body)
        assert reply.status_code == 200, reply.text
        return int(reply.json()["usage"]["completion_tokens"])

    start = time.perf_counter()
    tokens = await asyncio.gather(*(one(body) for body in bodies))
    return time.perf_counter() - start, sum(tokens)


async def start_batch(http: httpx.AsyncClient, bodies: list[dict[str, Any]]) -> str:
    lines = [
        {"custom_id": f"c{i}", "method": "POST", "url": ENDPOINT, "body": body}
        for i, body in enumerate(bodies)
    ]
    content = b"".join(json.dumps(line).encode() + b"\n" for line in lines)
    reply = await http.post("/v1/files", data={"purpose": "batch"}, files={"file": ("in.jsonl", content)})
    assert reply.status_code == 200, reply.text
    create = {"input_file_id": reply.json()["id"], "endpoint": ENDPOINT, "completion_window": "24h"}
    reply = await http.post("/v1/batches", json=create)
    assert reply.status_code == 200, reply.text
    return str(reply.json()["id"])


async def batch_state(http: httpx.AsyncClient, batch_id: str) -> dict[str, Any]:
    reply = await http.get(f"/v1/batches/{batch_id}")
    assert reply.status_code == 200, reply.text
    return dict(reply.json())


async def wait_batch(http: httpx.AsyncClient, batch_id: str, until: Callable[[dict[str, Any]], bool]) -> Any:
    """Poll the batch every 50 ms until `until(state)`; that state."""
    while True:
        state = await batch_state(http, batch_id)
        if until(state):
            return state
        await asyncio.sleep(0.05)


async def batch(http: httpx.AsyncClient, bodies: list[dict[str, Any]]) -> tuple[float, int]:
    """(seconds from the upload to `completed`, completion tokens in the output file)."""
    start = time.perf_counter()
    batch_id = await start_batch(http, bodies)
    state = await wait_batch(http, batch_id, lambda s: s["status"] in FINAL)
    elapsed = time.perf_counter() - start
    counts = state["request_counts"]
    assert state["status"] == "completed" and counts["completed"] == len(bodies), state
    output = await http.get(f"/v1/files/{state['output_file_id']}/content")
    lines = [json.loads(raw) for raw in output.content.splitlines()]
    return elapsed, sum(line["response"]["body"]["usage"]["completion_tokens"] for line in lines)


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


async def streamed(http: httpx.AsyncClient, body: dict[str, Any]) -> tuple[float, list[float], str]:
    """(TTFT, inter-token gaps) of one streamed request, as the client sees them, and its request id."""
    start = time.perf_counter()
    stamps: list[float] = []
    request_id = ""
    async with http.stream("POST", ENDPOINT, json={**body, "stream": True}) as reply:
        assert reply.status_code == 200, await reply.aread()
        async for line in reply.aiter_lines():
            if line.startswith("data: {") and (chunk := json.loads(line[6:]))["choices"]:
                stamps.append(time.perf_counter())
                request_id = chunk["id"]  # the chunks' id is the request's id
    return stamps[0] - start, [b - a for a, b in itertools.pairwise(stamps)], request_id


async def user_load(
    http: httpx.AsyncClient, args: argparse.Namespace, bodies: list[dict[str, Any]]
) -> tuple[dict[str, float], list[str]]:
    """`--ttft-users` users sending their share of bodies one after another: TTFT and gap p99, and the
    requests' ids."""
    ttfts: list[float] = []
    gaps: list[float] = []
    ids: list[str] = []

    async def user(mine: list[dict[str, Any]]) -> None:
        for body in mine:
            ttft, between, request_id = await streamed(http, body)
            ttfts.append(ttft)
            gaps.extend(between)
            ids.append(request_id)

    users = args.ttft_users
    await asyncio.gather(*(user(bodies[u::users]) for u in range(users)))
    return {"ttft_p99": percentile(ttfts, 0.99), "itl_p99": percentile(gaps, 0.99) if gaps else 0.0}, ids


def engine_side(sessions: Callable[[], Session], ids: list[str]) -> dict[str, float]:
    """The engine's own view of these requests, from their usage rows: the time from arrival to first
    scheduled (queue) and to first token, p50/p90/max in ms, and how many queued over LONG_WAIT_MS. What the
    client saw beyond it was spent before the engine (the app, its event loop) or after (delivery)."""
    deadline = time.monotonic() + 30
    while True:  # usage rows are written in the background
        with sessions() as s:
            query = select(UsageEvent.queue_ms, UsageEvent.ttft_ms).where(UsageEvent.request_id.in_(ids))
            rows = [(q, t) for q, t in s.execute(query)]
        if len(rows) >= len(ids) or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    queue = [q for q, _ in rows]
    first = [t for _, t in rows if t is not None]
    summary: dict[str, float] = {}
    for name, values in (("queue_ms", queue), ("ttft_ms", first)):
        for label, q in (("p50", 0.5), ("p90", 0.9), ("max", 1.0)):
            summary[f"{name}_{label}"] = round(percentile(values, q), 1) if values else 0.0
    summary[f"queued_over_{LONG_WAIT_MS}ms"] = sum(q > LONG_WAIT_MS for q in queue)
    return summary


async def measure(args: argparse.Namespace, p: Platform) -> dict[str, Any]:
    headers = {"authorization": f"Bearer {p.key}"}
    # Idle connections dropped before uvicorn's 5 s keep-alive closes them: a reused one it just closed
    # fails the request (httpx.ReadError), which a round after a long batch run otherwise meets.
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None, keepalive_expiry=1.0)
    result: dict[str, Any] = {}
    async with httpx.AsyncClient(base_url=p.url, headers=headers, timeout=1800, limits=limits) as http:
        await interactive(http, workload(args, p.adapters, 0, "w")[: max(8, args.requests // 10)])  # warm
        rounds: dict[str, list[tuple[float, int]]] = {"batch": [], "interactive": []}
        loop = asyncio.get_running_loop()

        def peer(name: str) -> Any:
            run = batch if name == "batch" else interactive

            def once() -> float:
                # The same bodies for both peers of a round; a fresh tag per run so no prompt was seen before.
                r = len(rounds[name]) + 1
                bodies = workload(args, p.adapters, r, f"{name[0]}{r}-")
                elapsed, tokens = asyncio.run_coroutine_threadsafe(run(http, bodies), loop).result()
                rounds[name].append((elapsed, tokens))
                return len(bodies) / elapsed

            return once

        # Interleaved is synchronous: it runs in a thread while this loop serves the coroutines it submits.
        runs = await asyncio.to_thread(
            Interleaved(
                {"batch": peer("batch"), "interactive": peer("interactive")}, repeats=args.repeats
            ).run
        )
        result["throughput_ratio_batch_vs_interactive"] = runs.ratio("batch", "interactive")["median"]
        result["throughput_ratio_spread"] = runs.ratio("batch", "interactive")
        result["batch_req_s"] = spread(runs.samples["batch"])
        result["interactive_req_s"] = spread(runs.samples["interactive"])
        result["batch_tok_s"] = spread([t / s for s, t in rounds["batch"]])
        result["interactive_tok_s"] = spread([t / s for s, t in rounds["interactive"]])
        if args.ttft:
            result["beside_batch"] = await ttft_beside(http, args, p)
    return result


async def probed_load(
    http: httpx.AsyncClient, args: argparse.Namespace, p: Platform, bodies: list[dict[str, Any]]
) -> tuple[dict[str, float], list[str]]:
    """user_load, and in process the engine's mean whole step (plan to outputs) meanwhile, in ms: the time
    each running stream waits between its tokens, which the batch class's share of a step lengthens."""
    before = p.stats() if p.stats is not None else None
    seen, sent = await user_load(http, args, bodies)
    if before is not None and p.stats is not None:
        after = p.stats()
        steps = max(1, after.steps - before.steps)
        seen["step_ms"] = 1000 * (after.step_seconds - before.step_seconds) / steps
    return seen, sent


async def ttft_beside(http: httpx.AsyncClient, args: argparse.Namespace, p: Platform) -> dict[str, Any]:
    """The streaming user load alone and beside a running batch, in turns; the batch is cancelled after.
    With several `--batch-policies` (in process: set on the engine between runs), one "beside" peer per
    policy, all interleaved with the "alone" peer round by round; the top-level figures are the last
    policy's."""
    policies: list[Policy] = args.batch_policies
    labels = [policy.label for policy in policies]
    alone: list[dict[str, float]] = []
    beside: dict[str, list[dict[str, float]]] = {label: [] for label in labels}
    ids: dict[str, list[str]] = {"alone": [], **{label: [] for label in labels}}
    progressed: dict[str, list[int]] = {label: [] for label in labels}
    peers: list[Policy | str] = ["alone", *policies]
    for r in range(args.repeats):
        bodies = workload(args, p.adapters, 100 + r, f"u{r}-")[: args.ttft_requests]
        for turn, peer in enumerate(peers[r % len(peers) :] + peers[: r % len(peers)]):
            tail = f" {chr(ord('a') + turn)}"  # a prompt no earlier peer of the round sent
            if peer == "alone":
                seen, sent = await probed_load(
                    http, args, p, [{**b, "prompt": b["prompt"] + tail} for b in bodies]
                )
                alone.append(seen)
                ids["alone"] += sent
                continue
            assert isinstance(peer, Policy)
            label = peer.label
            if p.set_policy is not None:
                await asyncio.to_thread(p.set_policy, peer)
            batch_id = await start_batch(http, workload(args, p.adapters, 200 + r, f"bb{r}t{turn}-"))
            started = await wait_batch(http, batch_id, lambda s: s["request_counts"]["completed"] > 0)
            before = started["request_counts"]["completed"]  # the runner has lines in the engine
            seen, sent = await probed_load(
                http, args, p, [{**b, "prompt": b["prompt"] + tail} for b in bodies]
            )
            beside[label].append(seen)
            ids[label] += sent
            state = await batch_state(http, batch_id)
            progressed[label].append(state["request_counts"]["completed"] - before)
            await http.post(f"/v1/batches/{batch_id}/cancel")
            await wait_batch(http, batch_id, lambda s: s["status"] in FINAL)
    by_policy: dict[str, Any] = {}
    for label in labels:
        ratios = {
            key: spread([b[key] / a[key] for a, b in zip(alone, beside[label], strict=True) if a[key]])
            for key in ("ttft_p99", "itl_p99", "step_ms")
            if all(key in run for run in (*alone, *beside[label]))
        }
        by_policy[label] = {
            "ttft_p99_ratio": ratios["ttft_p99"]["median"],
            "itl_p99_ratio": ratios["itl_p99"]["median"],
            "step_ms_ratio": ratios["step_ms"]["median"] if "step_ms" in ratios else None,
            "ratios": ratios,
            "beside_ttft_p99_s": spread([b["ttft_p99"] for b in beside[label]]),
            "batch_lines_done_meanwhile": progressed[label],
            "engine_side": await asyncio.to_thread(engine_side, p.sessions, ids[label]),
        }
    last = by_policy[labels[-1]]
    return {
        "ttft_p99_ratio": last["ttft_p99_ratio"],
        "itl_p99_ratio": last["itl_p99_ratio"],
        "step_ms_ratio": last["step_ms_ratio"],
        "ratios": last["ratios"],
        "alone_ttft_p99_s": spread([a["ttft_p99"] for a in alone]),
        "alone_itl_p99_ms": spread([1e3 * a["itl_p99"] for a in alone]),
        "beside_itl_p99_ms": spread([1e3 * b["itl_p99"] for b in beside[labels[-1]]]),
        **(
            {
                "alone_step_ms": spread([a["step_ms"] for a in alone]),
                "beside_step_ms": spread([b["step_ms"] for b in beside[labels[-1]]]),
            }
            if all("step_ms" in run for run in (*alone, *beside[labels[-1]]))
            else {}
        ),
        "beside_ttft_p99_s": last["beside_ttft_p99_s"],
        "batch_lines_done_meanwhile": last["batch_lines_done_meanwhile"],
        "engine_side": {  # every round's requests together
            "alone": await asyncio.to_thread(engine_side, p.sessions, ids["alone"]),
            "beside": last["engine_side"],
        },
        "by_policy": by_policy,
        "users": args.ttft_users,
        "requests": args.ttft_requests,
    }


def _policies(text: str) -> list[Policy]:
    return [Policy.parse(part) for part in text.split(",")]


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--requests", type=int, default=1000, help="N, the same for both peers")
    parser.add_argument("--adapters", type=int, default=8)
    parser.add_argument("--prefixes", type=int, default=4, help="distinct shared prompt prefixes")
    parser.add_argument("--prefix-words", type=int, default=48)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=3, help="rounds (each runs both peers)")
    parser.add_argument("--in-flight", type=int, default=64, help="batches.max_in_flight_per_tenant")
    parser.add_argument("--max-num-seqs", type=int, default=16)
    parser.add_argument(
        "--batch-step-tokens", type=int, default=EngineConfig.model_fields["batch_step_tokens"].default,
        help="the engine's batch_step_tokens: the batch class's tokens a step beside interactive work",
    )  # fmt: skip
    parser.add_argument(
        "--batch-policies", type=_policies, default=None,
        help="comma-separated SLACK:WINDOW[:tokens] settings of batch_step_slack ('none': the count "
        "alone) and batch_interactive_window_s (':tokens': the step-cost fit by tokens alone, without its "
        "sampled rows), one 'beside' peer each, interleaved (in process); default: the engine's own",
    )  # fmt: skip
    parser.add_argument("--max-num-batched-tokens", type=int, default=512)
    parser.add_argument("--kv-blocks", type=int, default=2048)
    parser.add_argument("--slots", type=int, default=4, help="max_loras: fewer than adapters, so loads count")
    parser.add_argument("--preset", default="demo")
    parser.add_argument("--ttft", action="store_true", help="also the interactive TTFT beside a batch")
    parser.add_argument("--ttft-users", type=int, default=4)
    parser.add_argument(
        "--cpu-threads",
        type=int,
        default=None,
        help="the engine's EngineConfig.cpu_threads (unset: its default)",
    )
    parser.add_argument("--ttft-requests", type=int, default=40)
    parser.add_argument(
        "--serve",
        action="store_true",
        help="through the app graph `serve run` deploys, on a local Ray cluster",
    )
    parser.add_argument(
        "--tiny", action="store_true", help="the tiny model, 24 requests, once: checks it runs"
    )
    args = parser.parse_args()
    if args.batch_policies is None or args.serve:  # a Serve replica's engine keeps its configuration
        args.batch_policies = [Policy.configured()]
    if args.tiny:
        args.preset, args.requests, args.adapters, args.prefixes, args.repeats = "tiny", 24, 3, 2, 1
        args.prefix_words, args.max_tokens, args.ttft, args.ttft_requests, args.slots = 12, 4, True, 8, 2
    logging.getLogger("httpx").setLevel(logging.WARNING)
    running = serve_platform if args.serve else platform
    with running(args, Path(tempfile.mkdtemp(prefix="batch-bench-"))) as p:
        result = asyncio.run(measure(args, p))
    result.update(
        requests=args.requests, adapters=args.adapters, prefixes=args.prefixes,
        prefix_words=args.prefix_words, max_tokens=args.max_tokens, rounds=args.repeats,
        in_flight_per_tenant=args.in_flight, max_num_seqs=args.max_num_seqs, slots=args.slots,
        batch_step_tokens=args.batch_step_tokens,
        batch_policies=[policy.label for policy in args.batch_policies],
        mode="serve" if args.serve else "in_process",
        model=args.preset, machine=machine(),
    )  # fmt: skip
    print(json.dumps(result))


if __name__ == "__main__":
    main()
