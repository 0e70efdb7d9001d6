"""StepCost: the step-time model that bounds how many prompt tokens a step that decodes may carry."""
import random

import pytest

from loramux.engine.step_cost import MIN_CHUNK, StepCost

MS = 1e-3


def true_step(rows: int, tokens: int) -> float:
    """A made-up engine: 20 ms a step, 1 ms a row (decode row or prompt token), 5 ms for carrying prompt chunks."""
    return (20 + rows + tokens + (5 if tokens else 0)) * MS


def test_no_bound_until_both_kinds_of_step_ran():
    cost = StepCost(slowdown=2.0)
    assert cost.prompt_allowance(8) is None
    cost.observe(decode_rows=8, prompt_tokens=0, seconds=true_step(8, 0))
    assert cost.prompt_allowance(8) is None  # a prompt chunk's cost is not known yet
    cost.observe(decode_rows=8, prompt_tokens=32, seconds=true_step(8, 32))
    assert cost.prompt_allowance(8) is not None
    assert StepCost(slowdown=None).prompt_allowance(8) is None


def test_the_fit_recovers_fixed_per_row_and_per_chunk_costs_from_mixed_steps():
    cost, rng = StepCost(slowdown=2.0), random.Random(0)
    for rows in (1, 2, 3, 4):  # decode-only steps: few, and long ago
        cost.observe(rows, 0, true_step(rows, 0))
    for _ in range(200):  # then only steps with prompt chunks, at varying batch sizes
        rows, tokens = rng.randint(4, 24), rng.choice([16, 17, 40])
        cost.observe(rows, tokens, true_step(rows, tokens))
    fixed, per_row, per_chunk = cost.costs()
    assert (fixed, per_row, per_chunk) == pytest.approx((20 * MS, 1 * MS, 5 * MS), rel=1e-3)
    assert cost.decode_time(32) == pytest.approx(52 * MS)


def test_the_allowance_keeps_a_step_within_the_slowdown_of_the_batch_about_to_decode():
    cost = StepCost(slowdown=2.0)
    for rows, tokens in [(1, 0), (4, 0), (8, 0), (8, 16), (4, 64), (12, 32)]:
        cost.observe(rows, tokens, true_step(rows, tokens))
    # against its own 8 rows: 20 + 8 + 5 + T <= 2 x 28 -> T <= 23
    assert cost.prompt_allowance(8) == 23
    assert true_step(8, 23) <= 2 * true_step(8, 0) < true_step(8, 24)
    # 32 rows about to decode (short prompts waiting): 20 + 8 + 5 + T <= 2 x 52 -> T <= 71
    assert cost.prompt_allowance(8, 32) == 71
    assert cost.prompt_allowance(8, 4) == 23  # never below the rows decoding now


def test_where_a_chunk_alone_costs_more_than_the_slowdown_allows_a_step_carries_the_minimum():
    cost = StepCost(slowdown=2.0)
    for rows, tokens in [(1, 0), (2, 0), (1, 16), (1, 200), (2, 64)]:  # a tiny model: 1 ms steps, 2 ms per chunk
        cost.observe(rows, tokens, (1 + 0.01 * (rows + tokens) + (2 if tokens else 0)) * MS)
    assert cost.prompt_allowance(1) == MIN_CHUNK


def test_recent_steps_weigh_more():
    cost = StepCost(slowdown=2.0, smoothing=0.5)
    for rows in (1, 2, 3, 4) * 10:
        cost.observe(rows, 0, true_step(rows, 0))
    for rows in (1, 2, 3, 4) * 10:  # the engine got twice as slow (another process took a core)
        cost.observe(rows, 0, 2 * true_step(rows, 0))
    assert cost.decode_time(4) == pytest.approx(2 * true_step(4, 0), rel=1e-3)


def test_a_bound_must_allow_a_slowdown():
    with pytest.raises(ValueError, match="> 1"):
        StepCost(slowdown=1.0)
