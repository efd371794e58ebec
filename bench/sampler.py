"""Times Sampler.sample for one engine step: N=64 rows, V=32000, a third each greedy, seeded top-p, penalised.

Run: python -m bench.sampler
"""

import argparse
import json
import random
import statistics
import time

import torch

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
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--tiny", action="store_true", help="a few calls: checks the bench runs")
    args = parser.parse_args()
    warmup, calls = (1, 3) if args.tiny else (WARMUP, CALLS)
    sampler = Sampler(V, torch.device("cpu"), seed=0)
    batch = rows()
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, N={N} V={V}")
    result: dict[str, object] = {"rows": N, "vocab": V, "calls": calls}
    for kind in ("peaked", "flat"):
        x = logits(kind)
        for _ in range(warmup):
            sampler.sample(x, batch)
        times = []
        for _ in range(calls):
            start = time.perf_counter()
            sampler.sample(x, batch)
            times.append((time.perf_counter() - start) * 1e6)
        # Median and best: on a shared machine the best is the cleaner measure of the code.
        print(f"{kind:>6} logits: median {statistics.median(times):8.0f} us/call, best {min(times):8.0f}")
        result[f"{kind}_median_us"] = round(statistics.median(times))
    print(json.dumps(result))


if __name__ == "__main__":
    main()
