"""A multi-tenant serving workload: many adapters with Zipf popularity, Poisson arrivals, skewed lengths.

The same trace drives the engine-level bench (bench.multi_tenant) and the HTTP one, so their figures are
about one workload. Lengths are log-normal (most requests short, a long tail), clipped to a range.
"""

import math
import random
from dataclasses import dataclass


@dataclass(frozen=True)
class Arrival:
    at_s: float  # seconds after the start of the run
    adapter: int  # index into the adapter list; 0 is the most popular
    prompt_len: int
    max_tokens: int
    seed: int  # of this request's prompt tokens


def zipf_weights(n: int, s: float) -> list[float]:
    raw = [1.0 / (k + 1) ** s for k in range(n)]
    total = sum(raw)
    return [w / total for w in raw]


def lognormal_length(rnd: random.Random, median: int, sigma: float, low: int, high: int) -> int:
    return max(low, min(high, round(median * math.exp(rnd.gauss(0.0, sigma)))))


def adapter_ranks(num_adapters: int, ranks: tuple[int, ...], seed: int = 0) -> list[int]:
    """One rank per adapter, drawn uniformly from `ranks` (fixed by the seed)."""
    rnd = random.Random(seed)
    return [rnd.choice(ranks) for _ in range(num_adapters)]


def arrivals(
    *,
    num_requests: int,
    num_adapters: int,
    rate_per_s: float,
    zipf_s: float = 1.1,
    prompt_median: int = 96,
    prompt_range: tuple[int, int] = (16, 512),
    output_median: int = 32,
    output_range: tuple[int, int] = (4, 256),
    sigma: float = 0.8,
    seed: int = 0,
) -> list[Arrival]:
    """`num_requests` Poisson arrivals at `rate_per_s`; adapter indices Zipf(s), shuffled so popularity is
    not tied to the index order of the store."""
    rnd = random.Random(seed)
    weights = zipf_weights(num_adapters, zipf_s)
    order = list(range(num_adapters))
    rnd.shuffle(order)  # popularity rank -> adapter index
    at = 0.0
    out: list[Arrival] = []
    for i in range(num_requests):
        at += rnd.expovariate(rate_per_s)
        rank = rnd.choices(range(num_adapters), weights)[0]
        out.append(
            Arrival(
                at_s=at,
                adapter=order[rank],
                prompt_len=lognormal_length(rnd, prompt_median, sigma, *prompt_range),
                max_tokens=lognormal_length(rnd, output_median, sigma, *output_range),
                seed=seed * 1_000_003 + i,
            )
        )
    return out


def prompt_tokens(arrival: Arrival, vocab: int) -> list[int]:
    """The request's prompt: token ids drawn from its own seed (no accidental shared prefixes)."""
    rnd = random.Random(arrival.seed)
    return [rnd.randrange(5, vocab) for _ in range(arrival.prompt_len)]
