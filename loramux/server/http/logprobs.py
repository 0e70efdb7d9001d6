"""Logprobs in OpenAI's two layouts, from the engine's columns (engine.output.Logprobs). No torch.

/v1/completions (legacy): {"tokens", "token_logprobs", "top_logprobs", "text_offset"}, one entry per token;
with echo the prompt's tokens come first, the very first one with null logprob and alternatives (nothing
comes before it). /v1/chat/completions: {"content": [{"token", "logprob", "bytes", "top_logprobs": [...]}]}.

A token's text is that token decoded alone, special tokens dropped or kept as the request's
skip_special_tokens says (as its text; a character split over several tokens shows as U+FFFD in each); `bytes` are that text's UTF-8 bytes, as vLLM gives them. -inf (a token the model
gives no probability at all) is written as -9999.0, as vLLM does: JSON has no infinity.
"""
from __future__ import annotations

import math

from loramux.logprobs import Logprobs

FLOOR = -9999.0


def _finite(value: float) -> float:
    return value if math.isfinite(value) else FLOOR


class LogprobFormatter:
    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self._texts: dict[tuple[int, bool], str] = {}

    def token(self, token_id: int, skip_special: bool = True) -> str:
        text = self._texts.get((token_id, skip_special))
        if text is None:
            text = self._texts[token_id, skip_special] = self.tokenizer.decode([token_id], skip_special_tokens=skip_special)
        return text

    def completion(self, lp: Logprobs, text_offset: int, skip_special: bool = True, first_token: int | None = None,
                   top: int | None = None) -> dict:
        """The legacy layout for `lp`'s tokens, their text offsets counted from `text_offset`. first_token:
        the prompt's first token, which has no logprob (echo), put before them. top: alternatives per token
        at most (lp may hold more: the prompt's are computed once for echo and prompt_logprobs)."""
        tokens, logprobs, tops = [], [], []
        if first_token is not None:
            tokens.append(self.token(first_token, skip_special))
            logprobs.append(None)
            tops.append(None)
        for i, token_id in enumerate(lp.token_ids):
            tokens.append(self.token(token_id, skip_special))
            logprobs.append(_finite(lp.logprobs[i]))
            alternatives = zip(lp.top_ids[i][:top], lp.top_logprobs[i][:top])
            entry = {self.token(t, skip_special): _finite(v) for t, v in alternatives}
            entry.setdefault(tokens[-1], logprobs[-1])  # the chosen token is always among them, as in vLLM
            tops.append(entry)
        offsets = []
        for token in tokens:
            offsets.append(text_offset)
            text_offset += len(token)
        return {"tokens": tokens, "token_logprobs": logprobs, "top_logprobs": tops, "text_offset": offsets}

    def chat(self, lp: Logprobs, skip_special: bool = True) -> list[dict]:
        """The chat layout's `content` list for `lp`'s tokens."""
        return [{**self._entry(token_id, lp.logprobs[i], skip_special),
                 "top_logprobs": [self._entry(t, v, skip_special) for t, v in zip(lp.top_ids[i], lp.top_logprobs[i])]}
                for i, token_id in enumerate(lp.token_ids)]

    def vllm_prompt(self, lp: Logprobs, skip_special: bool = True, top: int | None = None) -> list:
        """vLLM's `prompt_logprobs`: null for the first token, then per token {id: {logprob, rank,
        decoded_token}} for the token itself and its top alternatives (`top` at most)."""
        out: list = [None]
        for i, token_id in enumerate(lp.token_ids):
            entry = {str(t): {"logprob": _finite(v), "rank": rank + 1, "decoded_token": self.token(t, skip_special)}
                     for rank, (t, v) in enumerate(zip(lp.top_ids[i][:top], lp.top_logprobs[i][:top]))}
            entry[str(token_id)] = {"logprob": _finite(lp.logprobs[i]), "rank": lp.ranks[i],
                                    "decoded_token": self.token(token_id, skip_special)}
            out.append(entry)
        return out

    def _entry(self, token_id: int, logprob: float, skip_special: bool) -> dict:
        text = self.token(token_id, skip_special)
        return {"token": text, "logprob": _finite(logprob), "bytes": list(text.encode("utf-8"))}


def merge_completion(parts: list[dict]) -> dict:
    """One legacy logprobs object from several (the prompt's and the completion's)."""
    return {key: [x for part in parts for x in part[key]] for key in ("tokens", "token_logprobs", "top_logprobs",
                                                                      "text_offset")}
