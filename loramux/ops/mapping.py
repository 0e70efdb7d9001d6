"""LoRAMapping: which device slot each token of one forward pass uses. Slot -1 = the base model.

The LoRA layers of a model share one mapping per forward pass; they only read it. Two builders
cover the cases where the token count is only known inside the forward (HF models, `switch()`):
`RowSlots` (one slot per batch row) and `UniformSlot` (one slot for every token). Each caches the
LoRAMapping per token count, so the first layer builds it and the others reuse it.
"""
from __future__ import annotations

import functools
from collections.abc import Sequence

import torch


def segments_of(token_slots: Sequence[int]) -> tuple[tuple[int, int, int], ...]:
    """Maximal runs of equal slot as (slot, start, end), base (-1) runs left out (as LoRAX's segments)."""
    runs = []
    start = 0
    for i in range(1, len(token_slots) + 1):
        if i == len(token_slots) or token_slots[i] != token_slots[start]:
            if token_slots[start] >= 0:
                runs.append((int(token_slots[start]), start, i))
            start = i
    return tuple(runs)


class LoRAMapping:
    """token_slots: [num_tokens] int64 (-1 = base); segments: (slot, start, end) runs with slot >= 0,
    computed on first use (only the segmented backend needs them)."""

    def __init__(self, token_slots: torch.Tensor, segments: tuple[tuple[int, int, int], ...] | None = None,
                 host_slots: Sequence[int] | None = None):
        """host_slots: token_slots' values as the caller has them on the host, where segments and one_slot are
        read from (token_slots on a GPU would have to be waited for)."""
        self.token_slots = token_slots
        self._host_slots = host_slots
        if segments is not None:
            self.segments = segments

    @functools.cached_property
    def segments(self) -> tuple[tuple[int, int, int], ...]:
        return segments_of(self._host_slots if self._host_slots is not None else self.token_slots.tolist())

    @functools.cached_property
    def one_slot(self) -> int:
        """The slot of a one-token pass (batch-1 decode) as an int, read once for all its layers; -1 otherwise."""
        if self.num_tokens != 1:
            return -1
        return int(self._host_slots[0] if self._host_slots is not None else self.token_slots[0])

    @classmethod
    def from_slots(cls, token_slots: Sequence[int], device: torch.device | str = "cpu") -> LoRAMapping:
        return cls(torch.tensor(token_slots, dtype=torch.long, device=device))

    @classmethod
    def from_host(cls, token_slots: Sequence[int], device: torch.device | str = "cpu") -> LoRAMapping:
        """As from_slots, keeping the host list (host_slots), the copy to a GPU not waited for (a pageable
        source is staged at once; a plain copy to the device would wait for the stream)."""
        slots = list(token_slots)
        return cls(torch.tensor(slots, dtype=torch.long).to(device, non_blocking=True), host_slots=slots)

    @property
    def host_slots(self) -> Sequence[int] | None:
        """token_slots as the host has them, where the builder gave them (else None: only the device has them)."""
        return self._host_slots

    @property
    def num_tokens(self) -> int:
        return self.token_slots.shape[0]

    def for_tokens(self, num_tokens: int) -> LoRAMapping:
        if num_tokens != self.num_tokens:
            raise ValueError(f"LoRA mapping covers {self.num_tokens} tokens, the forward pass has {num_tokens}")
        return self


class RowSlots:
    """One slot per batch row; rows are padded to one length (HF models: x is [rows, seq, hidden])."""

    one_slot = -1  # (LoRAMapping's: the token count is known only per forward, so the general path)

    def __init__(self, row_slots: Sequence[int], device: torch.device | str = "cpu"):
        self.row_slots = [int(s) for s in row_slots]
        self.device = device
        self._by_count: dict[int, LoRAMapping] = {}

    def for_tokens(self, num_tokens: int) -> LoRAMapping:
        if num_tokens not in self._by_count:
            rows = len(self.row_slots)
            if num_tokens % rows:
                raise ValueError(f"{num_tokens} tokens cannot be split into {rows} equal rows")
            per_row = num_tokens // rows
            slots = [s for s in self.row_slots for _ in range(per_row)]
            self._by_count[num_tokens] = LoRAMapping.from_slots(slots, self.device)
        return self._by_count[num_tokens]


class UniformSlot:
    """Every token uses one slot: single-adapter mode. No per-token gather is ever needed."""

    one_slot = -1  # (LoRAMapping's: the token count is known only per forward, so the general path)

    def __init__(self, slot: int, device: torch.device | str = "cpu"):
        self.slot = slot
        self.device = device
        self._by_count: dict[int, LoRAMapping] = {}

    def for_tokens(self, num_tokens: int) -> LoRAMapping:
        if num_tokens not in self._by_count:
            slots = torch.full((num_tokens,), self.slot, dtype=torch.long, device=self.device)
            segments = ((self.slot, 0, num_tokens),) if self.slot >= 0 and num_tokens else ()
            self._by_count[num_tokens] = LoRAMapping(slots, segments)
        return self._by_count[num_tokens]
