"""BlockManager: which KV-cache blocks each sequence owns (paged attention bookkeeping). No torch.

The KV cache is `num_blocks` blocks of `block_size` token positions each. A sequence's `block_table`
lists its blocks in position order: token position p lives in block `block_table[p // block_size]`
at offset `p % block_size`. No prefix caching: every block has exactly one owner.
"""
from __future__ import annotations

from collections import deque

from loramux.engine.sequence import Sequence


class BlockManager:
    """Owns the free list; hands whole blocks to sequences and takes them back.

    Invariant: every block id is either in the free list or in exactly one sequence's block_table.
    Freed blocks go to the back of the free list (FIFO reuse).
    """

    def __init__(self, num_blocks: int, block_size: int):
        for name, value in (("num_blocks", num_blocks), ("block_size", block_size)):
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._free: deque[int] = deque(range(num_blocks))
        self._used: set[int] = set()

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    def can_allocate(self, seq: Sequence) -> bool:
        return seq.num_blocks_needed(self.block_size) <= len(self._free)

    def allocate(self, seq: Sequence) -> None:
        """Give `seq` blocks for all len(seq) tokens (a prefill writes K/V for every one of them)."""
        if seq.block_table:
            raise RuntimeError(f"sequence {seq.seq_id} already holds {len(seq.block_table)} blocks; "
                               "deallocate it before allocating again")
        needed = seq.num_blocks_needed(self.block_size)
        if needed > len(self._free):
            raise RuntimeError(f"sequence {seq.seq_id} needs {needed} blocks for {len(seq)} tokens but only "
                               f"{len(self._free)} are free; check can_allocate first")
        seq.block_table = [self._take() for _ in range(needed)]

    def can_append(self, seq: Sequence) -> bool:
        """Whether a decode step can write K/V for position len(seq) - 1."""
        return len(seq.block_table) >= seq.num_blocks_needed(self.block_size) or bool(self._free)

    def may_append(self, seq: Sequence) -> None:
        """Add a block when position len(seq) - 1 starts a new one (one token per decode step)."""
        missing = seq.num_blocks_needed(self.block_size) - len(seq.block_table)
        if missing <= 0:
            return
        if missing > 1:
            raise RuntimeError(f"sequence {seq.seq_id} is {missing} blocks short: it grew by more than one "
                               "token since its last step, or was never allocated")
        if not self._free:
            raise RuntimeError(f"no free block to extend sequence {seq.seq_id}; check can_append first")
        seq.block_table.append(self._take())

    def deallocate(self, seq: Sequence) -> None:
        """Return all of `seq`'s blocks; its cached K/V is gone (a preempted sequence re-prefills)."""
        if not seq.block_table:
            raise RuntimeError(f"sequence {seq.seq_id} holds no blocks: double free, or never allocated")
        foreign = [b for b in seq.block_table if b not in self._used]
        if foreign:
            raise RuntimeError(f"sequence {seq.seq_id} lists blocks {foreign} that are not allocated "
                               "(double free, or a block table copied from another sequence)")
        for block_id in seq.block_table:
            self._used.remove(block_id)
            self._free.append(block_id)
        seq.block_table = []

    def _take(self) -> int:
        block_id = self._free.popleft()
        self._used.add(block_id)
        return block_id
