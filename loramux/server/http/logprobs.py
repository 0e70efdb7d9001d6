"""Logprobs in OpenAI's two layouts, from the engine's columns (engine.output.Logprobs). No torch.

/v1/completions (legacy): {"tokens", "token_logprobs", "top_logprobs", "text_offset"}, one entry per token;
with echo the prompt's tokens come first, the very first one with null logprob and alternatives (nothing
comes before it). /v1/chat/completions: {"content": [{"token", "logprob", "bytes", "top_logprobs": [...]}]}.

A token's text is that token decoded alone, special tokens dropped or kept as the request's
skip_special_tokens says (as its text; a character split over several tokens shows as U+FFFD in each); `bytes` are that text's UTF-8 bytes, as vLLM gives them. -inf (a token the model
gives no probability at all) is written as -9999.0, as vLLM does: JSON has no infinity.
"""
from __future__ import annotations

import itertools
import math

from loramux.logprobs import Logprobs

FLOOR = -9999.0


def _finite(value: float) -> float:
    return value if math.isfinite(value) else FLOOR


class _Texts(dict):
    """token id -> its text decoded alone (one skip_special_tokens setting), decoded on first use and kept. A dict
    whose misses decode: a hit costs one dict lookup, so the layouts below map whole rows through it."""

    def __init__(self, tokenizer, skip_special: bool):
        super().__init__()
        self.tokenizer, self.skip_special = tokenizer, skip_special

    def __missing__(self, token_id: int) -> str:
        text = self[token_id] = self.tokenizer.decode([token_id], skip_special_tokens=self.skip_special)
        return text


def _finite_row(values: list[float]) -> list[float]:
    """values with -inf and NaN as FLOOR; the list itself when every value is finite (a sum is finite exactly
    then, short of an overflow, which takes the slow way too)."""
    return values if math.isfinite(sum(values)) else [_finite(v) for v in values]


class LogprobFormatter:
    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self._texts = {skip: _Texts(tokenizer, skip) for skip in (True, False)}

    def token(self, token_id: int, skip_special: bool = True) -> str:
        return self._texts[skip_special][token_id]

    def completion(self, lp: Logprobs, text_offset: int, skip_special: bool = True, first_token: int | None = None,
                   top: int | None = None) -> dict:
        """The legacy layout for `lp`'s tokens, their text offsets counted from `text_offset`. first_token:
        the prompt's first token, which has no logprob (echo), put before them. top: alternatives per token
        at most (lp may hold more: the prompt's are computed once for echo and prompt_logprobs)."""
        texts = self._texts[skip_special]
        tokens = list(map(texts.__getitem__, lp.token_ids))
        logprobs = list(_finite_row(lp.logprobs))
        tops = [dict(zip(map(texts.__getitem__, ids[:top]), _finite_row(values[:top])))
                for ids, values in zip(lp.top_ids, lp.top_logprobs)]
        for entry, text, logprob in zip(tops, tokens, logprobs):
            entry.setdefault(text, logprob)  # the chosen token is always among them, as in vLLM
        if first_token is not None:
            tokens.insert(0, texts[first_token])
            logprobs.insert(0, None)
            tops.insert(0, None)
        offsets = list(itertools.accumulate(map(len, tokens), initial=text_offset))[:-1]
        return {"tokens": tokens, "token_logprobs": logprobs, "top_logprobs": tops, "text_offset": offsets}

    def chat(self, lp: Logprobs, skip_special: bool = True) -> list[dict]:
        """The chat layout's `content` list for `lp`'s tokens."""
        return [{**self._entry(token_id, lp.logprobs[i], skip_special),
                 "top_logprobs": [self._entry(t, v, skip_special) for t, v in zip(lp.top_ids[i], lp.top_logprobs[i])]}
                for i, token_id in enumerate(lp.token_ids)]

    def vllm_prompt(self, lp: Logprobs, skip_special: bool = True, top: int | None = None) -> list:
        """vLLM's `prompt_logprobs`: null for the first token, then per token {id: {logprob, rank,
        decoded_token}} for the token itself and its top alternatives (`top` at most)."""
        texts = self._texts[skip_special]
        out: list = [None]
        rows = zip(lp.token_ids, lp.logprobs, lp.ranks, lp.top_ids, lp.top_logprobs)
        for token_id, logprob, rank, ids, values in rows:
            entry = {str(t): {"logprob": v, "rank": r, "decoded_token": texts[t]}
                     for r, (t, v) in enumerate(zip(ids[:top], _finite_row(values[:top])), 1)}
            entry[str(token_id)] = {"logprob": _finite(logprob), "rank": rank, "decoded_token": texts[token_id]}
            out.append(entry)
        return out

    def _entry(self, token_id: int, logprob: float, skip_special: bool) -> dict:
        text = self.token(token_id, skip_special)
        return {"token": text, "logprob": _finite(logprob), "bytes": list(text.encode("utf-8"))}


def merge_completion(parts: list[dict]) -> dict:
    """One legacy logprobs object from several (the prompt's and the completion's)."""
    return {key: [x for part in parts for x in part[key]] for key in ("tokens", "token_logprobs", "top_logprobs",
                                                                      "text_offset")}
