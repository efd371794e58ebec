"""Fair admission across tenants: a quiet tenant beside another tenant's backlog, in one engine in process
or (--serve) through the Serve app as tenants use it.

Peers, on the same engine, alternating round by round (fair, fifo, fifo, fair, ...): the engine's
`scheduling` "fair" (the virtual token counter, with fair_wait_bound_s preemption) and "fifo" (arrival
order across tenants, as before issue 34). Each round: tenant `flood` queues a backlog (4x the rows, long
outputs, EOS ignored) and tenant `quiet` sends short requests one after another while it drains. Reported
per peer: quiet's TTFT p90 over its TTFT p50 alone (measured in the same round, before the backlog), and the
engine's throughput over the same load (every token generated until backlog and quiet are done; fair's over
fifo's). Then three backlogged tenants of weights 1:1:2 under "fair":
their shares of the service served.

The goal (issue 34): quiet's TTFT p90 beside the backlog <= 10x its p50 alone; weights 1:1:2 within 5%
(relative) of 25/25/50%; throughput >= 0.95 of fifo's; in the Serve mode, quiet's TTFT p90 beside the
backlog <= 10x its p50 alone.

--serve: a local Ray cluster and the Serve app (bench.serve_platform) with one engine replica of the tiny
Llama per peer, deployed together as models tiny-llama-fair and tiny-llama-fifo (4 rows each, the same
engine settings but `scheduling`). Each round, on the peer's model: two fresh enterprise tenants (admin API);
quiet's streamed TTFT (first token chunk of /v1/completions, max_tokens 4) over short requests one after
another alone, then again while flood's backlog (16 streamed requests at once, EOS ignored, --output-tokens
each) streams (only those sent before the backlog is done count: fifo's one wait behind the whole backlog is
not diluted by fast requests after it). Peers in turns as above. Reported per peer: quiet's TTFT p90
beside over p50 alone.

Run:  python -m bench.fairness [--tiny] [--repeats N] [--output-tokens N] [--serve]
The last line is one JSON object.
"""

import argparse
import asyncio
import json
import logging
import statistics
import time
from collections.abc import Iterator
from itertools import count
from pathlib import Path
from typing import Any

import httpx

from app.modelprep.demo_model import ensure_model
from bench.assets import ensure_bench_assets
from bench.grammar_libraries import percentile
from bench.measure import machine, spread
from bench.serve_platform import Platform, Tenant, local_platform, stream
from deployments.engine.config import EngineConfig
from deployments.engine.interface import EngineRequest, SamplingParams
from deployments.engine.llm_engine import LLMEngine

_ids: Iterator[int] = count()


def request(tenant: str, prompt_len: int, max_tokens: int, weight: float = 1.0) -> EngineRequest:
    n = next(_ids)
    prompt = [(n * 131 + k * 7) % 900 + 10 for k in range(prompt_len)]  # distinct: no prefix-cache hits
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=0.0)
    return EngineRequest(
        f"{tenant}-{n}", prompt, params, cache_salt=tenant, tenant=tenant, tenant_weight=weight
    )


def quiet_ttfts(engine: LLMEngine, count_: int, backlog: list[EngineRequest]) -> tuple[list[float], float]:
    """TTFTs (s) of `count_` quiet requests sent one after another while `backlog` drains; and the tokens
    generated per second (backlog and quiet) until both are done."""
    for r in backlog:
        engine.add_request(r)
    ttfts: list[float] = []
    tokens = 0
    started = time.perf_counter()
    pending: tuple[str, float] | None = None
    while engine.has_unfinished() or len(ttfts) < count_:
        if pending is None and len(ttfts) < count_:
            quiet = request("quiet", 32, 4)
            engine.add_request(quiet)
            pending = (quiet.request_id, time.perf_counter())
        for out in engine.step():
            tokens += len(out.token_ids)  # the backlog's and quiet's: the engine's whole throughput
            if pending is not None and out.request_id == pending[0] and out.token_ids:
                ttfts.append(time.perf_counter() - pending[1])
                pending = None
    return ttfts, tokens / (time.perf_counter() - started)


def one_round(engine: LLMEngine, peer: str, rows: int, output_tokens: int, quiet: int) -> dict[str, float]:
    engine.scheduler.scheduling = peer  # type: ignore[assignment]
    alone, _ = quiet_ttfts(engine, quiet, [])
    prompt = 256 if output_tokens <= 512 else 16  # within the tiny model's 1,024-token context
    backlog = [request("flood", prompt, output_tokens) for _ in range(4 * rows)]
    beside, throughput = quiet_ttfts(engine, quiet, backlog)
    return {
        "alone_p50_ms": statistics.median(alone) * 1e3,
        "beside_p90_ms": percentile(beside, 0.9) * 1e3,
        "ratio_p90_vs_alone": percentile(beside, 0.9) / statistics.median(alone),
        "tok_s": throughput,
    }


def weighted_shares(engine: LLMEngine, rows: int, output_tokens: int) -> dict[str, float]:
    """Three backlogged tenants of weights 1, 1, 2 under fair: each one's share of the raw service served
    while all three still had work waiting."""
    engine.scheduler.scheduling = "fair"
    weights = {"w1a": 1.0, "w1b": 1.0, "w2": 2.0}
    before = {t: engine.scheduler.served.get(t, 0.0) * w for t, w in weights.items()}
    for _ in range(3 * rows):
        for tenant, weight in weights.items():
            engine.add_request(request(tenant, 64, min(output_tokens, 128), weight))
    raw: dict[str, float] = {}
    while all(engine.scheduler.waiting_of(t) for t in weights):  # all three backlogged
        engine.step()
        raw = {t: engine.scheduler.served.get(t, 0.0) * w - before[t] for t, w in weights.items()}
    while engine.has_unfinished():
        engine.step()
    total = sum(raw.values()) or 1.0
    return {t: v / total for t, v in raw.items()}


def jain(values: list[float]) -> float:
    return sum(values) ** 2 / (len(values) * sum(v * v for v in values))


# -- the Serve app: tenants over HTTP -------------------------------------------------------------------

SERVE_MODEL = "tiny-llama"


def serve_engine(peer: str, rows: int, fair_wait_bound_s: float) -> dict[str, Any]:
    """The Serve mode's engine (the model spec's `engine`): the in-process settings, `scheduling` = peer."""
    return {"max_num_seqs": rows, "max_num_batched_tokens": 1024, "num_kv_blocks": 4096,
            "fair_wait_bound_s": fair_wait_bound_s, "scheduling": peer}  # fmt: skip


async def serve_ttfts(
    client: httpx.AsyncClient,
    model: str,
    quiet: Tenant,
    count_: int,
    backlog: list[dict[str, Any]],
    flood: str,
) -> list[float]:
    """TTFTs (ms) of short streamed quiet requests sent one after another: `count_` of them alone (no
    backlog), else as many as are sent while `backlog` (request bodies, sent all at once under `flood`'s key)
    still streams, so one long wait is never diluted by fast requests after it drains. Every request must
    succeed."""
    floods = [asyncio.create_task(stream(client, "/v1/completions", body, flood)) for body in backlog]
    await asyncio.sleep(0.2)  # the backlog in the engine's queue first
    ttfts: list[float] = []

    def more() -> bool:
        return any(not f.done() for f in floods) if floods else len(ttfts) < count_

    while more():
        n = next(_ids)
        body = {"model": model, "prompt": f"quiet {n}: select name from users where", "max_tokens": 4,
                "temperature": 0.0}  # fmt: skip
        out = await stream(client, "/v1/completions", body, quiet.key)
        if not out.ok or out.ttft_ms is None:
            raise RuntimeError(f"quiet request failed: {out.status} {out.error}")
        ttfts.append(out.ttft_ms)
    for out in await asyncio.gather(*floods):
        if not out.ok:
            raise RuntimeError(f"backlog request failed: {out.status} {out.error}")
    return ttfts


def flood_body(model: str, output_tokens: int) -> dict[str, Any]:
    n = next(_ids)  # distinct openings: no prefix-cache hits
    # ~400 tokens, or a few when the outputs are long: within the tiny model's 1,024-token context
    repeats = 20 if output_tokens <= 512 else 0
    prompt = f"row {n}: " + "the quick brown fox jumps over the lazy dog " * repeats
    return {"model": model, "prompt": prompt, "max_tokens": output_tokens, "ignore_eos": True,
            "temperature": 0.0}  # fmt: skip


async def serve_round(
    platform: Platform, peer: str, rows: int, output_tokens: int, quiet_count: int
) -> dict[str, float]:
    """One round on peer's model: two fresh enterprise tenants; quiet alone, then beside flood's backlog."""
    model = f"{SERVE_MODEL}-{peer}"
    n = next(_ids)
    quiet, flood = platform.tenant(f"quiet-{peer}-{n}"), platform.tenant(f"flood-{peer}-{n}")
    async with httpx.AsyncClient(base_url=platform.url, timeout=600) as client:
        alone = await serve_ttfts(client, model, quiet, quiet_count, [], flood.key)
        backlog = [flood_body(model, output_tokens) for _ in range(4 * rows)]
        beside = await serve_ttfts(client, model, quiet, quiet_count, backlog, flood.key)
    return {
        "alone_p50_ms": statistics.median(alone),
        "beside_p90_ms": percentile(beside, 0.9),
        "ratio_p90_vs_alone": percentile(beside, 0.9) / statistics.median(alone),
        "beside_n": len(beside),
    }


def serve_main(args: argparse.Namespace) -> None:
    """--serve: both peers as one engine replica each of the tiny Llama in one Serve app (models
    tiny-llama-fair and tiny-llama-fifo, the same engine settings but `scheduling`), reached over HTTP."""
    logging.getLogger("httpx").setLevel(logging.WARNING)
    repeats = args.repeats or (1 if args.tiny else 5)
    rows, quiet = 4, (4 if args.tiny else 12)
    output_tokens = args.output_tokens or (16 if args.tiny else 128)
    model_dir = ensure_model(Path("var/bench/tiny-llama"), arch="llama", preset="tiny").resolve()
    runs: dict[str, list[dict[str, float]]] = {"fair": [], "fifo": []}
    with local_platform(model_dir, SERVE_MODEL) as platform:
        engines = {peer: serve_engine(peer, rows, args.fair_wait_bound_s) for peer in ("fair", "fifo")}
        platform.deploy_models(
            [platform.model_spec(f"{SERVE_MODEL}-{peer}", "default", 1, 1.5, engine)
             for peer, engine in engines.items()]
        )  # fmt: skip
        for peer in ("fair", "fifo"):  # warm-up: the backlog's shapes once on each replica
            asyncio.run(serve_round(platform, peer, rows, 16, 2))
        for i in range(repeats):
            for peer in ("fair", "fifo") if i % 2 == 0 else ("fifo", "fair"):
                runs[peer].append(asyncio.run(serve_round(platform, peer, rows, output_tokens, quiet)))
    host = machine()
    print(
        f"Serve app, tiny Llama, {rows} rows a replica; backlog {4 * rows} x {output_tokens} output tokens;"
    )
    print(f"{quiet} quiet requests; {repeats} rounds a peer")
    ratios = {}
    for peer, rounds in runs.items():
        alone = statistics.median(r["alone_p50_ms"] for r in rounds)
        beside = statistics.median(r["beside_p90_ms"] for r in rounds)
        ratios[peer] = round(statistics.median(r["ratio_p90_vs_alone"] for r in rounds), 2)
        print(
            f"  {peer}: quiet TTFT p50 {alone:.1f} ms, p90 beside a backlog {beside:.1f} ms, {ratios[peer]}x"
        )
    result = {
        "serve_fair_ratio_p90_vs_alone": ratios["fair"],
        "serve_fifo_ratio_p90_vs_alone": ratios["fifo"],
        "serve": {
            "fair_ratio_p90_vs_alone": ratios["fair"],
            "fifo_ratio_p90_vs_alone": ratios["fifo"],
            "rounds": runs,
        },
        "rows": rows,
        "output_tokens": output_tokens,
        "repeats": repeats,
        "fair_wait_bound_s": args.fair_wait_bound_s,
        "machine": host,
    }
    print(json.dumps(result))


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--tiny", action="store_true", help="the tiny model, a small backlog: seconds")
    parser.add_argument("--repeats", type=int, default=None, help="rounds per peer (default 5, tiny 1)")
    parser.add_argument("--output-tokens", type=int, default=None, help="backlog outputs (default 128)")
    parser.add_argument("--fair-wait-bound-s", type=float, default=0.1, help="the engine's (default 0.1)")
    parser.add_argument("--serve", action="store_true", help="through the Serve app over HTTP (minutes)")
    args = parser.parse_args()
    if args.serve:
        serve_main(args)
        return
    repeats = args.repeats or (1 if args.tiny else 5)
    preset, rows, quiet = ("tiny", 4, 4) if args.tiny else ("bench-150m", 16, 12)
    output_tokens = args.output_tokens or (16 if args.tiny else 128)
    model_dir, store_root, _ = ensure_bench_assets(preset=preset, num_adapters=1, rank=8)
    config = EngineConfig(
        model=model_dir,
        adapter_store=store_root,
        dtype="float32",
        max_loras=1,
        max_num_seqs=rows,
        max_num_batched_tokens=1024,
        num_kv_blocks=4096,
        fair_wait_bound_s=args.fair_wait_bound_s,
    )
    engine = LLMEngine(config)
    one_round(engine, "fifo", rows, 16, 2)  # warm-up: the backlog's prompt shapes once
    runs: dict[str, list[dict[str, float]]] = {"fair": [], "fifo": []}
    for i in range(repeats):
        for peer in ("fair", "fifo") if i % 2 == 0 else ("fifo", "fair"):
            runs[peer].append(one_round(engine, peer, rows, output_tokens, quiet))
    shares = weighted_shares(engine, rows, output_tokens)
    engine.close()

    def median(peer: str, key: str) -> float:
        return statistics.median(r[key] for r in runs[peer])

    pairs = zip(runs["fair"], runs["fifo"], strict=True)
    throughput_ratios = [fair["tok_s"] / fifo["tok_s"] for fair, fifo in pairs]
    host = machine("float32")
    print(f"cpu: {host['cpu']}, isa {host['isa']}, {host['threads']} threads; {preset}, {rows} rows")
    print(
        f"backlog {4 * rows} x {output_tokens} output tokens; {quiet} quiet requests; {repeats} rounds a peer"
    )
    for peer in runs:
        alone, beside = median(peer, "alone_p50_ms"), median(peer, "beside_p90_ms")
        ratio = median(peer, "ratio_p90_vs_alone")
        print(f"  {peer}: quiet TTFT p50 {alone:.1f} ms, p90 beside a backlog {beside:.1f} ms, {ratio:.1f}x")
    print(f"throughput fair/fifo (all tokens): {statistics.median(throughput_ratios):.3f} (goal >= 0.95)")
    print(
        "weights 1:1:2 shares: " + ", ".join(f"{t} {v:.3f}" for t, v in shares.items()) + " (goal .25/.25/.5)"
    )
    result: dict[str, Any] = {
        "fair_ratio_p90_vs_alone": round(median("fair", "ratio_p90_vs_alone"), 2),
        "fifo_ratio_p90_vs_alone": round(median("fifo", "ratio_p90_vs_alone"), 2),
        "throughput_ratio_fair_vs_fifo": round(statistics.median(throughput_ratios), 4),
        "throughput_ratio_spread": spread(throughput_ratios),
        "weighted_shares": {t: round(v, 4) for t, v in shares.items()},
        "jain_equal_weights": round(jain([shares["w1a"], shares["w1b"]]), 4),
        "runs": runs,
        "rows": rows,
        "output_tokens": output_tokens,
        "repeats": repeats,
        "preset": preset,
        "machine": host,
        "model": Path(model_dir).name,
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
