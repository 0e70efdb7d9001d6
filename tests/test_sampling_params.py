"""SamplingParams is the one place a request's decoding fields are checked: everything an engine step could
choke on is refused here, naming the field."""
import math

import pytest

from loramux.sampling_params import SEED_MAX, SEED_MIN, SamplingParams, choice_seed


@pytest.mark.parametrize("field, value", [
    ("max_tokens", 0), ("max_tokens", -1), ("max_tokens", 2.5), ("max_tokens", True),
    ("temperature", -0.1), ("temperature", math.inf), ("temperature", math.nan), ("temperature", "1"),
    ("temperature", 2.01), ("temperature", 1e6), ("temperature", 2**64), ("temperature", True),
    ("top_p", 0), ("top_p", 1.5), ("top_p", math.nan), ("top_k", -2), ("top_k", 1.5),
    ("seed", 2**64), ("seed", SEED_MIN - 1), ("seed", SEED_MAX + 1), ("seed", 1.0),
    ("presence_penalty", 3), ("presence_penalty", math.nan), ("frequency_penalty", -math.inf),
    ("stop", ("",)), ("stop", (5,)), ("stop_token_ids", (-1,)), ("stop_token_ids", ("a",)),
    ("stop", ("ok", "a\ud800")), ("bad_words", ("\udfff",)),  # lone surrogates: a tokenizer raises TypeError
    ("cache_salt", ""), ("cache_salt", 5), ("cache_salt", "\ud800"), ("priority", 1.0), ("priority", 2**63),
    ("logit_bias", {"-5": 1}), ("logit_bias", {5: True}), ("logit_bias", {True: 1}),
])
def test_out_of_range_fields_are_refused_by_name(field, value):
    with pytest.raises(ValueError, match=f"^{field} "):
        SamplingParams(**{field: value})


def test_edges_that_are_accepted():
    SamplingParams(seed=SEED_MIN)
    SamplingParams(seed=SEED_MAX)
    assert SamplingParams(temperature=2).temperature == 2.0  # OpenAI's upper bound, included
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
    """JSON gives integers (2): kept as floats, which the sampler divides by (an int past 2**63 made
    `logits / temperature` overflow inside a step); one past float's range is refused, not an OverflowError."""
    params = SamplingParams(temperature=2, top_p=1, presence_penalty=1, frequency_penalty=-2,
                            repetition_penalty=2, min_p=0)
    assert all(type(getattr(params, name)) is float for name in
               ("temperature", "top_p", "presence_penalty", "frequency_penalty", "repetition_penalty", "min_p"))
    with pytest.raises(ValueError, match="temperature must be a finite number"):
        SamplingParams(temperature=10**400)


def test_temperature_above_openais_bound_is_refused_naming_the_range():
    with pytest.raises(ValueError, match=r"^temperature must be a finite number in \[0, 2\], got 1000000.0$"):
        SamplingParams(temperature=1e6)


@pytest.mark.parametrize("key", [" 7 ", "7 ", "\u0661\u0662", "007", "+7", "7.0", "\u00b2", "--5", "-0", "", "0x7",
                                 "1" * 20, "7\n"])
def test_logit_bias_keys_must_be_canonical_decimal_token_ids(key):
    """int() reads " 7 " as 7 and Arabic-Indic "١٢" as 12: a bias on a token the client never wrote."""
    with pytest.raises(ValueError, match="^logit_bias key .* is not a token id"):
        SamplingParams(logit_bias={key: 1})


def test_canonical_logit_bias_keys_are_read_as_token_ids():
    assert SamplingParams(logit_bias={"0": 1, "50256": -100, "7": 2.5}).logit_bias == {0: 1, 50256: -100, 7: 2.5}
    assert SamplingParams(logit_bias={7: 1}).logit_bias == {7: 1}  # the offline API's int keys
    with pytest.raises(ValueError, match=r"^logit_bias must map token ids \(integers >= 0\)"):
        SamplingParams(logit_bias={"-5": 1})  # a canonical negative: refused by the range check, as before


def test_error_messages_quote_a_long_value_shortened():
    with pytest.raises(ValueError) as err:
        SamplingParams(logit_bias={"9" * 100_000: 1})
    assert len(str(err.value)) < 300
    with pytest.raises(ValueError) as err:
        SamplingParams(stop=("x" * 100_000, ""))
    assert str(err.value).startswith("stop must be non-empty strings") and len(str(err.value)) < 300
