"""StepCost: the replica's fit of its step time against its tokens, which bounds the batch class's share."""

import random

import pytest

from deployments.engine.step_cost import MIN_STEPS, StepCost


def test_the_fit_recovers_a_steps_fixed_part_and_its_cost_per_token_through_noise() -> None:
    rng = random.Random(7)
    cost = StepCost()
    for _ in range(400):
        tokens = rng.randint(1, 64)
        cost.observe(tokens, 0.004 + 0.0005 * tokens + rng.uniform(-0.0003, 0.0003))
    fitted = cost.fit()
    assert fitted is not None
    assert fitted[0] == pytest.approx(0.004, rel=0.1) and fitted[1] == pytest.approx(0.0005, rel=0.05)
    # 10% of a 17-token step (4 ms + 8.5 ms): 1.25 ms, two whole tokens at 0.5 ms.
    assert cost.spare(17, 0.1) == 2


def test_recent_steps_outweigh_old_ones() -> None:
    """The machine slows (a neighbour, longer contexts): the fit follows within a few half-lives."""
    cost = StepCost(half_life_steps=32)
    for i in range(600):
        per_token = 0.001 if i < 300 else 0.002
        cost.observe(1 + i % 40, 0.002 + per_token * (1 + i % 40))
    fitted = cost.fit()
    assert fitted is not None and fitted[1] == pytest.approx(0.002, rel=0.05)


def test_nothing_is_claimed_before_the_steps_can_tell_fixed_from_per_token() -> None:
    cost = StepCost()
    for _ in range(MIN_STEPS - 1):
        cost.observe(8, 0.01)
    assert cost.fit() is None and cost.spare(8, 0.1) is None  # too few steps
    for _ in range(100):
        cost.observe(8, 0.01)
    assert cost.fit() is None  # every step the same size: no slope to read
    flat = StepCost()
    for i in range(100):
        flat.observe(1 + i % 30, 0.01)
    fitted = flat.fit()
    assert fitted is not None and fitted[0] == pytest.approx(0.01) and fitted[1] == 0.0
    assert flat.spare(8, 0.1) is None  # tokens cost nothing: no bound from time
