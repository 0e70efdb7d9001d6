"""StepCost: the step-time model that bounds how many prompt tokens a step that decodes may carry."""
import pytest

from loramux.engine.step_cost import MIN_CHUNK, StepCost


def test_no_bound_until_both_costs_are_known():
    cost = StepCost(slowdown=3.0)
    assert cost.prompt_allowance() is None
    cost.observe(decode_rows=8, prompt_tokens=0, seconds=0.010)
    assert cost.prompt_allowance() is None  # a prompt token's cost is not known yet
    cost.observe(decode_rows=8, prompt_tokens=100, seconds=0.060)  # 100 tokens added 50 ms: 0.5 ms each
    assert cost.prompt_allowance() == 40  # (3 - 1) x 10 ms / 0.5 ms
    assert StepCost(slowdown=None).prompt_allowance() is None


def test_estimates_follow_the_steps_and_a_chunk_never_drops_below_the_minimum():
    cost = StepCost(slowdown=3.0, smoothing=0.5)
    cost.observe(4, 0, 0.010)
    cost.observe(4, 0, 0.030)  # the moving average: 20 ms
    cost.observe(0, 50, 0.5)  # prompt-only steps count their whole time: 10 ms a token
    assert cost.decode_s == pytest.approx(0.020) and cost.token_s == pytest.approx(0.010)
    assert cost.prompt_allowance() == MIN_CHUNK  # (3 - 1) x 20 / 10 = 4 tokens, raised to the minimum


def test_a_bound_must_allow_a_slowdown():
    with pytest.raises(ValueError, match="> 1"):
        StepCost(slowdown=1.0)
