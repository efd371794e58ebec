"""Many more adapters than slots, under real arrivals: our engine against the same engine with every
adapter resident (the upper bound), on the same trace, interleaved.

Workload (bench/workload.py): N adapters of mixed rank (default 256, ranks 8/16/32/64, all seven linear
targets) with Zipf popularity, Poisson arrivals at a fraction (`--load`) of the capacity measured on the
all-resident engine in this run, log-normal prompt and output lengths. Peers:
  ours      max_loras slots (default 16) and a CPU tier smaller than N (default 64): adapters are read
            from the store, cached in CPU memory and written into slots as the scheduler needs them.
  resident  N slots and N CPU entries, every adapter in a slot before the run: no load ever happens.
  no_read_wait  (--read-wait-peer) ours with adapter_read_wait_s 0: a cold adapter's read always overlaps
            the steps, so its request starts a step later (the engine before the read wait).
  max_rank_slots  (--slots-peer) ours with one page an adapter (lora_page_rank = the largest rank): the same
            memory in max-rank slots, as before adapter memory was sized by rank.
Rounds alternate the peers (A B, B A, ...), each round on a fresh trace (so no prefix is cached from the
previous round); ratios are per round, summarised by median and spread.

Reported per peer: throughput (generated tokens / makespan), TTFT p50/p99 (from the scheduled arrival
time), queue wait max (arrival -> first scheduled), adapter slot loads and evictions, store reads.
Run:  python -m bench.multi_tenant [--adapters 256 --slots 16 --load 0.8] [--quick | --tiny]
The last line is one JSON object.
"""

import argparse
import json
import statistics
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from adapters.ref import AdapterRef
from bench.assets import ensure_mixed_adapters
from bench.measure import Interleaved, machine, spread
from bench.workload import Arrival, adapter_ranks, arrivals, prompt_tokens
from deployments.engine.config import EngineConfig
from deployments.engine.cpu_features import cpu_features
from deployments.engine.interface import EngineRequest
from deployments.engine.llm_engine import LLMEngine
from deployments.engine.sampling_params import SamplingParams


@dataclass(frozen=True)
class RunResult:
    throughput: float  # generated tokens per second of makespan
    makespan_s: float  # the replay clock (trace time 0) -> last finish
    ttft_p50: float
    ttft_p99: float
    max_wait_s: float
    loads: int  # adapter writes into slots
    evictions: int
    store_reads: int  # disk/object store -> CPU tier
    store_read_ms: float  # mean time of one (on a loader thread, beside the steps)
    slot_preemptions: int  # running sequences preempted to give an overdue adapter their slot
    requests: int
    mean_batch: float  # running sequences per step: how full the batch stayed
    # Where the slowest 2% of requests (by TTFT) spent it, medians in seconds: waiting for their adapter's
    # store read (those whose adapter was in neither tier on arrival), then for a slot and a row, then from
    # their first step to their first token (prefill, chunked beside other work).
    tail_store_wait_s: float
    tail_slot_row_wait_s: float
    tail_first_step_s: float
    tail_cold: float  # the share of them whose adapter was in neither tier on arrival


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def replay(
    engine: LLMEngine, trace: list[Arrival], refs: list[AdapterRef], vocab: int, tag: str
) -> RunResult:
    """Feed the trace in real time (arrivals join between steps) and step until everything finished."""
    slots, cpu = engine.adapters.slots, engine.adapters.cpu
    loads0, evictions0, reads0, read_s0 = slots.loads, slots.evictions, cpu.loads, cpu.load_seconds
    taken0 = engine.scheduler.slot_preemptions
    prompts = [prompt_tokens(a, vocab) for a in trace]
    pending = deque(enumerate(trace))
    added: dict[str, float] = {}
    due: dict[str, float] = {}
    cold: dict[str, AdapterRef] = {}  # requests whose adapter was in neither tier when they arrived
    scheduled: dict[str, float] = {}
    first: dict[str, float] = {}
    waits: list[float] = []
    tokens = steps = batch = 0
    start = time.perf_counter()
    monotonic_start = time.monotonic()  # the CPU tier's load times are time.monotonic()
    last = 0.0
    while pending or engine.has_unfinished():
        now = time.perf_counter() - start
        while pending and pending[0][1].at_s <= now:
            i, a = pending.popleft()
            rid = f"{tag}-{i}"
            params = SamplingParams(max_tokens=a.max_tokens, temperature=0, ignore_eos=True)
            ref = refs[a.adapter]
            if not cpu.is_ready(ref) and not slots.holds(ref):
                cold[rid] = ref
            engine.add_request(EngineRequest(rid, prompts[i], params, ref))
            added[rid], due[rid] = now, a.at_s
        if not engine.has_unfinished():
            time.sleep(max(0.0, min(0.005, pending[0][1].at_s - now)))
            continue
        outputs = engine.step()
        steps += 1
        batch += len(engine.scheduler.running)
        if engine.counters.last_step_tokens == 0:  # everyone waits for an adapter load: let the loader run
            time.sleep(0.0005)
        t = time.perf_counter() - start
        for out in outputs:
            if out.token_ids and out.request_id not in first:
                first[out.request_id] = t
            tokens += len(out.token_ids)
            if out.finished:
                last = t
                if out.error is not None:
                    raise RuntimeError(f"{out.request_id} failed: {out.error}")
                assert out.usage is not None
                rid = out.request_id
                waits.append(added[rid] - due[rid] + out.usage.queue_ms / 1e3)
                scheduled[rid] = added[rid] + out.usage.queue_ms / 1e3
    ttfts = [first[rid] - due[rid] for rid in due]
    tail = sorted(due, key=lambda rid: first[rid] - due[rid])[-max(1, len(due) // 50) :]

    def store_wait(rid: str) -> float:
        if rid not in cold:
            return 0.0
        ready = cpu.loaded_at.get(cold[rid], 0.0) - monotonic_start
        return max(0.0, min(ready, scheduled[rid]) - due[rid])

    def tail_median(part: Callable[[str], float]) -> float:
        return round(statistics.median(part(rid) for rid in tail), 4)

    return RunResult(
        throughput=tokens / last,
        makespan_s=last,
        ttft_p50=statistics.median(ttfts),
        ttft_p99=percentile(ttfts, 0.99),
        max_wait_s=max(waits),
        loads=slots.loads - loads0,
        evictions=slots.evictions - evictions0,
        store_reads=cpu.loads - reads0,
        store_read_ms=round((cpu.load_seconds - read_s0) * 1e3 / max(1, cpu.loads - reads0), 1),
        slot_preemptions=engine.scheduler.slot_preemptions - taken0,
        requests=len(trace),
        mean_batch=batch / max(1, steps),
        tail_store_wait_s=tail_median(store_wait),
        tail_slot_row_wait_s=tail_median(lambda rid: scheduled[rid] - due[rid] - store_wait(rid)),
        tail_first_step_s=tail_median(lambda rid: first[rid] - scheduled[rid]),
        tail_cold=round(sum(rid in cold for rid in tail) / len(tail), 2),
    )


def make_engine(
    args: argparse.Namespace,
    model_dir: Any,
    store_root: Any,
    slots: int,
    cpu_slots: int,
    page_rank: int | None = None,
    read_wait_s: float | None = None,
) -> LLMEngine:
    read_wait = {} if read_wait_s is None else {"adapter_read_wait_s": read_wait_s}
    return LLMEngine(
        EngineConfig(
            model=model_dir,
            adapter_store=store_root,
            dtype=args.dtype,
            max_loras=slots,
            max_cpu_loras=cpu_slots,
            max_lora_rank=max(args.ranks),
            lora_page_rank=page_rank,
            max_num_seqs=args.max_num_seqs,
            max_num_batched_tokens=args.max_num_batched_tokens,
            kv_cache_memory_mb=args.kv_cache_mb,
            adapter_wait_bound_s=args.wait_bound,
            **read_wait,
        )
    )


def make_resident(engine: LLMEngine, refs: list[AdapterRef]) -> None:
    """Every adapter into CPU memory and a slot, before the clock starts."""
    for ref in refs:
        future = engine.adapters.prefetch(ref)
        if future is not None:
            future.result()
        slot = engine.adapters.acquire(ref)
        assert slot is not None, f"{ref} found no slot"
        engine.adapters.release(slot)


def make_trace(args: argparse.Namespace, *, rate_per_s: float, seed: int) -> list[Arrival]:
    return arrivals(
        num_requests=args.requests,
        num_adapters=args.adapters,
        rate_per_s=rate_per_s,
        zipf_s=args.zipf,
        prompt_median=args.prompt_median,
        output_median=args.output_median,
        seed=seed,
    )


def capacity(engine: LLMEngine, refs: list[AdapterRef], vocab: int, args: argparse.Namespace) -> float:
    """Requests per second the all-resident engine completes with its queue never empty."""
    burst = make_trace(args, rate_per_s=1e9, seed=10_000)
    return len(burst) / replay(engine, burst, refs, vocab, "capacity").makespan_s


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--adapters", type=int, default=256)
    parser.add_argument("--ranks", default="8,16,32,64", help="each adapter's rank is drawn from these")
    parser.add_argument("--slots", type=int, default=16, help="max_loras of our engine")
    parser.add_argument("--cpu-adapters", type=int, default=64, help="max_cpu_loras of our engine (< N)")
    parser.add_argument("--load", type=float, default=0.8, help="arrival rate as a fraction of capacity")
    parser.add_argument(
        "--rate",
        type=float,
        help="arrival rate in requests/s (overrides --load): one rate for every point of a sweep over "
        "--adapters, as the all-resident capacity falls with the number of adapters it holds",
    )
    parser.add_argument("--zipf", type=float, default=1.1, help="popularity skew exponent")
    parser.add_argument("--requests", type=int, default=600, help="per run")
    parser.add_argument("--repeats", type=int, default=3, help="rounds (each runs both peers)")
    parser.add_argument("--prompt-median", type=int, default=96, help="tokens (log-normal, 16-512)")
    parser.add_argument("--output-median", type=int, default=32, help="tokens (log-normal, 4-256)")
    parser.add_argument("--max-num-seqs", type=int, default=32)
    parser.add_argument("--max-num-batched-tokens", type=int, default=512)
    parser.add_argument("--kv-cache-mb", type=int, default=512)
    parser.add_argument("--wait-bound", type=float, default=1.0, help="adapter_wait_bound_s (0: drain only)")
    parser.add_argument("--preset", default="demo")
    parser.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"])
    parser.add_argument("--page-rank", type=int, help="lora_page_rank of ours (default: the engine's)")
    parser.add_argument(
        "--slots-peer", action="store_true", help="also run ours in max-rank slots (one page an adapter)"
    )
    parser.add_argument(
        "--read-wait-peer", action="store_true", help="also run ours with adapter_read_wait_s 0"
    )
    parser.add_argument("--quick", action="store_true", help="64 adapters, 200 requests, 2 rounds")
    parser.add_argument("--tiny", action="store_true", help="the tiny model, 12 adapters: checks it runs")
    args = parser.parse_args()
    if args.quick:
        args.adapters, args.requests, args.repeats, args.slots, args.cpu_adapters = 64, 200, 2, 8, 24
    if args.tiny:
        args.preset, args.adapters, args.requests, args.repeats = "tiny", 12, 40, 1
        args.slots, args.cpu_adapters, args.ranks, args.max_num_seqs = 4, 6, "4,8", 8
        args.requests, args.prompt_median, args.output_median = 24, 16, 4
        args.page_rank, args.slots_peer, args.read_wait_peer = 4, True, True
    args.ranks = [int(r) for r in args.ranks.split(",")]
    if args.dtype == "auto":
        args.dtype = "bfloat16" if cpu_features().native_bf16 or torch.cuda.is_available() else "float32"

    model_dir, store_root, names = ensure_mixed_adapters(
        preset=args.preset, ranks=adapter_ranks(args.adapters, tuple(args.ranks))
    )
    ours = make_engine(args, model_dir, store_root, args.slots, args.cpu_adapters, args.page_rank)
    resident = make_engine(args, model_dir, store_root, args.adapters, args.adapters)
    refs = [ours.adapters.store.latest(name) for name in names]
    vocab = ours.loaded.vocab_size
    make_resident(resident, refs)
    cap = capacity(resident, refs, vocab, args)
    rate = args.rate or args.load * cap

    peers = {"ours": ours, "resident": resident}
    if args.slots_peer:
        peers["max_rank_slots"] = make_engine(
            args, model_dir, store_root, args.slots, args.cpu_adapters, max(args.ranks)
        )
    if args.read_wait_peer:
        peers["no_read_wait"] = make_engine(
            args, model_dir, store_root, args.slots, args.cpu_adapters, args.page_rank, read_wait_s=0.0
        )
    runs: dict[str, list[RunResult]] = {name: [] for name in peers}

    def peer(name: str, engine: LLMEngine) -> Any:
        def run() -> float:
            seed = len(runs[name]) + 1  # round r replays trace r on both peers
            trace = make_trace(args, rate_per_s=rate, seed=seed)
            result = replay(engine, trace, refs, vocab, f"{name}-{seed}")
            runs[name].append(result)
            return result.throughput

        return run

    Interleaved({name: peer(name, engine) for name, engine in peers.items()}, repeats=args.repeats).run()
    for engine in peers.values():
        engine.close()

    def per_round_vs(field: str, name: str, peer: str) -> dict[str, float]:
        values = [getattr(a, field) / getattr(b, field) for a, b in zip(runs[name], runs[peer], strict=True)]
        return spread(values)

    def per_round(field: str, name: str = "ours") -> dict[str, float]:
        return per_round_vs(field, name, "resident")

    def summary(name: str) -> dict[str, Any]:
        rs = runs[name]
        return {
            "throughput_tok_s": spread([r.throughput for r in rs]),
            "ttft_p50_s": spread([r.ttft_p50 for r in rs]),
            "ttft_p99_s": spread([r.ttft_p99 for r in rs]),
            "max_wait_s": round(max(r.max_wait_s for r in rs), 3),
            "loads": [r.loads for r in rs],
            "evictions": [r.evictions for r in rs],
            "store_reads": [r.store_reads for r in rs],
            "store_read_ms": [r.store_read_ms for r in rs],
            "slot_preemptions": [r.slot_preemptions for r in rs],
            "mean_batch": [round(r.mean_batch, 1) for r in rs],
            "tail_store_wait_s": [r.tail_store_wait_s for r in rs],
            "tail_slot_row_wait_s": [r.tail_slot_row_wait_s for r in rs],
            "tail_first_step_s": [r.tail_first_step_s for r in rs],
            "tail_cold": [r.tail_cold for r in rs],
        }

    throughput, ttft = per_round("throughput"), per_round("ttft_p99")
    in_slots = (
        {
            "max_rank_slots_throughput_vs_resident": per_round("throughput", "max_rank_slots"),
            "max_rank_slots_ttft_p99_vs_resident": per_round("ttft_p99", "max_rank_slots"),
        }
        if args.slots_peer
        else {}
    )
    read_wait = (
        {
            "no_read_wait_ttft_p99_vs_ours": per_round_vs("ttft_p99", "no_read_wait", "ours"),
            "no_read_wait_throughput_vs_ours": per_round_vs("throughput", "no_read_wait", "ours"),
        }
        if args.read_wait_peer
        else {}
    )
    result = {
        **in_slots,
        **read_wait,
        "throughput_vs_resident": throughput["median"],
        "throughput_vs_resident_spread": throughput,
        "ttft_p99_vs_resident": ttft["median"],
        "ttft_p99_vs_resident_spread": ttft,
        "max_wait_s": round(max(r.max_wait_s for r in runs["ours"]), 3),
        "loads": round(statistics.median(r.loads for r in runs["ours"])),
        "adapters": args.adapters,
        "slots": args.slots,
        "cpu_adapters": args.cpu_adapters,
        "ranks": args.ranks,
        "zipf": args.zipf,
        "load": args.load,
        "capacity_req_s": round(cap, 2),
        "rate_req_s": round(rate, 2),
        "requests": args.requests,
        "rounds": args.repeats,
        "max_num_seqs": args.max_num_seqs,
        "adapter_wait_bound_s": args.wait_bound,
        "model": args.preset,
        "lora_page_rank": ours.loaded.lora_page_rank,
        **{name: summary(name) for name in peers},
        "machine": machine(args.dtype),
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
