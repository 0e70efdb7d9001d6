"""SamplingParams: how one request is decoded. Stdlib only (the server validates with it).

Every field is checked here, once, when the params are made (the offline API and the HTTP server both
build them), so that nothing a user sends can fail inside an engine step: a step serves every request.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

SEED_MIN, SEED_MAX = -(2**63), 2**63 - 1  # a signed 64-bit integer, as vLLM and torch take it
_SEED_RULE = f"must be an integer in [{SEED_MIN}, {SEED_MAX}]"
GREEDY_BELOW = 1e-5
"""A temperature below this decodes greedily (as vLLM's _SAMPLING_EPS): dividing logits by 1e-40 gives inf
and NaN probabilities."""


def choice_seed(seed: int | None, index: int) -> int | None:
    """The seed of choice `index` of a request with n > 1: seed + index, wrapped into the signed 64-bit range.
    `seed` itself must be in that range (ValueError otherwise): wrapping must not hide a bad value."""
    if seed is None:
        return None
    if not (_is_int(seed) and SEED_MIN <= seed <= SEED_MAX):
        raise ValueError(f"seed {_SEED_RULE}, got {seed!r}")
    return (seed + index - SEED_MIN) % 2**64 + SEED_MIN


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 16
    """New tokens to generate at most (finish_reason "length" when reached)."""
    temperature: float = 1.0
    """0 (or below 1e-5) = greedy (argmax)."""
    top_p: float = 1.0
    """Nucleus sampling: keep the smallest set of tokens whose probability adds up to top_p."""
    top_k: int = -1
    """Keep the k most likely tokens; -1 (or 0) = all."""
    seed: int | None = None
    """Per-request seed (a signed 64-bit integer): the same seed gives the same tokens whatever the batch mates."""
    stop: tuple[str, ...] = ()
    """Stop strings: generation ends when the text contains one; it is left out of the output."""
    stop_token_ids: tuple[int, ...] = ()
    """Token ids that end generation (kept in token_ids, left out of the text)."""
    ignore_eos: bool = False
    """Keep generating past the end-of-sequence token."""
    presence_penalty: float = 0.0
    """Subtracted from the logit of every token already generated (OpenAI semantics, -2..2)."""
    frequency_penalty: float = 0.0
    """Subtracted once per earlier occurrence of a generated token (OpenAI semantics, -2..2)."""
    skip_special_tokens: bool = True

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        object.__setattr__(self, "stop", tuple(self.stop or ()))
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids or ()))
        for name, ok, rule in self._checks():
            if not ok:
                raise ValueError(f"{name} {rule}, got {getattr(self, name)!r}")

    def _checks(self):
        t, p = self.temperature, self.top_p
        return [
            ("max_tokens", _is_int(self.max_tokens) and self.max_tokens >= 1, "must be an integer >= 1"),
            ("temperature", _is_number(t) and t >= 0, "must be a finite number >= 0"),
            ("top_p", _is_number(p) and 0 < p <= 1, "must be in (0, 1]"),
            ("top_k", _is_int(self.top_k) and self.top_k >= -1, "must be -1 (all) or an integer >= 0"),
            ("seed", self.seed is None or (_is_int(self.seed) and SEED_MIN <= self.seed <= SEED_MAX), _SEED_RULE),
            ("presence_penalty", _is_number(self.presence_penalty) and -2 <= self.presence_penalty <= 2,
             "must be in [-2, 2]"),
            ("frequency_penalty", _is_number(self.frequency_penalty) and -2 <= self.frequency_penalty <= 2,
             "must be in [-2, 2]"),
            ("stop", all(isinstance(s, str) and s for s in self.stop), "must be non-empty strings"),
            ("stop_token_ids", all(_is_int(i) and i >= 0 for i in self.stop_token_ids),
             "must be non-negative integers"),
        ]

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW
