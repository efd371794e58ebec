"""Times Sampler.sample for one engine step: N=64 rows, V=32000, a third each greedy, seeded top-p, penalised.

Two kinds of logits (LM-like peaked, and flat) are timed call by call in turns (peaked flat, flat peaked,
...), so a neighbour's burst on a shared VM hits both; per kind the median and spread over the calls.
Run: python -m bench.sampler [--calls 20]; the last line is one JSON object.
"""

import argparse
import json
import random
import time
from functools import partial

import torch

from bench.measure import Interleaved, machine
from deployments.engine.sampler import Sampler, SamplingRow
from deployments.engine.sampling_params import SamplingParams

N, V, V_MODEL = 64, 32000, 32064  # the model's logits carry vocab padding
PROMPT, OUTPUT = 512, 128
WARMUP, CALLS = 3, 20


def rows() -> list[SamplingRow]:
    rnd = random.Random(0)
    out = []
    for i in range(N):
        prompt = [rnd.randrange(V) for _ in range(PROMPT)]
        output = [rnd.randrange(V) for _ in range(OUTPUT)]
        if i % 3 == 0:
            params, g = SamplingParams(temperature=0.0), None
        elif i % 3 == 1:
            params = SamplingParams(temperature=0.8, top_p=0.9, seed=i)
            g = torch.Generator().manual_seed(i)
        else:
            params = SamplingParams(repetition_penalty=1.1, frequency_penalty=0.2, presence_penalty=0.1)
            g = None
        out.append(SamplingRow(params=params, generator=g, prompt_ids=prompt, output_ids=output))
    return out


def logits(kind: str) -> torch.Tensor:
    torch.manual_seed(0)
    x = torch.randn(N, V_MODEL) * 2.0  # [N, V_model]
    if kind == "peaked":
        # LM-like: a few dozen plausible tokens well above the bulk.
        top = torch.randint(0, V, (N, 32))  # [N, 32]
        x.scatter_(1, top, 8.0 + 4.0 * torch.rand(N, 32))
    return x


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--calls", type=int, default=CALLS, help="timed calls per kind")
    parser.add_argument("--tiny", action="store_true", help="a few calls: checks the bench runs")
    args = parser.parse_args()
    warmup, calls = (1, 3) if args.tiny else (WARMUP, args.calls)
    sampler = Sampler(V, torch.device("cpu"), seed=0)
    batch = rows()
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, N={N} V={V}")
    inputs = {kind: logits(kind) for kind in ("peaked", "flat")}
    for x in inputs.values():
        for _ in range(warmup):
            sampler.sample(x, batch)

    def timed(x: torch.Tensor) -> float:
        start = time.perf_counter()
        sampler.sample(x, batch)
        return (time.perf_counter() - start) * 1e6

    runs = Interleaved({kind: partial(timed, x) for kind, x in inputs.items()}, repeats=calls).run()
    result: dict[str, object] = {"rows": N, "vocab": V, "calls": calls}
    for kind, us in runs.summary().items():
        print(f"{kind:>6} logits: median {us['median']:8.0f} us/call, {us['min']:.0f}..{us['max']:.0f}")
        result[f"{kind}_median_us"] = round(us["median"])
        result[f"{kind}_us"] = us
    result["flat_vs_peaked"] = runs.ratio("flat", "peaked")  # per call pair: what a flat distribution costs
    result["machine"] = machine()
    print(json.dumps(result))


if __name__ == "__main__":
    main()
