"""Multi-LoRA serving throughput, every peer interleaved (A B A B ...) in one run, medians with their spread.

Overhead (the headline): one engine, 16 rank-16 all-linear adapters resident, a batch of 32 requests spread
over the 16 adapters against the same 32 requests on the base model, in turns:
  decode:  steady decode steps with all 32 sequences running (prefill excluded), generated tokens/s;
  prefill: 32 prompts of 128-256 tokens, prompt tokens/s of the prefill steps.
`decode_ratio_vs_base` and `prefill_ratio_vs_base` are medians of per-round ratios; their ceiling is 1.0.

Against HF (same requests end to end, static batches of 32 for HF, EOS ignored everywhere):
  ours with adapters vs HF PEFT generate(adapter_names=...), and ours-base vs HF-base. The second ratio is the
  ceiling of the first as far as the base model goes (`ceilings`). HF peers get the lm_head contiguity fix.
Continuous vs static batching on our engine (skewed output lengths, 8 in flight for both), and adapter
activation time (CPU tier -> slot, disk -> slot).

Every peer runs the same model, dtype, threads and prompts; "machine" in the JSON names the CPU, its ISA and
the threads. Prefix caching is off in the bench engine so no round reuses another's prompt KV.

The decode step is also set against its floor: every weight byte (and, with adapters, every adapter byte)
read once per step at the streaming bandwidth measured in the same rounds (KV reads left out: a lower bound).

Run:  python -m bench.multi_lora [--quick | --tiny] [--dtype auto|float32|bfloat16] [--device cuda]
      [--quantization nf4|int8] [--preset bench-1b] [--only-overhead]
The last line is one JSON object.
"""

import argparse
import json
import random
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch
from peft import PeftModel
from transformers import AutoModelForCausalLM, PreTrainedModel

from adapters.ref import AdapterRef
from bench.assets import ensure_bench_assets
from bench.measure import Interleaved, machine, spread
from deployments.engine.config import EngineConfig
from deployments.engine.cpu_features import cpu_features
from deployments.engine.interface import EngineRequest
from deployments.engine.llm_engine import LLMEngine
from deployments.engine.model.lora_layers import load_adapter_into_slot
from deployments.engine.sampling_params import SamplingParams


class HFGenerator(Protocol):
    """An HF peer: a transformers causal LM, or a PeftModel around one (which forwards `device`)."""

    @property
    def device(self) -> torch.device: ...

    def generate(self, *args: Any, **kwargs: Any) -> Any: ...


@dataclass(frozen=True)
class Request:
    prompt: list[int]
    max_tokens: int
    adapter: int  # index into the adapter list


@dataclass(frozen=True)
class Sizes:
    batch: int  # sequences in flight (the overhead batch, and HF's static batch)
    prompt_range: tuple[int, int]  # overhead prefill prompts
    decode_steps: int  # timed decode steps per overhead round
    overhead_rounds: int
    e2e_requests: int
    e2e_out: tuple[int, int]
    e2e_rounds: int
    skew_requests: int
    skew_long: int


SIZES = {
    "full": Sizes(32, (128, 256), 48, 7, 32, (64, 96), 3, 48, 128),
    "quick": Sizes(32, (96, 160), 24, 5, 32, (24, 40), 2, 16, 64),
    "tiny": Sizes(8, (16, 32), 6, 2, 8, (6, 10), 2, 8, 16),
}


def make_requests(
    n: int, *, num_adapters: int, prompt_range: tuple[int, int], out_range: tuple[int, int], seed: int
) -> list[Request]:
    rnd = random.Random(seed)
    return [
        Request(
            prompt=[rnd.randrange(5, 2000) for _ in range(rnd.randint(*prompt_range))],
            max_tokens=rnd.randint(*out_range),
            adapter=i % num_adapters,
        )
        for i in range(n)
    ]


def add_all(engine: LLMEngine, requests: list[Request], refs: list[AdapterRef] | None) -> None:
    tag = random.random()
    for i, r in enumerate(requests):
        params = SamplingParams(max_tokens=r.max_tokens, temperature=0, ignore_eos=True)
        adapter = None if refs is None else refs[r.adapter]
        engine.add_request(EngineRequest(f"{tag}-{i}", r.prompt, params, adapter))


def prefill_tok_s(engine: LLMEngine, requests: list[Request], refs: list[AdapterRef] | None) -> float:
    """Prompt tokens per second of the prefill steps (max_tokens 1: the requests end with their prefill)."""
    add_all(engine, [Request(r.prompt, 1, r.adapter) for r in requests], refs)
    start = time.perf_counter()
    while engine.has_unfinished():
        engine.step()
    return sum(len(r.prompt) for r in requests) / (time.perf_counter() - start)


def decode_tok_s(
    engine: LLMEngine, requests: list[Request], refs: list[AdapterRef] | None, steps: int
) -> float:
    """Generated tokens per second over `steps` decode steps with every request running (prefill untimed)."""
    add_all(engine, [Request(r.prompt, steps + 1, r.adapter) for r in requests], refs)
    elapsed, tokens = 0.0, 0
    while engine.has_unfinished():
        start = time.perf_counter()
        engine.step()
        if engine.counters.last_step_tokens == len(requests):  # a pure decode step of the whole batch
            elapsed += time.perf_counter() - start
            tokens += engine.counters.last_step_tokens
    assert tokens == steps * len(requests), (tokens, steps)
    return tokens / elapsed


def stream_gb_s(buffer: torch.Tensor) -> float:
    """The device's streaming read bandwidth now (all threads on a CPU), over `buffer`."""
    cuda = buffer.device.type == "cuda"
    if cuda:
        torch.cuda.synchronize(buffer.device)
    start = time.perf_counter()
    buffer.sum()
    if cuda:
        torch.cuda.synchronize(buffer.device)
    return buffer.nbytes / 1e9 / (time.perf_counter() - start)


def run_engine(
    engine: LLMEngine, requests: list[Request], refs: list[AdapterRef] | None, *, static_batch: int = 0
) -> float:
    """Generated tokens per second, end to end. static_batch > 0: admit a batch only when the previous one
    is done."""
    batches = (
        [requests]
        if not static_batch
        else [requests[i : i + static_batch] for i in range(0, len(requests), static_batch)]
    )
    start = time.perf_counter()
    for batch in batches:
        add_all(engine, batch, refs)
        while engine.has_unfinished():
            engine.step()
    return sum(r.max_tokens for r in requests) / (time.perf_counter() - start)


def contiguous_lm_head(model: PreTrainedModel) -> None:
    """HF generate slices hidden states for the last token; with frozen weights the lm_head then copies
    an expanded weight. Making its input contiguous avoids that (applied to every HF peer alike)."""
    head: torch.nn.Module = model.get_output_embeddings()  # type: ignore[no-untyped-call]  # unannotated in HF
    head.register_forward_pre_hook(lambda _m, args: (args[0].contiguous(),))


def run_hf(
    model: HFGenerator, requests: list[Request], adapter_names: list[str] | None, batch_size: int
) -> float:
    """Static batches, left-padded, each batch generating until its longest request is done."""
    start = time.perf_counter()
    for i in range(0, len(requests), batch_size):
        batch = requests[i : i + batch_size]
        width = max(len(r.prompt) for r in batch)
        device = model.device
        ids = torch.tensor([[0] * (width - len(r.prompt)) + r.prompt for r in batch], device=device)
        mask = torch.tensor(
            [[0] * (width - len(r.prompt)) + [1] * len(r.prompt) for r in batch], device=device
        )
        longest = max(r.max_tokens for r in batch)
        kwargs: dict[str, list[str]] = {}
        if adapter_names is not None:
            kwargs["adapter_names"] = [adapter_names[r.adapter] for r in batch]
        with torch.inference_mode():
            model.generate(
                input_ids=ids, attention_mask=mask, max_new_tokens=longest, min_new_tokens=longest,
                do_sample=False, pad_token_id=0, **kwargs,
            )  # fmt: skip
        if device.type == "cuda":
            torch.cuda.synchronize(device)
    return sum(r.max_tokens for r in requests) / (time.perf_counter() - start)


def activation_ms(engine: LLMEngine, refs: list[AdapterRef]) -> tuple[float, float]:
    """(CPU tier -> slot, disk -> slot) medians, timed on the engine's own loading path."""
    cpu, disk = [], []
    modules = engine.loaded.lora_modules
    pages = 1
    for ref in refs[:8]:
        engine.adapters.cpu.remove(ref.adapter_id)
        start = time.perf_counter()
        weights = engine.adapters._load(ref)
        pages = engine.adapters.pages_for(ref)
        load_adapter_into_slot(modules, 0, pages, weights)
        disk.append(time.perf_counter() - start)
        start = time.perf_counter()
        load_adapter_into_slot(modules, 0, pages, weights)
        cpu.append(time.perf_counter() - start)
    load_adapter_into_slot(modules, 0, pages, None)
    return statistics.median(cpu) * 1e3, statistics.median(disk) * 1e3


def resolve_dtype(name: str, device: str) -> str:
    """auto: bfloat16 where native (AVX512-BF16/AMX, or CUDA), else float32 (emulated bf16 is slower)."""
    if name != "auto":
        return name
    cuda = device == "cuda" or (device == "auto" and torch.cuda.is_available())
    return "bfloat16" if cuda or cpu_features().native_bf16 else "float32"


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help="fewer, shorter rounds (a few minutes)")
    parser.add_argument("--tiny", action="store_true", help="the tiny model, 2 adapters: checks it runs")
    parser.add_argument("--dtype", default="auto", choices=["auto", "bfloat16", "float32"])
    parser.add_argument("--adapters", type=int, default=16)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--preset", default="bench-150m")
    parser.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    parser.add_argument("--quantization", default="none", choices=["none", "nf4", "int8"])
    parser.add_argument("--rounds", type=int, default=None, help="overhead rounds per peer (default by mode)")
    parser.add_argument("--only-overhead", action="store_true", help="only the adapters-vs-base part")
    parser.add_argument(
        "--vs-page-rank",
        type=int,
        help="also a second engine whose adapter pages are this wide (e.g. the rank: one page an adapter), "
        "its decode and prefill with adapters interleaved with the rest (`page_rank_ratio`)",
    )
    parser.add_argument(
        "--base-vs-hf",
        action="store_true",
        help="with --only-overhead: also ours-base vs HF generate, end to end",
    )
    args = parser.parse_args()
    mode = "tiny" if args.tiny else "quick" if args.quick else "full"
    if args.tiny:
        args.preset, args.adapters, args.rank, args.dtype = "tiny", 2, 4, "float32"
    sizes = SIZES[mode]
    rounds = args.rounds or sizes.overhead_rounds
    dtype_name = resolve_dtype(args.dtype, args.device)
    dtype = getattr(torch, dtype_name)
    model_dir, store_root, adapter_dirs = ensure_bench_assets(
        preset=args.preset, num_adapters=args.adapters, rank=args.rank
    )
    names = list(adapter_dirs)
    batch = sizes.batch

    def bench_engine(page_rank: int | None = None) -> LLMEngine:
        built = LLMEngine(
            EngineConfig(
                model=model_dir,
                adapter_store=store_root,
                dtype=dtype_name,
                device=args.device,
                quantization=args.quantization,
                max_loras=args.adapters,
                max_lora_rank=args.rank,
                lora_page_rank=page_rank,
                max_num_seqs=batch,
                max_num_batched_tokens=2048,
                kv_cache_memory_mb=1024,
                enable_prefix_caching=False,
            )
        )
        latest = [built.adapters.store.latest(name) for name in names]
        for ref in latest:  # adapters resident in CPU memory, as on a warm replica
            future = built.adapters.prefetch(ref)
            if future is not None:
                future.result()
        run_engine(built, warm, latest)
        run_engine(built, warm, None)
        return built

    warm = make_requests(batch, num_adapters=args.adapters, prompt_range=(32, 64), out_range=(4, 4), seed=1)
    engine = bench_engine()
    refs = [engine.adapters.store.latest(name) for name in names]
    engine_device = engine.device

    # -- overhead: adapters vs base, same engine, same requests, in turns ---------------------------------
    prompts = make_requests(
        batch, num_adapters=args.adapters, prompt_range=sizes.prompt_range, out_range=(1, 1), seed=0
    )
    decode_prompts = make_requests(
        batch, num_adapters=args.adapters, prompt_range=(64, 64), out_range=(1, 1), seed=3
    )
    steps = sizes.decode_steps
    # Every decode step reads each resident adapter's A and B once (2 tokens per adapter: no reuse), so the
    # step cannot be faster than base + those bytes at the machine's streaming bandwidth: measured in turns.
    lora_bytes = sum(m.lora_a.nbytes + m.lora_b.nbytes for m in engine.loaded.lora_modules.values())
    # On a CPU the buffer is as large as the adapters (their bytes are what the ceiling streams); a GPU's
    # bandwidth only shows over a buffer far beyond its L2, hence 1 GiB there.
    floor_bytes = lora_bytes if engine_device.type == "cpu" else max(lora_bytes, 1 << 30)
    stream = torch.ones(max(1, floor_bytes // 4), dtype=torch.float32, device=engine_device)
    peers: dict[str, Callable[[], float]] = {
        "decode_lora": lambda: decode_tok_s(engine, decode_prompts, refs, steps),
        "decode_base": lambda: decode_tok_s(engine, decode_prompts, None, steps),
        "prefill_lora": lambda: prefill_tok_s(engine, prompts, refs),
        "prefill_base": lambda: prefill_tok_s(engine, prompts, None),
        "stream_gb_s": lambda: stream_gb_s(stream),
    }
    other = bench_engine(args.vs_page_rank) if args.vs_page_rank else None
    if other is not None:
        peers["decode_lora_vs_pages"] = lambda: decode_tok_s(other, decode_prompts, refs, steps)
        peers["prefill_lora_vs_pages"] = lambda: prefill_tok_s(other, prompts, refs)
    for peer in peers.values():  # first use of each shape (oneDNN primitives, KV blocks) stays out of it
        peer()
    overhead = Interleaved(peers, repeats=rounds).run()
    weight_bytes = engine.loaded.weights_bytes
    bandwidth = statistics.median(overhead.samples["stream_gb_s"]) * 1e9
    base_step_s = batch / overhead.median("decode_base")
    floor_base_s = weight_bytes / bandwidth
    ceilings = [
        1.0 / (1.0 + lora_bytes / (gb_s * 1e9) / (batch / base))  # base step time vs streaming the adapters
        for gb_s, base in zip(overhead.samples["stream_gb_s"], overhead.samples["decode_base"], strict=True)
    ]

    result: dict[str, Any] = {
        "lora_page_rank": engine.loaded.lora_page_rank,
        **(
            {
                "page_rank_ratio": {  # this engine's pages over --vs-page-rank's, with adapters
                    "vs_page_rank": args.vs_page_rank,
                    "decode": overhead.ratio("decode_lora", "decode_lora_vs_pages"),
                    "prefill": overhead.ratio("prefill_lora", "prefill_lora_vs_pages"),
                }
            }
            if other is not None
            else {}
        ),
        "decode_ratio_vs_base": overhead.ratio("decode_lora", "decode_base")["median"],
        "prefill_ratio_vs_base": overhead.ratio("prefill_lora", "prefill_base")["median"],
        "decode_ratio_spread": overhead.ratio("decode_lora", "decode_base"),
        "prefill_ratio_spread": overhead.ratio("prefill_lora", "prefill_base"),
        "overhead_tok_s": overhead.summary(),
        "decode_ratio_memory_ceiling": spread(ceilings),
        "lora_bytes_per_decode_step_mb": round(lora_bytes / 1e6, 1),
        "weights_mb": round(weight_bytes / 1e6, 1),
        "stream_gb_s": round(bandwidth / 1e9, 1),
        # Step time vs reading every weight (and adapter) byte once at that bandwidth; 1.0 is the floor.
        "decode_step_ms": {
            "base": round(base_step_s * 1e3, 3),
            "lora": round(batch / overhead.median("decode_lora") * 1e3, 3),
            "floor_base": round(floor_base_s * 1e3, 3),
            "floor_lora": round((weight_bytes + lora_bytes) / bandwidth * 1e3, 3),
        },
        "decode_floor_vs_step_base": round(floor_base_s / base_step_s, 3),
        "overhead_rounds": rounds,
        "lora_kernel": engine.loaded.lora_context.kernel_name,
    }
    if args.only_overhead:
        if args.base_vs_hf:
            result.update(ours_base_vs_hf(engine, model_dir, dtype, sizes, args.adapters, batch))
        engine.close()
        finish(result, args, dtype_name, batch, model_dir, engine_device, mode)
        return

    # -- continuous vs static batching, same engine and concurrency: most requests short, a few long ----
    skewed = make_requests(
        sizes.skew_requests, num_adapters=args.adapters, prompt_range=(56, 72), out_range=(8, 16), seed=2
    )
    skewed = [
        Request(r.prompt, sizes.skew_long if i % 8 == 0 else r.max_tokens, r.adapter)
        for i, r in enumerate(skewed)
    ]

    def at_eight(static: int) -> Callable[[], float]:
        def run() -> float:
            engine.scheduler.max_num_seqs = 8
            try:
                return run_engine(engine, skewed, refs, static_batch=static)
            finally:
                engine.scheduler.max_num_seqs = batch

        return run

    batching = Interleaved(
        {"continuous": at_eight(0), "static": at_eight(8)}, repeats=max(2, rounds // 2)
    ).run()
    act_cpu_ms, act_disk_ms = activation_ms(engine, refs)

    # -- ours vs HF PEFT and HF base, end to end, in turns ------------------------------------------------
    requests = make_requests(
        sizes.e2e_requests,
        num_adapters=args.adapters,
        prompt_range=(120, 136),
        out_range=sizes.e2e_out,
        seed=0,
    )
    hf_base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype, device_map={"": engine_device})
    hf_base.eval()  # type: ignore[no-untyped-call]  # PreTrainedModel.eval is unannotated in HF
    contiguous_lm_head(hf_base)
    peft_base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype, device_map={"": engine_device})
    contiguous_lm_head(peft_base)
    peft = PeftModel.from_pretrained(
        peft_base, adapter_dirs[names[0]], adapter_name=names[0], autocast_adapter_dtype=False
    )
    for name in names[1:]:
        peft.load_adapter(adapter_dirs[name], adapter_name=name, autocast_adapter_dtype=False)
    peft.eval()
    e2e = Interleaved(
        {
            "ours": lambda: run_engine(engine, requests, refs),
            "ours_base": lambda: run_engine(engine, requests, None),
            "peft": lambda: run_hf(peft, requests, names, batch),
            "hf_base": lambda: run_hf(hf_base, requests, None, batch),
        },
        repeats=sizes.e2e_rounds,
    ).run()
    engine.close()

    vs_peft = e2e.ratio("ours", "peft")
    base_vs_hf = e2e.ratio("ours_base", "hf_base")
    result.update(
        {
            "ours_tok_s": round(e2e.median("ours"), 1),
            "ours_base_tok_s": round(e2e.median("ours_base"), 1),
            "peft_tok_s": round(e2e.median("peft"), 1),
            "hf_base_tok_s": round(e2e.median("hf_base"), 1),
            "ratio_vs_peft": vs_peft["median"],
            "ratio_vs_peft_spread": vs_peft,
            "ratio_base_vs_hf_base": base_vs_hf["median"],
            "ratio_base_vs_hf_base_spread": base_vs_hf,
            "ratio_vs_base_e2e": e2e.ratio("ours", "ours_base")["median"],
            "ratio_peft_vs_hf_base": e2e.ratio("peft", "hf_base")["median"],
            "e2e_tok_s": e2e.summary(),
            "continuous_tok_s": round(batching.median("continuous"), 1),  # max 8 in flight for both
            "static_tok_s": round(batching.median("static"), 1),
            "ratio_continuous_vs_static": batching.ratio("continuous", "static")["median"],
            "ratio_continuous_vs_static_spread": batching.ratio("continuous", "static"),
            "activation_cpu_ms": round(act_cpu_ms, 2),
            "activation_disk_ms": round(act_disk_ms, 2),
            "requests": len(requests),
        }
    )
    finish(result, args, dtype_name, batch, model_dir, engine_device, mode)


def ours_base_vs_hf(
    engine: LLMEngine, model_dir: Path, dtype: torch.dtype, sizes: Sizes, adapters: int, batch: int
) -> dict[str, Any]:
    """Ours on the base model vs HF `generate`, same requests end to end, in turns (no PEFT peer)."""
    requests = make_requests(
        sizes.e2e_requests, num_adapters=adapters, prompt_range=(120, 136), out_range=sizes.e2e_out, seed=0
    )
    hf_base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype, device_map={"": engine.device})
    hf_base.eval()  # type: ignore[no-untyped-call]  # PreTrainedModel.eval is unannotated in HF
    contiguous_lm_head(hf_base)
    e2e = Interleaved(
        {
            "ours_base": lambda: run_engine(engine, requests, None),
            "hf_base": lambda: run_hf(hf_base, requests, None, batch),
        },
        repeats=sizes.e2e_rounds,
    ).run()
    ratio = e2e.ratio("ours_base", "hf_base")
    return {
        "ours_base_tok_s": round(e2e.median("ours_base"), 1),
        "hf_base_tok_s": round(e2e.median("hf_base"), 1),
        "ratio_base_vs_hf_base": ratio["median"],
        "ratio_base_vs_hf_base_spread": ratio,
    }


def finish(
    result: dict[str, Any],
    args: argparse.Namespace,
    dtype_name: str,
    batch: int,
    model_dir: Path,
    device: torch.device,
    mode: str,
) -> None:
    result.update(
        {
            # What each ratio could reach at best: adapters cost nothing (1.0); ours-vs-PEFT is bounded by
            # how our base model compares with HF's (ratio_base_vs_hf_base) times PEFT's own overhead.
            "ceilings": {
                "decode_ratio_vs_base": "decode_ratio_memory_ceiling (every adapter's A, B read once a step)",
                "prefill_ratio_vs_base": 1.0,
                "ratio_vs_peft": "ratio_base_vs_hf_base / ratio_peft_vs_hf_base",
            },
            "goals": {"decode_ratio_vs_base": 0.95, "prefill_ratio_vs_base": 0.9},
            "adapters": args.adapters,
            "rank": args.rank,
            "dtype": dtype_name,
            "batch": batch,
            "mode": mode,
            "quantization": args.quantization,
            "model": Path(model_dir).name,
            "device": str(device),
            "machine": machine(dtype_name),
        }
    )
    print(json.dumps(result))


if __name__ == "__main__":
    main()
