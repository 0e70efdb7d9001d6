"""The sampler's filters and penalties, each against its definition."""
import pytest
import torch

from loramux.layers.sampler import SamplingRow, apply_penalties, filter_top_k_top_p, sample, sample_and_score
from loramux.sampling_params import SamplingParams


def test_top_k_keeps_the_k_largest():
    logits = torch.tensor([1.0, 5.0, 3.0, 4.0])
    kept = filter_top_k_top_p(logits, 2, 1.0)
    assert torch.isfinite(kept).tolist() == [False, True, False, True]


def test_top_p_keeps_the_smallest_set_reaching_p():
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    kept = filter_top_k_top_p(probs.log(), -1, 0.75)
    assert torch.isfinite(kept).tolist() == [True, True, False, False]


def test_penalties_follow_openai():
    logits = torch.zeros(1, 5)
    row = SamplingRow(SamplingParams(presence_penalty=0.5, frequency_penalty=0.25), [1, 1, 3], None)
    apply_penalties(logits, [row])
    assert logits[0].tolist() == [0.0, -1.0, 0.0, -0.75, 0.0]


def test_seeded_rows_are_reproducible_and_greedy_is_argmax():
    logits = torch.randn(3, 50)
    params = SamplingParams(temperature=1.0, seed=3)

    def draw():
        rows = [SamplingRow(SamplingParams(temperature=0), [], None),
                SamplingRow(params, [], torch.Generator().manual_seed(3)),
                SamplingRow(SamplingParams(temperature=0.5, top_k=1), [], torch.Generator())]
        return sample(logits.clone(), rows)

    first = draw()
    assert first == draw()
    assert first[0] == logits[0].argmax() and first[2] == logits[2].argmax()


def test_rows_with_non_finite_logits_get_none_and_the_others_are_sampled():
    logits = torch.randn(4, 50)
    logits[1, 7] = float("nan")
    logits[2, 3] = float("inf")
    rows = [SamplingRow(SamplingParams(temperature=0), [], None), SamplingRow(SamplingParams(temperature=0), [], None),
            SamplingRow(SamplingParams(temperature=1.0), [], torch.Generator()),
            SamplingRow(SamplingParams(temperature=0.7, seed=1), [], torch.Generator().manual_seed(1))]
    tokens = sample(logits.clone(), rows)
    assert tokens[0] == logits[0].argmax() and tokens[1] is None and tokens[2] is None and isinstance(tokens[3], int)


def test_a_tiny_temperature_is_greedy():
    logits = torch.randn(1, 50)
    assert sample(logits.clone(), [SamplingRow(SamplingParams(temperature=1e-40), [], torch.Generator())]) == \
        [int(logits.argmax())]


def test_any_sampling_fields_are_refused_or_sampled_without_an_exception():
    """Fuzz: whatever numbers a client sends, SamplingParams refuses them (ValueError) or the sampler
    returns a token (or None for a non-finite row) for every row — it never raises inside a step."""
    import math

    from hypothesis import given, settings
    from hypothesis import strategies as st

    numbers = st.one_of(st.floats(allow_nan=True, allow_infinity=True), st.integers(-2**70, 2**70),
                        st.sampled_from([1e-40, 1e-5, 0.0, -0.0, 1e400, 2.0]))

    @settings(max_examples=300, deadline=None)
    @given(temperature=numbers, top_p=numbers, top_k=st.integers(-3, 100), presence=numbers, frequency=numbers,
           seed=st.one_of(st.none(), st.integers(-2**64, 2**64)), logit_scale=st.sampled_from([1.0, 1e30, 1e-30]))
    def check(temperature, top_p, top_k, presence, frequency, seed, logit_scale):
        try:
            params = SamplingParams(temperature=temperature, top_p=top_p, top_k=top_k, presence_penalty=presence,
                                    frequency_penalty=frequency, seed=seed)
        except ValueError:
            return
        logits = torch.randn(2, 64) * logit_scale
        generator = None if params.greedy else torch.Generator().manual_seed(0 if seed is None else seed % 2**64)
        tokens = sample(logits, [SamplingRow(params, [1, 2, 2], generator), SamplingRow(params, [], generator)])
        assert all(t is None or 0 <= t < 64 for t in tokens)
        assert all(t is not None for t in tokens) or not all(math.isfinite(float(v)) for v in logits.flatten())

    check()


def test_a_tiny_top_p_keeps_the_most_likely_token():
    """Found by the fuzz above: with top_p 3.7e-59, cumsum rounding dropped every token of some rows."""
    gen = torch.Generator().manual_seed(0)
    for _ in range(200):
        logits = torch.randn(64, generator=gen)
        kept = torch.isfinite(filter_top_k_top_p(logits, 0, 3.7e-59)).nonzero().flatten().tolist()
        assert kept == [int(logits.argmax())]


def test_repetition_penalty_min_p_logit_bias_and_blocked_tokens_match_their_definitions():
    from transformers import MinPLogitsWarper, RepetitionPenaltyLogitsProcessor

    from loramux.layers.sampler import apply_logit_bias, apply_masks

    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(1, 40, generator=gen)
    row = SamplingRow(SamplingParams(repetition_penalty=1.7), [3, 9], None, prompt_token_ids=[1, 3, 20])
    mine = logits.clone()
    apply_penalties(mine, [row])
    hf = RepetitionPenaltyLogitsProcessor(1.7)(torch.tensor([[1, 3, 20, 3, 9]]), logits.clone())
    torch.testing.assert_close(mine, hf)
    biased = logits.clone()
    row = SamplingRow(SamplingParams(logit_bias={4: 5.0, 7: -100}), [], None, blocked=[0, 2])
    apply_logit_bias(biased, [row])
    apply_masks(biased, [row])
    expected = logits.clone()
    expected[0, 4] += 5.0
    expected[0, 7] -= 100
    expected[0, [0, 2]] = float("-inf")
    torch.testing.assert_close(biased, expected)
    # min_p: the tokens a draw can give are those HF's MinPLogitsWarper keeps (after temperature)
    kept_hf = torch.isfinite(MinPLogitsWarper(0.2)(None, logits / 0.7))[0]
    draws = {sample(logits.clone(), [SamplingRow(SamplingParams(temperature=0.7, min_p=0.2), [],
                                                 torch.Generator().manual_seed(s))])[0] for s in range(300)}
    assert draws <= set(kept_hf.nonzero().flatten().tolist()) and len(draws) > 1


def test_where_bad_words_block_all_a_grammar_allows_the_grammar_wins():
    """guided_choice ["yes"] with bad_words covering "yes": the output must stay valid, so the blocked tokens
    are allowed back on that row (and stay blocked where the grammar leaves another way)."""
    logits = torch.zeros(2, 8)
    logits[:, 5] = 3.0
    only_two = torch.zeros(8, dtype=torch.bool)
    only_two[2] = True
    two_or_three = only_two.clone()
    two_or_three[3] = True
    rows = [SamplingRow(SamplingParams(temperature=0), [], None, allowed=only_two, blocked=[2]),
            SamplingRow(SamplingParams(temperature=0), [], None, allowed=two_or_three, blocked=[2])]
    assert sample(logits, rows) == [2, 3]


def test_scored_rows_read_on_the_device_equal_the_hosts_and_are_raw():
    """sample_and_score's device path (one packed read) gives the host path's logprobs: the raw logits' (before
    the penalty and temperature), ranks counting ties as HF's, each row its own k, a broken row none."""
    torch.manual_seed(0)
    logits = torch.randn(4, 50)
    logits[1, 7] = logits[1, 9] = 5.0  # a tie at the top: rank 1 for either
    logits[3, 0] = float("nan")
    rows = [SamplingRow(SamplingParams(temperature=0, repetition_penalty=1.5), [1, 2], None),
            SamplingRow(SamplingParams(temperature=0), [], None),
            SamplingRow(SamplingParams(temperature=0.7), [], torch.Generator().manual_seed(1)),
            SamplingRow(SamplingParams(temperature=0), [], None)]
    scored = {0: 5, 1: 0, 3: 2}
    host = sample_and_score(logits.clone(), rows, scored, on_host=True)
    device = sample_and_score(logits.clone(), rows, scored, on_host=False)
    assert host[0][:2] == device[0][:2] and host[0][3] is device[0][3] is None
    assert set(host[1]) == set(device[1]) == {0, 1}
    for i in (0, 1):
        h, d = host[1][i], device[1][i]
        assert (h.token_ids, h.ranks, h.top_ids) == (d.token_ids, d.ranks, d.top_ids)
        assert h.logprobs == pytest.approx(d.logprobs) and h.top_logprobs[0] == pytest.approx(d.top_logprobs[0])
    assert len(device[1][0].top_ids[0]) == 5 and device[1][1].top_ids == [[]] and device[1][1].ranks == [1]
    raw = torch.log_softmax(logits[0], -1)
    assert device[1][0].logprobs[0] == pytest.approx(raw[device[0][0]].item())
