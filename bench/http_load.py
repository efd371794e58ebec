"""The multi-tenant workload end to end through HTTP, against the same engine alone: do the engine's
figures survive the platform?

The platform is the real Serve app (`serve run serve_config.yaml`'s graph, deployments.builder:build_app,
on a local Ray cluster of this process's own): Serve's HTTP proxy, the ingress (API keys, the Ray rate
limiter, metering into the database) and one engine replica. Tenants are on the `pro` tier with limits
raised so they never bind: every request still takes and releases a limiter lease and leaves one usage row.
N adapters of mixed rank (4/8/16, real PEFT files) are uploaded through the admin API, each owned by one
tenant. The trace is bench.workload's: Poisson arrivals, Zipf adapter popularity, log-normal prompt and
output lengths; the client is httpx (async, streamed SSE on /v1/completions with token-id prompts, greedy),
open loop: each request is sent at its arrival time. TTFT = first chunk with text (or the end of a choice
whose only token has no text); ITL = gaps between chunks with text.

The peer is the engine alone: the same engine config in this process (AsyncEngine, the replica's engine),
the same adapters in its store, the same trace replayed at the same times, timed the same way on its
outputs. Its closed-loop throughput on a burst of the trace is the "capacity"; both replay the trace at
`--load` times that rate. The runs alternate (engine, platform, platform, engine, ...) for `--repeats`.
Reported per peer: TTFT and ITL p50/p99, throughput (requests/s and output tokens/s), errors; the
platform/engine ratios; and the metering check: usage rows (GET /admin/usage) equal to requests sent, and
their prompt/completion tokens equal to what the clients were told.

GuideLLM and AIPerf run the same kind of load through their own clients in bench.external_clients (their
OpenAI backends send one `model` per run, so they cannot replay this Zipf mix over many adapters).
Run: python -m bench.http_load [--tiny] [--adapters 12] [--requests 80] [--load 0.5]; the last line is one
JSON object.
"""

import argparse
import asyncio
import json
import logging
import statistics
import tempfile
import time
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import httpx
from transformers import AutoTokenizer

from adapters.store import AdapterStore
from app.modelprep.demo_model import ensure_model
from bench.measure import machine, spread
from bench.serve_platform import (
    Platform,
    Streamed,
    Tenant,
    build_adapters,
    local_platform,
    percentile,
    stream,
)
from bench.workload import Arrival, adapter_ranks, arrivals, prompt_tokens
from deployments.engine.async_engine import AsyncEngine
from deployments.engine.config import EngineConfig
from deployments.engine.interface import EngineRequest
from deployments.engine.sampling_params import SamplingParams

MODEL = "http-load"


@dataclass
class Outcome:
    """One request as its client saw it (HTTP or the engine's outputs)."""

    ok: bool
    ttft_ms: float | None
    itl_ms: list[float]
    prompt_tokens: int
    completion_tokens: int


def summarise(outcomes: list[Outcome], wall_s: float) -> dict[str, Any]:
    ok = [o for o in outcomes if o.ok]
    ttft = [o.ttft_ms for o in ok if o.ttft_ms is not None]
    itl = [gap for o in ok for gap in o.itl_ms]

    def rounded(value: float | None) -> float | None:
        return None if value is None else round(value, 1)

    return {
        "requests": len(outcomes),
        "errors": len(outcomes) - len(ok),
        "ttft_p50_ms": rounded(percentile(ttft, 50)),
        "ttft_p99_ms": rounded(percentile(ttft, 99)),
        "itl_p50_ms": rounded(percentile(itl, 50)),
        "itl_p99_ms": rounded(percentile(itl, 99)),
        "throughput_rps": round(len(ok) / wall_s, 3),
        "output_tokens_per_s": round(sum(o.completion_tokens for o in ok) / wall_s, 1),
        "wall_s": round(wall_s, 2),
    }


async def replay(trace: list[Arrival], send: Any) -> tuple[list[Outcome], float]:
    """Open loop: each arrival sent at its time, whatever is still running. Returns (outcomes, wall s)."""
    start = time.perf_counter()

    async def one(i: int, arrival: Arrival) -> Outcome:
        await asyncio.sleep(max(0.0, arrival.at_s - (time.perf_counter() - start)))
        result: Outcome = await send(i, arrival)
        return result

    outcomes = await asyncio.gather(*(one(i, a) for i, a in enumerate(trace)))
    return list(outcomes), time.perf_counter() - start


class EngineAlone:
    """The peer: the replica's engine in this process, driven with the same trace."""

    def __init__(self, config: EngineConfig, refs: list[Any], vocab: int) -> None:
        self.engine = AsyncEngine(config)
        self.refs, self.vocab, self.runs = refs, vocab, 0

    async def send(self, i: int, arrival: Arrival) -> Outcome:
        params = SamplingParams(max_tokens=arrival.max_tokens, temperature=0.0)
        request = EngineRequest(
            f"e{self.runs}-{i}", prompt_tokens(arrival, self.vocab), params, self.refs[arrival.adapter]
        )
        start = last = time.perf_counter()
        ttft: float | None = None
        gaps: list[float] = []
        usage = None
        try:
            async for out in self.engine.generate(request):
                usage = out.usage or usage
                if out.text or (out.finished and ttft is None):  # as the HTTP client counts
                    now = time.perf_counter()
                    if ttft is None:
                        ttft = (now - start) * 1e3
                    else:
                        gaps.append((now - last) * 1e3)
                    last = now
                if out.error:
                    return Outcome(False, ttft, gaps, 0, 0)
        except Exception:  # counted as an error, like an HTTP failure
            logging.exception("engine request failed")
            return Outcome(False, ttft, gaps, 0, 0)
        prompt, completion = (usage.prompt_tokens, usage.completion_tokens) if usage else (0, 0)
        return Outcome(True, ttft, gaps, prompt, completion)

    def run(self, trace: list[Arrival]) -> dict[str, Any]:
        self.runs += 1
        outcomes, wall = asyncio.run(replay(trace, self.send))
        return summarise(outcomes, wall)

    def capacity(self, trace: list[Arrival]) -> float:
        """Closed loop: the whole burst at once; completed requests per second."""
        burst = [Arrival(0.0, a.adapter, a.prompt_len, a.max_tokens, a.seed) for a in trace]
        return float(self.run(burst)["throughput_rps"])


class ThroughPlatform:
    """The platform peer: streamed /v1/completions over HTTP, each adapter with its owner's key."""

    def __init__(self, platform: Platform, owners: list[Tenant], names: list[str], vocab: int) -> None:
        self.platform, self.owners, self.names, self.vocab = platform, owners, names, vocab
        self.sent: dict[str, int] = {}  # tenant id -> requests sent
        self.told: dict[str, list[int]] = {}  # tenant id -> [prompt, completion] tokens the clients saw
        self.client: httpx.AsyncClient | None = None

    async def send(self, i: int, arrival: Arrival) -> Outcome:
        assert self.client is not None
        tenant = self.owners[arrival.adapter]
        body = {"model": self.names[arrival.adapter], "prompt": prompt_tokens(arrival, self.vocab),
                "max_tokens": arrival.max_tokens, "temperature": 0}  # fmt: skip
        got: Streamed = await stream(self.client, "/v1/completions", body, tenant.key)
        self.sent[tenant.id] = self.sent.get(tenant.id, 0) + 1
        usage = got.usage or {}
        prompt, completion = int(usage.get("prompt_tokens", 0)), int(usage.get("completion_tokens", 0))
        told = self.told.setdefault(tenant.id, [0, 0])
        told[0] += prompt
        told[1] += completion
        if not got.ok:
            logging.warning("request %d: %s %s", i, got.status, got.error)
        return Outcome(got.ok, got.ttft_ms, got.itl_ms, prompt, completion)

    async def _run(self, trace: list[Arrival]) -> dict[str, Any]:
        limits = httpx.Limits(max_connections=1000, max_keepalive_connections=100)
        async with httpx.AsyncClient(base_url=self.platform.url, timeout=600, limits=limits) as client:
            self.client = client
            outcomes, wall = await replay(trace, self.send)
        self.client = None
        return summarise(outcomes, wall)

    def run(self, trace: list[Arrival]) -> dict[str, Any]:
        return asyncio.run(self._run(trace))

    def metering(self, since: datetime, timeout_s: float = 90.0) -> dict[str, Any]:
        """Usage rows against requests sent, per tenant, once delivery has caught up (or timed out)."""
        deadline = time.monotonic() + timeout_s
        until = datetime.now(UTC) + timedelta(hours=1)
        while True:
            rows = {t: self.platform.usage(since, until, t) for t in self.sent}
            counted = {t: sum(r["requests"] for r in rows[t]) for t in self.sent}
            if counted == self.sent or time.monotonic() > deadline:
                break
            time.sleep(1.0)
        tokens = {t: [sum(r["prompt_tokens"] for r in rows[t]), sum(r["completion_tokens"] for r in rows[t])]
                  for t in self.sent}  # fmt: skip
        return {
            "requests_sent": sum(self.sent.values()),
            "usage_rows": sum(counted.values()),
            "rows_equal_requests": counted == self.sent,
            "tokens_equal_responses": tokens == self.told,
        }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--preset", default="demo", help="demo-model preset (app.modelprep.demo_model)")
    parser.add_argument("--adapters", type=int, default=12)
    parser.add_argument("--tenants", type=int, default=3)
    parser.add_argument("--requests", type=int, default=80)
    parser.add_argument("--load", type=float, default=0.5, help="arrival rate as a fraction of capacity")
    parser.add_argument("--zipf", type=float, default=1.1)
    parser.add_argument("--repeats", type=int, default=2, help="runs of each peer, alternating")
    parser.add_argument("--tiny", action="store_true", help="tiny model, 4 adapters, 16 short requests")
    args = parser.parse_args()
    lengths: dict[str, Any] = {"prompt_median": 96, "prompt_range": (16, 512), "output_median": 32,
                               "output_range": (4, 128)}  # fmt: skip
    if args.tiny:
        args.preset, args.adapters, args.tenants, args.requests, args.repeats = "tiny", 4, 2, 16, 1
        lengths = {"prompt_median": 32, "prompt_range": (8, 128), "output_median": 8, "output_range": (2, 24)}
    logging.getLogger("httpx").setLevel(logging.WARNING)
    model_dir = ensure_model(Path(f"var/bench/{args.preset}"), arch="llama", preset=args.preset).resolve()
    ranks = adapter_ranks(args.adapters, (4, 8, 16))
    engine_args: dict[str, Any] = {"num_kv_blocks": 2048, "max_num_seqs": 32, "max_num_batched_tokens": 512,
                                   "max_loras": 8, "max_cpu_loras": 32, "max_lora_rank": 16}  # fmt: skip
    work = Path(tempfile.mkdtemp(prefix="http-load-"))
    dirs = build_adapters(model_dir, ranks, work / "peft")
    names = [f"z{i:02d}" for i in range(args.adapters)]
    store = AdapterStore(work / "engine-store")
    refs = [store.put_dir(name, path) for name, path in zip(names, dirs, strict=True)]
    config = EngineConfig(model=model_dir, adapter_store=work / "engine-store", **engine_args)
    vocab = len(AutoTokenizer.from_pretrained(model_dir))
    alone = EngineAlone(config, refs, vocab)
    probe = arrivals(num_requests=min(args.requests, 32), num_adapters=args.adapters, rate_per_s=1.0,
                     zipf_s=args.zipf, seed=1, **lengths)  # fmt: skip
    alone.capacity(probe[: max(4, len(probe) // 2)])  # warm: first calls, adapter loads
    capacity = alone.capacity(probe)
    rate = args.load * capacity
    trace = arrivals(num_requests=args.requests, num_adapters=args.adapters, rate_per_s=rate,
                     zipf_s=args.zipf, **lengths)  # fmt: skip
    runs: dict[str, list[dict[str, Any]]] = {"engine": [], "platform": []}
    since = datetime.now(UTC) - timedelta(minutes=1)
    with local_platform(model_dir, MODEL) as platform:
        spec = platform.model_spec(MODEL, "adapter_aware", 1, 1.5, engine_args)
        platform.deploy_models([spec], rate_limiter={"backend": "ray", "fail_open": False})
        limits = {"rpm": 1_000_000, "tpm": 1_000_000_000, "max_concurrent": 10_000}
        tenants = [platform.tenant(f"load-{t}", "pro", **limits) for t in range(args.tenants)]
        owners = [tenants[i % args.tenants] for i in range(args.adapters)]
        for name, path, owner in zip(names, dirs, owners, strict=True):
            platform.upload(name, owner.id, path)
        http = ThroughPlatform(platform, owners, names, vocab)
        http.run(probe[: max(4, len(probe) // 2)])  # warm the same way: adapters into the replica's slots
        order = ["engine", "platform"]
        for r in range(args.repeats):
            for peer in order[r % 2 :] + order[: r % 2]:
                runs[peer].append((alone if peer == "engine" else http).run(trace))
        metering = http.metering(since)
    alone.engine.shutdown()
    merged = {peer: median_run(rows) for peer, rows in runs.items()}

    def ratio(field: str) -> dict[str, float] | None:
        pairs = [p[field] / e[field] for p, e in zip(runs["platform"], runs["engine"], strict=True)
                 if p[field] and e[field]]  # fmt: skip
        return spread(pairs) if pairs else None

    print(f"{'':22}{'engine':>12}{'platform':>12}")
    for key in merged["engine"]:
        print(f"{key:22}{merged['engine'][key]!s:>12}{merged['platform'][key]!s:>12}")
    result = {
        "bench": "http_load",
        "preset": args.preset,
        "adapters": args.adapters,
        "ranks": sorted(set(ranks)),
        "tenants": args.tenants,
        "requests": args.requests,
        "capacity_rps": round(capacity, 3),
        "load": args.load,
        "rate_rps": round(rate, 3),
        "repeats": args.repeats,
        "engine": merged["engine"],
        "platform": merged["platform"],
        "overhead": {
            "ttft_p50_platform_over_engine": ratio("ttft_p50_ms"),
            "ttft_p99_platform_over_engine": ratio("ttft_p99_ms"),
            "itl_p50_platform_over_engine": ratio("itl_p50_ms"),
            "throughput_platform_over_engine": ratio("throughput_rps"),
        },
        "errors": merged["engine"]["errors"] + merged["platform"]["errors"],
        "metering": metering,
        "machine": machine(str(config.torch_dtype()).removeprefix("torch.")),
    }
    print(json.dumps(result))


def median_run(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Per field, the median over the runs (errors and requests: the sum)."""
    out: dict[str, Any] = {}
    for key in rows[0]:
        values = [row[key] for row in rows if row[key] is not None]
        if key in ("errors", "requests"):
            out[key] = sum(values)
        else:
            out[key] = round(statistics.median(values), 3) if values else None
    return out


if __name__ == "__main__":
    main()
