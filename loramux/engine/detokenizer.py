"""Detokenizer: one request's text, released as it becomes final, cut at the first stop string. No torch.

Tokens are decoded incrementally with the `tokenizers` library's DecodeStream (each token once; a character
split across tokens comes out whole when its last byte arrives), so a request's text costs O(tokens), not
O(tokens^2) as re-decoding all of it every step did. Text that may be the start of a stop string is held
back until it is not, or until the request ends.
"""
from __future__ import annotations

from tokenizers.decoders import DecodeStream


class Detokenizer:
    def __init__(self, tokenizer, stop: tuple[str, ...] = (), skip_special_tokens: bool = True, min_tokens: int = 0):
        self.backend = tokenizer.backend  # a loramux.tokenizer.Tokenizer's tokenizers.Tokenizer
        self.stream = DecodeStream(skip_special_tokens=skip_special_tokens)
        self.stop = stop
        self._longest_stop = max((len(s) for s in stop), default=0)
        self.decoded = ""  # all text so far
        self.text = ""  # released so far (a prefix of `decoded`, cut at a stop string)
        self.stopped = False  # a stop string was found: the text is final
        self.min_tokens, self.num_tokens = min_tokens, 0  # stop strings count from min_tokens on (as vLLM)
        self._stop_from = 0  # a stop string must end after this position of `decoded`
        self.unused = 0  # tokens of the last update after the one whose text completed a stop string

    def update(self, new_token_ids: list[int], final: bool) -> tuple[str, bool]:
        """Add this step's tokens; returns (newly released text, hit a stop string). After a stop string
        nothing more is released."""
        if self.stopped:  # tokens the engine made before it heard of the stop
            return "", False
        ends = []  # len(decoded) after each token
        for token_id in new_token_ids:
            if self.num_tokens == self.min_tokens - 1:  # the min_tokens-th token: stops may end in its text on
                self._stop_from = len(self.decoded)
            self.num_tokens += 1
            piece = self.stream.step(self.backend, token_id)
            if piece:
                self.decoded += piece
            ends.append(len(self.decoded))
        found = self._find_stop() if self.num_tokens >= self.min_tokens else None  # (held back all the same)
        stop_at = None
        if found is not None:  # several tokens at once (speculative decoding): those after the stop are not used
            stop_at, stop_end = found
            self.unused = len(ends) - next((i + 1 for i, end in enumerate(ends) if end >= stop_end), len(ends))
            self.num_tokens -= self.unused
            self.decoded, final, self.stopped = self.decoded[:stop_at], True, True
        end = len(self.decoded) if final else len(self.decoded) - self._holdback()
        delta = self.decoded[len(self.text):end] if end > len(self.text) else ""
        self.text += delta
        return delta, stop_at is not None

    def take(self, new_token_ids: list[int], reason: str | None) -> tuple[str, bool, int]:
        """An engine output's new tokens (reason: its finish reason): (newly released text, hit a stop string,
        how many of the tokens count). An engine "stop" is a stop token, counted but left out of the text; tokens
        after a stop string that came in the same output (speculative decoding) do not count."""
        text_ids = new_token_ids[:-1] if reason == "stop" else new_token_ids
        delta, hit_stop = self.update(text_ids, final=reason is not None)
        unused = self.unused + len(new_token_ids) - len(text_ids) if hit_stop else 0
        return delta, hit_stop, len(new_token_ids) - unused

    def _find_stop(self) -> tuple[int, int] | None:
        """The first stop string in the text not yet released (released text never ends with the start of
        one: it is held back) that ends in the text of the min_tokens-th token or later (as vLLM): (where it
        starts, where it ends)."""
        hits = []
        for stop in self.stop:
            i = self.decoded.find(stop, len(self.text))
            while i >= 0 and i + len(stop) <= self._stop_from:
                i = self.decoded.find(stop, i + 1)
            if i >= 0:
                hits.append((i, i + len(stop)))
        return min(hits) if hits else None

    def _holdback(self) -> int:
        """The longest tail of the decoded text that is a proper prefix of some stop string."""
        for n in range(min(self._longest_stop - 1, len(self.decoded)), 0, -1):
            tail = self.decoded[-n:]
            if any(s.startswith(tail) for s in self.stop):
                return n
        return 0
