"""StepCost: how long the engine's steps take, learned from the steps it runs. No torch.

Chunked prefill mixes decode rows (one token for each running stream) with prompt chunks. A long prompt's
chunk can make a step many times longer than a decode step, and every stream, and every request that
arrives meanwhile, then waits that long. The scheduler bounds a step to about `slowdown` times a decode-only
step: `prompt_allowance()` says how many prompt tokens that leaves, from two running estimates (exponential
moving averages): the time of a decode-only step, and what each prompt token adds to a step. Until both are
known there is no bound but the token budget. The price: a long prompt alone is prefilled in smaller chunks
(each step's fixed cost is paid more often).
"""
from __future__ import annotations

MIN_CHUNK = 16  # prompt tokens a step that decodes may always carry: every prompt moves on


class StepCost:
    def __init__(self, slowdown: float | None, smoothing: float = 0.2):
        """slowdown: the most a step that decodes should take against its decode rows alone (None: no bound)."""
        if slowdown is not None and not slowdown > 1:
            raise ValueError(f"the step slowdown bound must be > 1, got {slowdown!r}")
        self.slowdown, self.smoothing = slowdown, smoothing
        self.decode_s: float | None = None  # a decode-only step
        self.token_s: float | None = None  # what one prompt token adds to a step

    def observe(self, decode_rows: int, prompt_tokens: int, seconds: float) -> None:
        """A step ran: its decode rows, its prompt tokens and its wall time."""
        if prompt_tokens == 0:
            if decode_rows:
                self.decode_s = self._blend(self.decode_s, seconds)
            return
        base = self.decode_s if decode_rows and self.decode_s is not None else 0.0
        self.token_s = self._blend(self.token_s, max(seconds - base, 0.0) / prompt_tokens)

    def prompt_allowance(self) -> int | None:
        """Prompt tokens a step may carry (None: no bound beyond the token budget)."""
        if self.slowdown is None or self.decode_s is None or not self.token_s:
            return None
        return max(MIN_CHUNK, int((self.slowdown - 1) * self.decode_s / self.token_s))

    def _blend(self, old: float | None, new: float) -> float:
        return new if old is None else old + self.smoothing * (new - old)
