"""The one prepared GPU run: CUDA correctness first, then the CUDA benches, each result written as it lands.

Run on a lent GPU machine (README "On a CUDA GPU" says how to carry the wheels), from the repository root:
    python -m bench.gpu_check --out DIR [--quick]
Steps, each bounded in time and recorded even when it fails (DIR/gpu_check.json, rewritten after each):
  env          - torch, CUDA, Triton, the GPU;
  kernels      - tests/engine/test_gpu_kernels.py on the GPU (each Triton kernel against its torch reference);
  correctness  - tiny random-init models built here (Llama, Qwen2, Mistral, Phi-3's fused linears, Qwen3,
                 Gemma 3), fp32: a mixed batch of 5 adapters and the base through our CUDA engine
                 (graph-captured decode) equals HF PEFT with each adapter alone, token for token, logprobs
                 within 1e-3; the same engine with graphs off gives the same tokens; bf16 agreement with fp32
                 PEFT is reported (not asserted: bf16 rounds differently);
  host         - bench.host_overhead --device cuda on the tiny and narrow-22 presets;
  lora_bf16    - bench.multi_lora --device cuda on bench-1b (TinyLlama's shape), adapters vs base and the step
                 against its weight-read floor, with ours-base vs HF generate;
  lora_nf4     - the same in nf4 (bitsandbytes);
  families     - bench.family_step --device cuda at bench-1b's shape, bf16: Qwen3- and Gemma-3-shaped decode
                 steps (16 adapters, batch 32, graph-captured) against Llama's shape and against HF's
                 forward (the fallback a family off our forward would get);
  awq          - bench.awq_step: bench-1b exported to AWQ here, through our int4 linear (no gptqmodel on the
                 GPU image): the linear against the dequantized reference, each side (fused GEMM,
                 dequantize + matmul) at 1-256 rows with its time, and the decode step vs bf16 at batch 32;
  kernel_bench - bench.gpu_kernels (each kernel against its torch reference, bench-1b shapes).
`--tiny` runs every step on the CPU, smallest, so the script cannot rot without a GPU.
The last line is one JSON object.
"""

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

# In order of what a short loan must not miss: correctness, then the headline benches.
STEPS = (
    "env",
    "correctness",
    "lora_bf16",
    "families",
    "lora_nf4",
    "awq",
    "kernel_bench",
    "host",
    "kernels",
)


def env_info() -> dict[str, Any]:
    import torch

    info: dict[str, Any] = {
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "python": sys.version.split()[0],
    }
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        info.update(
            gpu=props.name, sms=props.multi_processor_count, memory_gib=round(props.total_memory / 2**30, 1)
        )
    for name in ("triton", "transformers", "peft", "bitsandbytes"):
        try:
            info[name] = __import__(name).__version__
        except Exception as error:  # missing is a finding, not a failure of this step
            info[name] = f"missing: {type(error).__name__}"
    return info


def correctness(device: str, *, tiny: bool = False, with_bf16: bool = False) -> dict[str, Any]:
    """Our engine on `device` against HF PEFT (CPU, fp32), per architecture; graphs vs eager."""
    import tempfile

    import torch

    from adapters.demo_adapters import build_demo_adapters
    from adapters.store import AdapterStore
    from app.modelprep.demo_model import Arch, build_model
    from deployments.engine.llm_engine import LLMEngine
    from tests.engine.reference import PeftReference
    from tests.engine.test_reference_equality import run_engine, scenario_config, script

    results: dict[str, Any] = {}
    root = Path(tempfile.mkdtemp(prefix="gpu-check-"))
    arrivals = script()  # 5 adapters and the base, arriving at different steps, chunked prefill, preemption
    if tiny:
        arrivals = arrivals[:3]
    archs: tuple[Arch, ...] = (
        ("llama",) if tiny else ("llama", "qwen2", "mistral", "phi3", "qwen3", "gemma3_text")
    )
    for arch in archs:
        model_dir = build_model(root / arch / "model", arch=arch, preset="tiny")
        adapter_dirs = build_demo_adapters(model_dir, root / arch / "adapters")
        store_root = root / arch / "store"
        store = AdapterStore(store_root)
        for name, path in adapter_dirs.items():
            store.put_dir(name, path)
        reference = PeftReference(model_dir, adapter_dirs)
        runs: dict[str, dict[str, tuple[list[int], list[float]]]] = {}
        for label, dtype, graphs, page_rank in (
            ("graphs", "float32", True, None),
            ("eager", "float32", False, None),
            ("bf16", "bfloat16", True, None),
            ("pages", "float32", True, 8),  # rank-16 adapters as runs of two pages, under graphs
        ):
            pages = {} if page_rank is None else {"lora_page_rank": page_rank}
            config = scenario_config(
                model_dir, store_root, dtype=dtype, device=device, cuda_graphs=graphs, **pages
            )
            engine = LLMEngine(config)
            outputs = run_engine(engine, arrivals, logprobs=0)  # the chosen token's logprob, held to PEFT's
            runs[label] = {
                rid: (
                    [t for o in outs for t in o.token_ids],
                    [lp.logprob for o in outs for lp in o.logprobs or ()],
                )
                for rid, outs in outputs.items()
            }
            engine.close()
        mismatched: list[str] = []
        agree_bf16 = total = 0
        worst = 0.0
        for a in arrivals:
            want = reference.greedy(a.prompt, a.adapter, a.max_tokens)
            got, logprobs = runs["graphs"][a.request_id]
            if got != want:
                mismatched.append(a.request_id)
            if "bf16" in runs:
                agree_bf16 += sum(x == y for x, y in zip(runs["bf16"][a.request_id][0], want, strict=False))
            total += len(want)
            # PEFT's logprobs of the same tokens, teacher-forced in one forward.
            ids = [*a.prompt, *got[:-1]]
            lp = torch.log_softmax(reference.all_logits(ids, a.adapter), dim=-1)[len(a.prompt) - 1 :]
            peft = lp.gather(1, torch.tensor(got)[:, None]).squeeze(1)
            worst = max(worst, float((peft - torch.tensor(logprobs)).abs().max()))
        results[arch] = {
            "greedy_equal_peft": not mismatched,
            "mismatched": mismatched,
            "max_logprob_diff": worst,
            "graphs_equal_eager": {r: t for r, (t, _) in runs["graphs"].items()}
            == {r: t for r, (t, _) in runs["eager"].items()},
            "bf16_token_agreement": round(agree_bf16 / max(1, total), 3) if "bf16" in runs else None,
            "pages_equal_one_page": {r: t for r, (t, _) in runs["pages"].items()}
            == {r: t for r, (t, _) in runs["graphs"].items()},
        }
    results["ok"] = all(
        r["greedy_equal_peft"]
        and r["graphs_equal_eager"]
        and r["pages_equal_one_page"]
        and r["max_logprob_diff"] < 1e-3
        for r in results.values()
    )
    return results


DEADLINE = [float("inf")]  # monotonic time by which every step must have ended (main sets it)


def run_module(args: list[str], timeout: float) -> dict[str, Any]:
    """`python -m ...` with a time bound: its last JSON line, or why there is none."""
    timeout = max(10.0, min(timeout, DEADLINE[0] - time.monotonic()))
    start = time.perf_counter()
    try:
        done = subprocess.run(
            [sys.executable, "-m", *args],
            capture_output=True,
            text=True,
            timeout=timeout,
            env=os.environ.copy(),
        )
    except subprocess.TimeoutExpired as expired:
        out = expired.stdout or b""
        text = out.decode(errors="replace") if isinstance(out, bytes) else out
        return {"error": f"timed out after {timeout:.0f} s", "tail": text[-1500:]}
    seconds = round(time.perf_counter() - start, 1)
    lines = [line for line in done.stdout.strip().splitlines() if line.startswith("{")]
    if done.returncode != 0 or not lines:
        return {
            "error": f"exit {done.returncode}",
            "seconds": seconds,
            "tail": (done.stdout + done.stderr)[-3000:],
        }
    result: dict[str, Any] = json.loads(lines[-1])
    result["seconds"] = seconds
    return result


def run_pytest(paths: list[str], timeout: float) -> dict[str, Any]:
    timeout = max(10.0, min(timeout, DEADLINE[0] - time.monotonic()))
    start = time.perf_counter()
    try:
        done = subprocess.run(
            # -o addopts=: not the suite's xdist options (the GPU image has no xdist)
            [
                sys.executable,
                "-m",
                "pytest",
                "-q",
                "-p",
                "no:cacheprovider",
                "--noconftest",
                "-o",
                "addopts=",
                *paths,
            ],
            capture_output=True,
            text=True,
            timeout=timeout,
        )
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {timeout:.0f} s"}
    lines = done.stdout.strip().splitlines()
    return {
        "exit": done.returncode,
        "summary": lines[-1] if lines else "",
        "failures": [line for line in lines if line.startswith(("FAILED", "ERROR"))][:20],
        "seconds": round(time.perf_counter() - start, 1),
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", type=Path, default=Path("var/gpu_check"))
    parser.add_argument("--tiny", action="store_true", help="every step on the CPU, smallest: checks it runs")
    parser.add_argument("--only", nargs="*", choices=STEPS, help="run only these steps")
    parser.add_argument("--budget-s", type=float, default=420.0, help="skip the steps that would not fit")
    parser.add_argument("--no-hf", action="store_true", help="skip ours-base vs HF generate (lora_bf16)")
    parser.add_argument("--kernels", default="", help="kernel_bench: only these kernel groups (prefixes)")
    parser.add_argument("--step", choices=["correctness"], help=argparse.SUPPRESS)  # a child process's step
    args = parser.parse_args()
    device = "cpu" if args.tiny else "cuda"
    if args.step == "correctness":
        print(json.dumps(correctness(device, tiny=args.tiny)))
        return
    args.out.mkdir(parents=True, exist_ok=True)
    results: dict[str, Any] = {"started": time.strftime("%Y-%m-%d %H:%M:%S")}
    dev = ["--device", device]
    tiny = ["--tiny"] if args.tiny else []
    plan: dict[str, Any] = {
        "env": lambda: env_info(),
        "kernels": lambda: run_pytest(["tests/engine/test_gpu_kernels.py"], 120),
        "correctness": lambda: run_module(["bench.gpu_check", "--step", "correctness", *tiny], 240),
        "host": lambda: {
            preset: run_module(["bench.host_overhead", *dev, "--preset", preset, "--rounds", "3", *tiny], 120)
            for preset in (("tiny",) if args.tiny else ("tiny", "narrow-22"))
        },
        "lora_bf16": lambda: run_module(
            [
                "bench.multi_lora",
                *dev,
                *(tiny or ["--quick", "--preset", "bench-1b", "--rounds", "3"]),
                "--only-overhead",
                "--base-vs-hf",
            ],
            300,
        ),
        "families": lambda: run_module(
            [
                "bench.family_step",
                *(tiny or ["--device", "cuda", "--preset", "bench-1b", "--rounds", "3", "--steps", "10"]),
                "--archs",
                "llama",
                "qwen3",
                "gemma3_text",
            ],
            240,
        ),
        "lora_nf4": lambda: run_module(
            [
                "bench.multi_lora",
                *dev,
                *(tiny or ["--quick", "--preset", "bench-1b", "--rounds", "3"]),
                "--only-overhead",
                "--quantization",
                "nf4",
            ],
            240,
        ),
        "awq": lambda: run_module(["bench.awq_step", *(tiny or ["--device", "cuda", "--rounds", "3"])], 180),
        "kernel_bench": lambda: run_module(
            ["bench.gpu_kernels", *tiny, *([] if not args.kernels else ["--only", args.kernels])], 120
        ),
    }
    deadline = DEADLINE[0] = time.monotonic() + args.budget_s
    # The tiny mode checks this script's own path: the benches it calls run their tiny modes in the suite.
    for name in args.only or (("env", "correctness", "host", "families") if args.tiny else STEPS):
        start = time.perf_counter()
        if time.monotonic() > deadline - 20:
            results[name] = {"error": "skipped: the time budget ran out"}
            continue
        try:
            results[name] = plan[name]()
        except Exception as error:  # one broken step must not cost the others their turn on the GPU
            results[name] = {"error": f"{type(error).__name__}: {error}"}
        print(f"[gpu_check] {name}: {time.perf_counter() - start:.1f} s", file=sys.stderr, flush=True)
        (args.out / "gpu_check.json").write_text(json.dumps(results, indent=1))
    from bench.measure import machine

    results["machine"] = machine("bfloat16" if not args.tiny else "float32")
    (args.out / "gpu_check.json").write_text(json.dumps(results, indent=1))
    print(json.dumps(results))


if __name__ == "__main__":
    main()
