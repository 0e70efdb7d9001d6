"""Detokenizer: one request's text, released as it becomes final, cut at the first stop string.

Text is held back while it could still change: a trailing replacement character (a UTF-8 sequence
split across tokens) or a tail that may be the start of a stop string.
"""
from __future__ import annotations


class Detokenizer:
    def __init__(self, tokenizer, stop: tuple[str, ...] = (), skip_special_tokens: bool = True):
        self.tokenizer = tokenizer
        self.stop = stop
        self.skip_special_tokens = skip_special_tokens
        self.text = ""  # released so far

    def update(self, token_ids: list[int], final: bool) -> tuple[str, bool]:
        """Decode `token_ids` (all output tokens); returns (newly released text, hit a stop string)."""
        full = self.tokenizer.decode(token_ids, skip_special_tokens=self.skip_special_tokens)
        stop_at = self._find_stop(full)
        if stop_at is not None:
            full, final = full[:stop_at], True
        end = len(full) if final else len(full) - self._holdback(full)
        delta = full[len(self.text):end] if end > len(self.text) else ""
        self.text += delta
        return delta, stop_at is not None

    def _find_stop(self, text: str) -> int | None:
        # Only text not yet released can hold a new stop string (plus the overlap at its start).
        start = max(0, len(self.text) - max((len(s) for s in self.stop), default=0))
        hits = [i for i in (text.find(s, start) for s in self.stop) if i >= 0]
        return min(hits) if hits else None

    def _holdback(self, text: str) -> int:
        if text.endswith("\ufffd"):
            return len(text) - len(text.rstrip("\ufffd"))
        for n in range(max((len(s) for s in self.stop), default=1) - 1, 0, -1):
            if any(s.startswith(text[-n:]) for s in self.stop) and len(text) >= n:
                return n
        return 0
