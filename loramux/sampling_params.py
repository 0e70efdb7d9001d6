"""SamplingParams: how one request is decoded. Stdlib only (the server validates with it)."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 16
    """New tokens to generate at most (finish_reason "length" when reached)."""
    temperature: float = 1.0
    """0 = greedy (argmax)."""
    top_p: float = 1.0
    """Nucleus sampling: keep the smallest set of tokens whose probability adds up to top_p."""
    top_k: int = -1
    """Keep the k most likely tokens; -1 (or 0) = all."""
    seed: int | None = None
    """Per-request seed: the same seed gives the same tokens whatever the batch mates."""
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
        checks = [
            ("max_tokens", self.max_tokens >= 1, "must be >= 1"),
            ("temperature", self.temperature >= 0, "must be >= 0"),
            ("top_p", 0 < self.top_p <= 1, "must be in (0, 1]"),
            ("top_k", self.top_k == -1 or self.top_k >= 0, "must be -1 (all) or >= 0"),
            ("presence_penalty", -2 <= self.presence_penalty <= 2, "must be in [-2, 2]"),
            ("frequency_penalty", -2 <= self.frequency_penalty <= 2, "must be in [-2, 2]"),
        ]
        for name, ok, rule in checks:
            if not ok:
                raise ValueError(f"{name} {rule}, got {getattr(self, name)!r}")
        if any(not s for s in self.stop):
            raise ValueError("stop strings must not be empty")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0
