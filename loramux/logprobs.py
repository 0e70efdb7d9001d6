"""Logprobs: log-probabilities at a run of positions, as the sampler computes them and the engine sends them
(a compact msgspec struct; no torch)."""
from __future__ import annotations

import msgspec


class Logprobs(msgspec.Struct, array_like=True, gc=False):
    """Log-probabilities at a run of positions, one column per field (position i = index i of each list):
    the token at that position, its logprob and rank (1 = the most likely), and the top alternatives
    (ids and logprobs, most likely first; as many as the request asked for)."""

    token_ids: list[int] = []
    logprobs: list[float] = []
    ranks: list[int] = []
    top_ids: list[list[int]] = []
    top_logprobs: list[list[float]] = []

    def __len__(self) -> int:
        return len(self.token_ids)

    def extend(self, other: Logprobs) -> None:
        for name in self.__struct_fields__:
            getattr(self, name).extend(getattr(other, name))

    def slice(self, start: int, stop: int | None = None) -> Logprobs:
        return Logprobs(*(getattr(self, name)[start:stop] for name in self.__struct_fields__))
