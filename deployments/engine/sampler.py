"""Batched token sampling for one engine step.

Order (as vLLM and HF): penalties -> greedy argmax | temperature -> top-k -> top-p -> min-p -> draw.
Every stage is vectorised over the rows that use it and skipped when none does; only the per-row
random draw (one uniform per row) touches a request's own generator.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from deployments.engine.sampling_params import SamplingParams

# Inverse-CDF block width. A float32 cumsum over a whole row stops growing once it nears 1, which
# silently drops the tail mass; float32 sums of 256 values, then float64 cumsums, keep it.
_BLOCK = 256
# Top-p bands: quarter-octaves of probability below the top token, down to 2^-40 of it.
_BANDS = 160
_BANDS_PER_NAT = 4.0 / math.log(2.0)
# Temperatures below this sample as greedy (vLLM's rule): logits / 1e-40 overflow float32.
_MIN_TEMPERATURE = 1e-5


@dataclass(slots=True)
class SamplingRow:
    """One request's view of a step: its parameters, its RNG and the token history the penalties read."""

    params: SamplingParams
    generator: torch.Generator | None  # per-request when params.seed is set; None: the sampler's own
    prompt_ids: Sequence[int]  # for the repetition penalty
    output_ids: Sequence[int]  # for all three penalties


class Sampler:
    """Turns one step's logits into one token per row.

    Seeded rows are reproducible: a row's token depends only on its logits, its history and its own
    generator (one float64 uniform drawn per sampled step), never on the other rows in the batch.
    Greedy rows draw nothing, so they leave their generator untouched.
    """

    def __init__(self, vocab_size: int, device: torch.device, seed: int | None = None) -> None:
        if vocab_size < 1:
            raise ValueError(f"vocab_size must be >= 1, got {vocab_size}")
        self.vocab_size = vocab_size
        self.device = torch.device(device)
        self._generator = torch.Generator(device=self.device)
        if seed is None:
            self._generator.seed()
        else:
            self._generator.manual_seed(seed)

    def sample(self, logits: torch.Tensor, rows: Sequence[SamplingRow]) -> list[int]:
        """logits: [N, V_model] for the N rows, in order. Returns N token ids, all < vocab_size."""
        tokens: list[int] = self.sample_on_device(logits, rows).tolist()
        return tokens

    def sample_on_device(self, logits: torch.Tensor, rows: Sequence[SamplingRow]) -> torch.Tensor:
        """`sample` without reading the tokens back: [N] int64 on the logits' device, so the caller can
        fetch them together with anything else it needs (one device->host sync per step)."""
        with torch.inference_mode():
            x = self._float_logits(logits, len(rows))  # [N, V]
            tokens = torch.zeros(len(rows), dtype=torch.int64, device=x.device)
            greedy = [i for i, row in enumerate(rows) if _greedy(row.params)]
            if greedy:
                xg = _penalised(x, logits, [rows[i] for i in greedy], greedy)  # [G, V]
                # max(dim).indices, not argmax: same first-max tie rule, several times faster on CPU.
                _put(tokens, greedy, xg.max(dim=-1).indices)
            sampled = [i for i, row in enumerate(rows) if not _greedy(row.params)]
            if sampled:
                picked = [rows[i] for i in sampled]
                xs = _penalised(x, logits, picked, sampled)  # [S, V]
                probs = _filtered_probs(xs, [r.params for r in picked], owned=_owned(xs, logits))
                _put(tokens, sampled, _draw(probs, self._uniforms(picked)))
            return tokens

    def probabilities(self, logits: torch.Tensor, rows: Sequence[SamplingRow]) -> torch.Tensor:
        """The distribution each row's token is drawn from: [N, V] float32, one-hot for greedy rows.

        Draws nothing; for tests and logprobs.
        """
        with torch.inference_mode():
            x = self._float_logits(logits, len(rows))  # [N, V]
            out = torch.zeros_like(x)  # [N, V]
            greedy = [i for i, row in enumerate(rows) if _greedy(row.params)]
            if greedy:
                xg = _penalised(x, logits, [rows[i] for i in greedy], greedy)  # [G, V]
                out[torch.tensor(greedy, device=x.device), xg.max(dim=-1).indices] = 1.0
            sampled = [i for i, row in enumerate(rows) if not _greedy(row.params)]
            if sampled:
                picked = [rows[i] for i in sampled]
                xs = _penalised(x, logits, picked, sampled)  # [S, V]
                probs = _filtered_probs(xs, [r.params for r in picked], owned=_owned(xs, logits))
                out[torch.tensor(sampled, device=x.device)] = probs / probs.sum(dim=-1, keepdim=True)
            return out

    def _float_logits(self, logits: torch.Tensor, n: int) -> torch.Tensor:
        """[N, V] float32 logits without the vocab padding; aliases `logits` when no conversion is needed."""
        if logits.dim() != 2 or logits.shape[0] != n:
            raise ValueError(f"logits must be [{n}, V], got {list(logits.shape)}")
        v = min(self.vocab_size, logits.shape[1])
        # Columns past the tokenizer's vocab are the model's padding: slicing them off is the -inf
        # mask at no cost, and every id returned is < vocab_size.
        return logits[:, :v].to(device=self.device, dtype=torch.float32)

    def _uniforms(self, rows: Sequence[SamplingRow]) -> torch.Tensor:
        """One float64 uniform in [0, 1) per row: [S]. Seeded rows draw from their own generator."""
        dev = self.device
        u = torch.empty(len(rows), dtype=torch.float64, device=dev)  # [S]
        shared = [j for j, row in enumerate(rows) if row.generator is None]
        if shared:
            draws = torch.rand(len(shared), generator=self._generator, dtype=torch.float64, device=dev)
            u[torch.tensor(shared, device=dev)] = draws
        for j, row in enumerate(rows):
            if row.generator is not None:
                g = row.generator
                u[j] = torch.rand(1, generator=g, dtype=torch.float64, device=g.device).to(dev)[0]
        return u


def _penalised(
    x: torch.Tensor, source: torch.Tensor, rows: Sequence[SamplingRow], idx: Sequence[int]
) -> torch.Tensor:
    """Rows idx of x ([R, V]) with rows' penalties applied; never writes `source`, the caller's logits.

    Sparse, as HF does it: only (row, token) pairs present in a history change, so the cost is
    O(history tokens) rather than O(R * V) dense count tensors.
    """
    xr = _take(x, idx)  # [R, V]
    pen = [j for j, row in enumerate(rows) if row.params.uses_penalties]
    if not pen:
        return xr
    if not _owned(xr, source):
        xr = xr.clone()
    v, dev = xr.shape[1], xr.device
    params = [rows[j].params for j in pen]
    # Rows without a repetition penalty skip their prompt, the longest list to convert.
    prompts = [
        rows[j].prompt_ids if p.repetition_penalty != 1.0 else () for j, p in zip(pen, params, strict=True)
    ]
    outputs = [rows[j].output_ids for j in pen]
    seq, tok = _flatten([*prompts, *outputs], dev)  # [T], [T]: sequence index, prompts first
    from_output = seq >= len(pen)  # [T]
    known = tok < v  # [T]; ids past the vocab cannot be emitted: nothing to penalise
    pairs, inverse = torch.unique(((seq % len(pen)) * v + tok)[known], return_inverse=True)  # [U], [T']
    n_out = torch.zeros(len(pairs), device=dev).index_add_(0, inverse, from_output[known].to(torch.float32))
    r = pairs // v  # [U]: index into pen
    at = (torch.tensor(pen, device=dev)[r], pairs % v)  # where each pair lives in xr
    vals = xr[at]  # [U]
    # vLLM's order; a neutral value leaves its row's logits bit-identical.
    if any(p.repetition_penalty != 1.0 for p in params):
        rp = torch.tensor([p.repetition_penalty for p in params], device=dev)[r]  # [U]
        vals = torch.where(vals < 0, vals * rp, vals / rp)
    if any(p.frequency_penalty != 0.0 for p in params):
        vals = vals - torch.tensor([p.frequency_penalty for p in params], device=dev)[r] * n_out
    if any(p.presence_penalty != 0.0 for p in params):
        vals = vals - torch.tensor([p.presence_penalty for p in params], device=dev)[r] * (n_out > 0)
    xr[at] = vals
    return xr


def _filtered_probs(xs: torch.Tensor, params: Sequence[SamplingParams], *, owned: bool) -> torch.Tensor:
    """xs: [S, V] penalised logits of non-greedy rows. Returns [S, V] unnormalised probabilities,
    exactly 0 where temperature/top-k/top-p/min-p filtered a token."""
    v = xs.shape[1]
    dev = xs.device
    k_rows = [j for j, p in enumerate(params) if 0 < p.top_k < v]
    p_rows = [j for j, p in enumerate(params) if p.top_p < 1.0]
    temps = [p.temperature for p in params]
    if any(t != 1.0 for t in temps):
        xs = xs.div_(_column(temps, dev)) if owned else xs / _column(temps, dev)
    elif not owned and (k_rows or p_rows):
        xs = xs.clone()  # top-k and top-p write in place

    if k_rows:
        sub = _take(xs, k_rows)  # [Sk, V]
        top_ks = [params[j].top_k for j in k_rows]
        ks = torch.tensor(top_ks, device=dev)  # [Sk]
        kth = sub.topk(max(top_ks), dim=-1).values.gather(1, (ks - 1)[:, None])  # [Sk, 1]
        # A threshold rather than the top-k indices: ties with the k-th value stay, as in HF and vLLM.
        _put(xs, k_rows, sub.masked_fill_(sub < kth, float("-inf")))

    if p_rows:
        sub = _take(xs, p_rows)  # [Sp, V]
        _put(xs, p_rows, _top_p(sub, [params[j].top_p for j in p_rows]))

    probs = xs.softmax(dim=-1)  # [S, V]
    m_rows = [j for j, p in enumerate(params) if p.min_p > 0.0]
    if m_rows:
        sub = _take(probs, m_rows)  # [Sm, V]
        top = sub.amax(dim=-1, keepdim=True)  # [Sm, 1]
        floor = _column([params[j].min_p for j in m_rows], dev) * top  # [Sm, 1]
        # Zeroing is enough: the draw renormalises, so no second softmax.
        _put(probs, m_rows, sub.masked_fill_(sub < floor, 0.0))
    return probs


def _top_p(sub: torch.Tensor, top_p: Sequence[float]) -> torch.Tensor:
    """Nucleus filter on [Sp, V] logits, in place: keep the smallest top set with mass >= top_p.

    A token stays iff the mass ranked strictly above it is < top_p: HF's `cumsum_asc <= 1 - top_p`
    removal counted from the top, so the top token always stays. Instead of sorting the whole vocab,
    tokens are binned into bands by how far their probability is below the top token's; the band
    where the cumulative mass crosses top_p is the only one whose tokens need ordering.
    """
    tp = torch.tensor(top_p, dtype=torch.float64, device=sub.device)[:, None]  # [Sp, 1]
    probs = sub.softmax(dim=-1)  # [Sp, V]
    # Band = quarter-octaves below the top token, from the logit gap (no log): monotone in the
    # logit, so bands are rank ranges. Filtered (-inf) tokens land in the last band.
    gap = (sub.amax(dim=-1, keepdim=True) - sub) * _BANDS_PER_NAT  # [Sp, V]
    band = gap.clamp_(max=_BANDS - 1).long()  # [Sp, V]
    mass = torch.zeros(len(top_p), _BANDS, device=sub.device).scatter_add_(1, band, probs)  # [Sp, NB]
    cum = mass.double().cumsum(dim=-1)  # [Sp, NB]
    cut = torch.searchsorted(cum, tp).clamp_(max=_BANDS - 1)  # [Sp, 1]: first band reaching top_p
    above_cut = torch.where(cut > 0, cum.gather(1, (cut - 1).clamp(min=0)), 0.0)  # [Sp, 1]
    in_cut = band == cut  # [Sp, V]
    k = int(torch.count_nonzero(in_cut, dim=-1).max())
    # Order the cut band by logit, as HF's sort does; rows with fewer members pad with outsiders.
    cand = torch.where(in_cut, sub, float("-inf")).topk(k, dim=-1).indices  # [Sp, K]
    member = in_cut.gather(1, cand)  # [Sp, K]
    cand_p = probs.gather(1, cand).double().masked_fill_(~member, 0.0)  # [Sp, K]
    cum_in = cand_p.cumsum(dim=-1)  # [Sp, K]
    above = above_cut + (cum_in - cand_p)  # [Sp, K]: mass ranked strictly above each candidate
    drop = band > cut  # [Sp, V]
    drop.scatter_(1, cand, torch.where(member, above >= tp, drop.gather(1, cand)))
    return sub.masked_fill_(drop, float("-inf"))


def _draw(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Inverse-CDF draw: probs [S, V] unnormalised (>= 0, some > 0), u [S] in [0, 1). Returns [S].

    One uniform per row (not V exponentials) keeps the per-row generator cost to one scalar; the
    two-level (block, then within block) CDF in float64 keeps every token's mass exact to ~1e-7
    relative. A zero-probability token is never picked: the search takes the first CDF entry
    strictly above the target, and zero mass never raises the CDF.
    """
    s, v = probs.shape
    full = v // _BLOCK * _BLOCK
    block_mass = probs[:, :full].reshape(s, -1, _BLOCK).sum(dim=-1)  # [S, nb]
    if full < v:
        block_mass = torch.cat([block_mass, probs[:, full:].sum(dim=-1, keepdim=True)], dim=1)
    block_cdf = block_mass.double().cumsum(dim=-1)  # [S, nb]
    total = block_cdf[:, -1:]  # [S, 1]
    # u < 1, yet u * total can round up to total; nextafter keeps the target below it.
    target = torch.minimum(u[:, None] * total, torch.nextafter(total, torch.zeros_like(total)))  # [S, 1]
    block = torch.searchsorted(block_cdf, target, right=True).clamp_(max=block_cdf.shape[1] - 1)  # [S, 1]
    below = torch.where(block > 0, block_cdf.gather(1, (block - 1).clamp(min=0)), 0.0)  # [S, 1]
    cols = block * _BLOCK + torch.arange(_BLOCK, device=probs.device)  # [S, B]
    inner = probs.gather(1, cols.clamp(max=v - 1)).double().masked_fill_(cols >= v, 0.0)  # [S, B]
    inner_cdf = inner.cumsum(dim=-1)  # [S, B]
    rest = (target - below).clamp(min=0.0)  # [S, 1]
    rest = torch.minimum(rest, torch.nextafter(inner_cdf[:, -1:], torch.zeros_like(rest)))
    pos = torch.searchsorted(inner_cdf, rest, right=True).clamp_(max=_BLOCK - 1)  # [S, 1]
    return (block * _BLOCK + pos).squeeze(1).clamp_(max=v - 1)


def _flatten(seqs: Sequence[Sequence[int]], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Concatenated ids of seqs and the index of the sequence each came from: ([T], [T]) int64."""
    lens = [len(s) for s in seqs]
    total = sum(lens)
    # np.fromiter is ~10x faster than torch.tensor on a Python list of ints.
    flat = np.fromiter(itertools.chain.from_iterable(seqs), dtype=np.int64, count=total)
    ids = torch.from_numpy(flat).to(device)  # [T]
    # Built on the host: repeat_interleave with device counts would read them back (a sync).
    which = torch.from_numpy(np.repeat(np.arange(len(seqs), dtype=np.int64), lens)).to(device)
    return which, ids


def _greedy(params: SamplingParams) -> bool:
    return params.temperature < _MIN_TEMPERATURE


def _column(values: Sequence[float], device: torch.device) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float32, device=device)[:, None]  # [R, 1]


def _take(x: torch.Tensor, idx: Sequence[int]) -> torch.Tensor:
    """Rows idx of x: x itself when that is every row, else a copy."""
    if len(idx) == x.shape[0]:
        return x
    return x.index_select(0, torch.tensor(idx, device=x.device))


def _put(x: torch.Tensor, idx: Sequence[int], rows: torch.Tensor) -> None:
    """Inverse of _take: write rows back unless they already are x."""
    if rows is not x:
        x.index_copy_(0, torch.tensor(idx, device=x.device), rows)


def _owned(x: torch.Tensor, source: torch.Tensor) -> bool:
    """Whether x is safe to write in place: it does not share memory with the caller's logits."""
    return x.untyped_storage().data_ptr() != source.untyped_storage().data_ptr()
