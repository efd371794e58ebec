"""Sampler: reference-checked against transformers' logits processors, penalties checked by hand."""

import math
import random
from typing import cast

import pytest
import torch
from transformers.generation.logits_process import (
    MinPLogitsWarper,
    RepetitionPenaltyLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from deployments.engine.errors import InvalidSamplingParams
from deployments.engine.sampler import Sampler, SamplingRow, _draw
from deployments.engine.sampling_params import SamplingParams

CPU = torch.device("cpu")


def row(params: SamplingParams, prompt=(), output=(), generator=None) -> SamplingRow:
    return SamplingRow(params=params, generator=generator, prompt_ids=list(prompt), output_ids=list(output))


def seeded(params: SamplingParams, prompt=(), output=()) -> SamplingRow:
    assert params.seed is not None
    g = torch.Generator().manual_seed(params.seed)
    return row(params, prompt, output, generator=g)


def hf_reference(logits: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """HF's warper chain (temperature -> top-k -> top-p -> min-p) on one row: [V] processed scores."""
    scores = logits[None, :].clone()  # [1, V]
    ids = cast(torch.LongTensor, torch.zeros(1, 1, dtype=torch.long))  # unused by the warpers
    scores = TemperatureLogitsWarper(p.temperature)(ids, scores)
    if p.top_k:
        scores = TopKLogitsWarper(p.top_k)(ids, scores)
    if p.top_p < 1.0:
        scores = TopPLogitsWarper(p.top_p)(ids, scores)
    if p.min_p > 0.0:
        scores = MinPLogitsWarper(p.min_p)(ids, scores)
    return scores[0]


def test_greedy_is_argmax_and_draws_nothing():
    torch.manual_seed(0)
    logits = torch.randn(7, 500)
    g = torch.Generator().manual_seed(7)
    state = g.get_state()
    rows = [
        row(SamplingParams(temperature=0.0)),
        row(SamplingParams(temperature=0.0, seed=7), generator=g),
        row(SamplingParams(temperature=0.9, top_p=0.5)),
        row(SamplingParams(temperature=0.0, top_k=3, top_p=0.1, min_p=0.5)),  # filters irrelevant
        row(SamplingParams(temperature=1.0)),
        row(SamplingParams(temperature=0.0)),
        row(SamplingParams(temperature=1e-7)),  # below 1e-5: greedy, as in vLLM (logits / t overflow)
    ]
    tokens = Sampler(500, CPU, seed=0).sample(logits, rows)
    for i in (0, 1, 3, 5, 6):
        assert tokens[i] == int(logits[i].argmax())
    assert torch.equal(g.get_state(), state)


def test_seeded_rows_do_not_depend_on_the_batch():
    torch.manual_seed(1)
    v = 2000
    steps = [torch.randn(v) * 2 for _ in range(12)]
    target = SamplingParams(temperature=1.0, top_p=0.95, seed=1234)

    def run(build_batch, params=target) -> list[int]:
        """Runs the target row for 12 steps inside the batch build_batch(step) returns."""
        sampler = Sampler(v, CPU, seed=random.randrange(2**31))
        g = torch.Generator().manual_seed(params.seed)
        out: list[int] = []
        for step, logits in enumerate(steps):
            mine = row(params, prompt=[1, 2, 3], output=out.copy(), generator=g)
            others, at = build_batch(step)
            rows = [*others[:at], mine, *others[at:]]
            batch = torch.randn(len(rows), v + 7)
            batch[at, :v] = logits
            out.append(sampler.sample(batch, rows)[at])
        return out

    alone = run(lambda step: ([], 0))

    def crowd(step):
        others = [
            row(SamplingParams(temperature=0.0)),
            row(SamplingParams(temperature=0.7, top_k=5, repetition_penalty=1.3), prompt=[5, 6], output=[7]),
            seeded(SamplingParams(temperature=1.3, min_p=0.1, seed=99)),
            row(SamplingParams(temperature=1.0, frequency_penalty=1.0, presence_penalty=0.5), output=[1, 1]),
        ]
        return others, step % (len(others) + 1)

    assert run(crowd) == alone
    assert run(lambda step: ([row(SamplingParams(top_p=0.3)) for _ in range(40)], 39 - step)) == alone
    # The seed matters at all: another seed gives another stream.
    other_seed = SamplingParams(temperature=1.0, top_p=0.95, seed=4321)
    assert run(lambda step: ([], 0), other_seed) != alone


@pytest.mark.parametrize("scale", [1.0, 4.0, 10.0])
def test_filters_match_transformers(scale: float):
    torch.manual_seed(int(scale))
    rnd = random.Random(int(scale))
    v = 3000
    params = [
        SamplingParams(
            temperature=rnd.choice([0.3, 0.7, 1.0, 1.6]),
            top_k=rnd.choice([0, 0, 1, 7, 100, 2999, 5000]),
            top_p=rnd.choice([1.0, 1.0, 0.99, 0.9, 0.5, 0.05]),
            min_p=rnd.choice([0.0, 0.0, 0.01, 0.1, 0.5]),
        )
        for _ in range(48)
    ]
    params += [SamplingParams(top_k=40), SamplingParams(top_p=0.8), SamplingParams(min_p=0.05)]  # alone
    logits = torch.randn(len(params), v) * scale
    probs = Sampler(v, CPU).probabilities(logits, [row(p) for p in params])
    for i, p in enumerate(params):
        ref = hf_reference(logits[i], p)
        ref_probs = ref.softmax(-1)
        if scale == 1.0:  # no float32 underflow: the support below is exactly HF's -inf mask
            assert torch.equal(ref_probs > 0, torch.isfinite(ref))
        assert torch.equal(probs[i] > 0, ref_probs > 0), p
        torch.testing.assert_close(probs[i], ref_probs, atol=1e-6, rtol=1e-4)


def test_top_k_keeps_ties_like_transformers():
    torch.manual_seed(3)
    logits = (torch.randn(8, 300) * 2).round()  # [8, V]  # bf16-like: many exact ties at the k-th value
    params = [SamplingParams(top_k=k) for k in (1, 2, 3, 5, 10, 20, 50, 299)]
    params += [SamplingParams(min_p=m) for m in (1.0, 0.5)]  # min_p=1 keeps every token tied at the top
    logits = torch.cat([logits, logits[:2]])
    probs = Sampler(300, CPU).probabilities(logits, [row(p) for p in params])
    for i, p in enumerate(params):
        assert torch.equal(probs[i] > 0, torch.isfinite(hf_reference(logits[i], p)))
    assert int((probs[0] > 0).sum()) >= 1


def test_penalties_by_hand():
    v = 10
    logits = torch.tensor([[2.0, -1.0, 0.5, -3.0, 1.0, 0.0, 4.0, -0.5, 1.5, 0.25]] * 3)  # [3, V]
    prompt, output = [1, 2, 2, 8], [2, 3, 3, 3, 6]
    rows = [
        row(
            SamplingParams(repetition_penalty=2.0, frequency_penalty=0.5, presence_penalty=0.3),
            prompt,
            output,
        ),
        row(SamplingParams(presence_penalty=-1.0), prompt, output),
        row(SamplingParams(), prompt, output),  # no penalties: untouched
        row(SamplingParams(repetition_penalty=3.0, frequency_penalty=1.0)),  # empty history: untouched
    ]
    logits = torch.cat([logits, logits[:1]])
    before = logits.clone()
    probs = Sampler(v, CPU).probabilities(logits, rows)

    expected = before.clone()
    for t in set(prompt) | set(output):
        x = expected[0, t]
        expected[0, t] = x / 2.0 if x > 0 else x * 2.0
    for t in set(output):
        n = output.count(t)
        expected[0, t] -= 0.5 * n + 0.3
        expected[1, t] -= -1.0
    torch.testing.assert_close(probs, expected.softmax(-1))
    assert torch.equal(logits, before)  # the caller's logits are never written

    # The repetition penalty alone equals HF's processor over prompt + output.
    ids = torch.tensor([prompt + output])
    hf = RepetitionPenaltyLogitsProcessor(1.7)(ids, before[:1].clone())  # [1, V]
    ours = Sampler(v, CPU).probabilities(
        before[:1], [row(SamplingParams(repetition_penalty=1.7), prompt, output)]
    )
    torch.testing.assert_close(ours[0], hf[0].softmax(-1))


def test_penalties_steer_greedy_and_ignore_ids_past_the_vocab():
    logits = torch.tensor([[5.0, 4.9, 0.0, 0.0]])
    sampler = Sampler(4, CPU)
    assert sampler.sample(logits, [row(SamplingParams(temperature=0.0))]) == [0]
    penalised = row(SamplingParams(temperature=0.0, frequency_penalty=0.2), output=[0, 0, 9])  # 9 >= V
    assert sampler.sample(logits, [penalised]) == [1]


def test_vocab_padding_is_never_sampled():
    v, padded = 100, 128
    logits = torch.randn(16, padded)
    logits[:, v:] = 1e4  # the padding would win every draw if it were not masked
    rows = [row(SamplingParams(temperature=t)) for t in (0.0, 0.5, 1.0, 2.0)] * 4
    sampler = Sampler(v, CPU, seed=0)
    for _ in range(20):
        assert all(0 <= t < v for t in sampler.sample(logits, rows))
    assert sampler.probabilities(logits, rows).shape == (16, v)


def test_sampled_frequencies_match_softmax():
    logits = torch.tensor([2.0, 1.0, 0.5, 0.0, -0.5, -1.0, -3.0, 1.5])  # [V]
    n, calls = 5000, 4
    sampler = Sampler(8, CPU, seed=11)
    rows = [row(SamplingParams(temperature=1.0))] * n
    counts = torch.zeros(8)
    for _ in range(calls):
        tokens = torch.tensor(sampler.sample(logits.expand(n, 8), rows))
        counts += torch.bincount(tokens, minlength=8)
    freq = counts / (n * calls)
    # 20000 draws: one standard deviation is at most 0.0036.
    torch.testing.assert_close(freq, logits.softmax(-1), atol=0.015, rtol=0)

    top2 = sampler.sample(logits.expand(n, 8), [row(SamplingParams(top_k=2))] * n)
    assert set(top2) == {0, 7}


def test_tail_mass_survives_a_large_vocab():
    # Half the mass on one token, half spread over 150k tokens of ~3e-6 each: a float32 cumsum
    # over the row would stop growing near 1 and lose part of the tail.
    v = 150_001
    probs = torch.full((1, v), 0.5 / (v - 1))
    probs[0, 0] = 0.5
    u = torch.rand(20000, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    tokens = _draw(probs.expand(20000, v), u)
    assert abs(float((tokens == 0).double().mean()) - 0.5) < 0.02
    assert int(tokens.max()) < v


def test_draw_edges_never_pick_zero_mass():
    probs = torch.tensor([[0.0, 0.3, 0.0, 0.7, 0.0]] * 3)
    u = torch.tensor([0.0, math.nextafter(1.0, 0.0), 0.31], dtype=torch.float64)
    assert _draw(probs, u).tolist() == [1, 3, 3]


def test_bfloat16_logits():
    logits = torch.randn(4, 64).to(torch.bfloat16)
    rows = [row(SamplingParams(temperature=t, top_p=0.9)) for t in (0.0, 0.5, 1.0, 1.5)]
    tokens = Sampler(64, CPU, seed=0).sample(logits, rows)
    assert tokens[0] == int(logits[0].float().argmax())
    assert all(0 <= t < 64 for t in tokens)


def test_empty_batch_and_shape_check():
    sampler = Sampler(10, CPU)
    assert sampler.sample(torch.empty(0, 10), []) == []
    with pytest.raises(ValueError, match="logits must be"):
        sampler.sample(torch.zeros(2, 10), [row(SamplingParams())])


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("temperature", -0.1),
        ("temperature", 2.5),
        ("top_p", 0.0),
        ("top_p", 1.1),
        ("top_k", -1),
        ("min_p", 1.5),
        ("repetition_penalty", 0.0),
        ("repetition_penalty", 5e-324),  # would overflow logits to inf in float32
        ("presence_penalty", 2.1),
        ("frequency_penalty", -2.1),
        ("seed", -1),
    ],
)
def test_invalid_values_are_rejected_by_sampling_params(field: str, value: object):
    with pytest.raises(InvalidSamplingParams, match=field) as err:
        SamplingParams(**{field: value})  # type: ignore[arg-type]
    assert err.value.param == field
