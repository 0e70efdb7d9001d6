"""SamplingParams is the one place a request's decoding fields are checked: everything an engine step could
choke on is refused here, naming the field."""
import math

import pytest

from loramux.sampling_params import SEED_MAX, SEED_MIN, SamplingParams, choice_seed


@pytest.mark.parametrize("field, value", [
    ("max_tokens", 0), ("max_tokens", -1), ("max_tokens", 2.5), ("max_tokens", True),
    ("temperature", -0.1), ("temperature", math.inf), ("temperature", math.nan), ("temperature", "1"),
    ("top_p", 0), ("top_p", 1.5), ("top_p", math.nan), ("top_k", -2), ("top_k", 1.5),
    ("seed", 2**64), ("seed", SEED_MIN - 1), ("seed", SEED_MAX + 1), ("seed", 1.0),
    ("presence_penalty", 3), ("presence_penalty", math.nan), ("frequency_penalty", -math.inf),
    ("stop", ("",)), ("stop", (5,)), ("stop_token_ids", (-1,)), ("stop_token_ids", ("a",)),
])
def test_out_of_range_fields_are_refused_by_name(field, value):
    with pytest.raises(ValueError, match=f"^{field} "):
        SamplingParams(**{field: value})


def test_edges_that_are_accepted():
    SamplingParams(seed=SEED_MIN)
    SamplingParams(seed=SEED_MAX)
    assert SamplingParams(temperature=1e-40).greedy and SamplingParams(temperature=0).greedy
    assert not SamplingParams(temperature=1e-5).greedy
    assert SamplingParams(stop="x").stop == ("x",)


def test_choice_seeds_wrap_inside_the_signed_64_bit_range():
    assert choice_seed(None, 3) is None and choice_seed(5, 2) == 7
    assert choice_seed(SEED_MAX, 1) == SEED_MIN and choice_seed(SEED_MAX, 0) == SEED_MAX
    assert all(SEED_MIN <= choice_seed(SEED_MAX - 3, i) <= SEED_MAX for i in range(8))


def test_a_choice_seed_never_wraps_a_bad_seed_into_range():
    for seed in (2**64, SEED_MIN - 1, 1.5):
        with pytest.raises(ValueError, match="^seed must be an integer"):
            choice_seed(seed, 0)


def test_integer_numbers_become_floats_and_integers_past_float_range_are_refused():
    """JSON gives integers (2, or 2**64): kept as floats, which the sampler divides by (an int past 2**63 made
    `logits / temperature` overflow inside a step); one past float's range is refused, not an OverflowError."""
    params = SamplingParams(temperature=2**64, top_p=1, presence_penalty=1, frequency_penalty=-2,
                            repetition_penalty=2, min_p=0)
    assert all(type(getattr(params, name)) is float for name in
               ("temperature", "top_p", "presence_penalty", "frequency_penalty", "repetition_penalty", "min_p"))
    with pytest.raises(ValueError, match="temperature must be a finite number"):
        SamplingParams(temperature=10**400)
