"""StepCost: the replica's fit of its step time against its tokens and sampled rows, which bounds the batch
class's share of a step."""

import random

import pytest

from deployments.engine.step_cost import MIN_STEPS, StepCost, StepFit


def test_the_fit_recovers_a_steps_fixed_part_its_cost_per_token_and_per_sampled_row_through_noise() -> None:
    """Decode steps (a row a token) and prefill chunks (many tokens, few rows) mixed, as a replica runs
    them: a row's cost beyond its token is read apart from the tokens'."""
    rng = random.Random(7)
    cost = StepCost()
    for _ in range(400):
        decodes, chunk = rng.randint(1, 16), rng.choice([0, 0, rng.randint(8, 256)])
        tokens, rows = decodes + chunk, decodes + (chunk > 0 and rng.random() < 0.5)
        cost.observe(tokens, rows, 0.004 + 0.0001 * tokens + 0.002 * rows + rng.uniform(-0.0003, 0.0003))
    fitted = cost.fit()
    assert fitted is not None
    assert fitted.fixed == pytest.approx(0.004, rel=0.1)
    assert fitted.per_token == pytest.approx(0.0001, rel=0.05)
    assert fitted.per_row == pytest.approx(0.002, rel=0.05)
    # 10% of a step of 4 decodes (4 ms + 0.4 ms + 8 ms): 1.24 ms, under one more decode row (2.1 ms)
    # but twelve tokens of a prompt chunk.
    allowance = fitted.allowance(4, 4, 0.1)
    assert allowance is not None and allowance == pytest.approx(0.00124, rel=0.1)
    assert fitted.added(1, 1) > allowance > fitted.added(12, 0)


def test_with_only_decode_steps_the_tokens_carry_the_rows_cost() -> None:
    """Every row one token: rows and tokens cannot be told apart, so the fit is by tokens alone and a token
    costs what a decode row does (a prompt chunk is then overcharged, never undercharged)."""
    cost = StepCost()
    for i in range(200):
        rows = 1 + i % 16
        cost.observe(rows, rows, 0.004 + 0.0021 * rows)
    fitted = cost.fit()
    assert fitted is not None and fitted.per_row == 0.0
    assert fitted.per_token == pytest.approx(0.0021) and fitted.fixed == pytest.approx(0.004)


def test_recent_steps_outweigh_old_ones() -> None:
    """The machine slows (a neighbour, longer contexts): the fit follows within a few half-lives."""
    cost = StepCost(half_life_steps=32)
    for i in range(600):
        per_token = 0.001 if i < 300 else 0.002
        tokens = 1 + i % 40
        cost.observe(tokens, 1 + i % 3, 0.002 + per_token * tokens)
    fitted = cost.fit()
    assert fitted is not None and fitted.per_token == pytest.approx(0.002, rel=0.05)


def test_nothing_is_claimed_before_the_steps_can_tell_fixed_from_per_token() -> None:
    cost = StepCost()
    for _ in range(MIN_STEPS - 1):
        cost.observe(8, 8, 0.01)
    assert cost.fit() is None  # too few steps: no fit, so no allowance from time
    for _ in range(100):
        cost.observe(8, 8, 0.01)
    assert cost.fit() is None  # every step the same size: no slope to read
    flat = StepCost()
    for i in range(100):
        flat.observe(1 + i % 30, 1 + i % 7, 0.01)
    flat_fit = flat.fit()
    assert flat_fit == StepFit(pytest.approx(0.01), 0.0, 0.0)  # type: ignore[arg-type]
    assert flat_fit is not None and flat_fit.allowance(8, 8, 0.1) is None  # work costs nothing: no bound
