"""The front end's logprob layouts (server/http/logprobs.py) against a plain per-entry way of writing them: the same
objects for random rows, with -inf, NaN and values whose sum overflows among them, ids whose texts collide
(special tokens dropped to "", two ids one text), `top` cuts and echo's first token. The served layouts themselves
(field names, what vLLM and OpenAI clients read) are tested in test_openai_fields.py."""
import math
import random

import pytest

from loramux.logprobs import Logprobs
from loramux.server.http.logprobs import FLOOR, LogprobFormatter

SPECIAL = {0, 1, 2}


class Tokenizer:
    """ids 0-2 special ("" when skipped); ids 10 and 11 decode to one text."""

    def __init__(self):
        self.decoded = 0

    def decode(self, ids, skip_special_tokens=True):
        self.decoded += 1
        (token_id,) = ids
        if token_id in SPECIAL:
            return "" if skip_special_tokens else f"<s{token_id}>"
        return "same" if token_id in (10, 11) else f"t{token_id}"


def finite(value):
    return value if math.isfinite(value) else FLOOR


def plain_completion(tok, lp, text_offset, skip, first_token=None, top=None):
    text = lambda t: tok.decode([t], skip_special_tokens=skip)  # noqa: E731
    tokens, logprobs, tops = [], [], []
    if first_token is not None:
        tokens.append(text(first_token))
        logprobs.append(None)
        tops.append(None)
    for i, token_id in enumerate(lp.token_ids):
        tokens.append(text(token_id))
        logprobs.append(finite(lp.logprobs[i]))
        entry = {text(t): finite(v) for t, v in zip(lp.top_ids[i][:top], lp.top_logprobs[i][:top])}
        entry.setdefault(tokens[-1], logprobs[-1])
        tops.append(entry)
    offsets = []
    for token in tokens:
        offsets.append(text_offset)
        text_offset += len(token)
    return {"tokens": tokens, "token_logprobs": logprobs, "top_logprobs": tops, "text_offset": offsets}


def plain_vllm_prompt(tok, lp, skip, top=None):
    text = lambda t: tok.decode([t], skip_special_tokens=skip)  # noqa: E731
    out = [None]
    for i, token_id in enumerate(lp.token_ids):
        entry = {str(t): {"logprob": finite(v), "rank": r + 1, "decoded_token": text(t)}
                 for r, (t, v) in enumerate(zip(lp.top_ids[i][:top], lp.top_logprobs[i][:top]))}
        entry[str(token_id)] = {"logprob": finite(lp.logprobs[i]), "rank": lp.ranks[i], "decoded_token": text(token_id)}
        out.append(entry)
    return out


def random_logprobs(rng: random.Random, positions: int, alternatives: int) -> Logprobs:
    def value():
        return rng.choice([-math.inf, math.nan, -1e-9, -3.5, -1.7e308]) if rng.random() < 0.2 else -rng.random() * 20

    def token():
        return rng.choice([0, 1, 2, 10, 11, rng.randrange(3, 60)])

    return Logprobs([token() for _ in range(positions)], [value() for _ in range(positions)],
                    [rng.randrange(1, 50) for _ in range(positions)],
                    [[token() for _ in range(alternatives)] for _ in range(positions)],
                    [[value() for _ in range(alternatives)] for _ in range(positions)])


@pytest.mark.parametrize("seed", range(6))
def test_the_layouts_equal_writing_them_entry_by_entry(seed):
    rng = random.Random(seed)
    tok = Tokenizer()
    formatter = LogprobFormatter(tok)
    for positions, alternatives in [(0, 0), (1, 0), (7, 1), (40, 5), (25, 20)]:
        lp = random_logprobs(rng, positions, alternatives)
        for skip in (True, False):
            for top in (None, 0, 3, alternatives):
                first = rng.choice([None, 0, 12])
                offset = rng.randrange(0, 9)
                # (a NaN written anywhere would make them differ: NaN != NaN)
                assert formatter.completion(lp, offset, skip, first, top) == \
                    plain_completion(tok, lp, offset, skip, first, top)
                assert formatter.vllm_prompt(lp, skip, top) == plain_vllm_prompt(tok, lp, skip, top)


def test_each_token_is_decoded_once_per_setting():
    tok = Tokenizer()
    formatter = LogprobFormatter(tok)
    lp = Logprobs([5, 5, 6], [-1.0] * 3, [1] * 3, [[5, 6, 7]] * 3, [[-1.0, -2.0, -3.0]] * 3)
    for _ in range(3):
        formatter.completion(lp, 0, True)
        formatter.completion(lp, 0, False)
    assert tok.decoded == 6  # ids 5, 6, 7, once with special tokens skipped and once kept
