"""BlockManager: which KV-cache blocks each sequence uses, and the prefix cache over them (paged attention
bookkeeping). No torch.

The KV cache is `num_blocks` blocks of `block_size` token positions each. A sequence's `block_table` lists
its blocks in position order: token position p lives in block `block_table[p // block_size]` at offset
`p % block_size`.

Prefix caching (vLLM V1's design): a full block whose K/V are computed is known by a hash chained over the
previous block's hash and its own token ids, and the chain starts with the sequence's cache salt — its
adapter identity, or the base model's — so K/V computed under one adapter or one load of it are never
reused by another. A new sequence whose leading blocks are cached shares them (reference-counted) and starts
its prefill after them; the block holding its last prompt token is never taken from the cache (the logits
need that token computed, and a shared block is never written). A block whose last user leaves keeps its
hash in the free queue, evicted — least recently freed first, blocks without a hash before those with one —
only when an allocation needs it: cached blocks count as free. A sequence whose next blocks another one is
computing right now waits for them (`in_flight`) rather than computing them twice.

Invariants: a block is free (reference count 0, in the free queue) or used (count >= 1, not in it); a hash
maps to one block, which holds that hash; hashes are set only on blocks whose K/V are all computed.
"""
from __future__ import annotations

import hashlib
from array import array
from collections import Counter, OrderedDict

from loramux.engine.sequence import Sequence


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = True):
        for name, value in (("num_blocks", num_blocks), ("block_size", block_size)):
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        self.num_blocks, self.block_size, self.caching = num_blocks, block_size, enable_caching
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))  # evicted from the front
        self._refs = [0] * num_blocks
        self._block_hash: list[bytes | None] = [None] * num_blocks  # [num_blocks] a cached block's hash
        self._cached: dict[bytes, int] = {}  # hash -> the block holding it
        self._in_flight: Counter[bytes] = Counter()  # hashes of full prompt blocks being computed now
        self.queries = self.hits = 0  # prompt tokens looked up in the cache, and found there (metrics)

    @property
    def num_free_blocks(self) -> int:
        """Blocks an allocation can take: never used, freed, or cached and unused."""
        return len(self._free)

    @property
    def num_cached_blocks(self) -> int:
        return len(self._cached)

    # ---- prompts ---------------------------------------------------------------------------------
    def can_allocate(self, seq: Sequence) -> bool:
        return self._fits(seq, self._lookup(seq))

    def allocate(self, seq: Sequence) -> int:
        """Give `seq` blocks for all len(seq) tokens, its cached leading blocks shared; returns how many of its
        tokens are cached (its prefill starts there)."""
        if seq.block_table:
            raise RuntimeError(f"sequence {seq.seq_id} already holds {len(seq.block_table)} blocks; "
                               "deallocate it before allocating again")
        hits = self._lookup(seq)
        if not self._fits(seq, hits):
            raise RuntimeError(f"sequence {seq.seq_id} needs {seq.num_blocks_needed(self.block_size)} blocks for "
                               f"{len(seq)} tokens ({len(hits)} cached) but only {len(self._free)} are free; check "
                               "can_allocate first")
        for block in hits:
            if self._refs[block] == 0:
                del self._free[block]
            self._refs[block] += 1
        fresh = [self._take() for _ in range(seq.num_blocks_needed(self.block_size) - len(hits))]
        seq.block_table = hits + fresh
        seq.num_registered_blocks = len(hits)
        self._claim(seq)
        if seq.cache_salt is not None:
            self.queries += len(seq)
            self.hits += len(hits) * self.block_size
        return len(hits) * self.block_size

    def in_flight(self, seq: Sequence) -> bool:
        """Whether the first block `seq` would have to compute is being computed by another sequence now (it
        then waits a step or two and shares it, rather than computing it too)."""
        if not self._reads(seq):
            return False
        hashes = self._prompt_hashes(seq)
        index = len(self._lookup(seq))
        return index < len(hashes) and hashes[index] in self._in_flight

    # ---- decoding --------------------------------------------------------------------------------
    def can_append(self, seq: Sequence, lookahead: int = 0) -> bool:
        """Whether a decode step can write K/V for positions len(seq) - 1 .. len(seq) - 1 + lookahead (the
        proposed tokens of speculative decoding)."""
        return self._missing(seq, lookahead) <= len(self._free)

    def may_append(self, seq: Sequence, lookahead: int = 0) -> None:
        """Add the blocks positions up to len(seq) - 1 + lookahead need (a decode step: one token, and the
        `lookahead` proposed ones)."""
        missing = self._missing(seq, lookahead)
        if len(seq.block_table) < self._blocks_for(len(seq) - 1):
            raise RuntimeError(f"sequence {seq.seq_id} is {missing} blocks short: it grew by more than one "
                               "token since its last step, or was never allocated")
        if missing > len(self._free):
            raise RuntimeError(f"no free block to extend sequence {seq.seq_id}; check can_append first")
        seq.block_table += [self._take() for _ in range(missing)]

    def trim(self, seq: Sequence, lookahead: int = 0) -> None:
        """Give back the blocks past those its len(seq) + lookahead positions need: blocks of proposed tokens
        that were not accepted, or not proposed (never cached: only the blocks of computed, kept tokens are)."""
        keep = self._blocks_for(len(seq) + lookahead)
        for block in reversed(seq.block_table[keep:]):
            self._refs[block] -= 1
            if self._refs[block] == 0:
                self._free[block] = None
                self._free.move_to_end(block, last=False)
        del seq.block_table[keep:]

    def _missing(self, seq: Sequence, lookahead: int) -> int:
        return max(0, self._blocks_for(len(seq) + lookahead) - len(seq.block_table))

    def _blocks_for(self, positions: int) -> int:
        """Blocks that hold token positions 0 .. positions - 1."""
        return -(-positions // self.block_size)

    def cache_computed(self, seq: Sequence) -> None:
        """After a step: the full blocks whose K/V are now all computed become cached (prompt and output
        alike: a chat's next turn resends this one's answer)."""
        if not self._caches(seq):
            return
        full = seq.num_computed_tokens // self.block_size
        if full <= seq.num_registered_blocks:
            return
        hashes = self._hashes(seq, full)
        for index in range(seq.num_registered_blocks, full):
            block, digest = seq.block_table[index], hashes[index]
            if self._block_hash[block] is None and digest not in self._cached:
                self._cached[digest], self._block_hash[block] = block, digest
        self._release_claims(seq, below=full)
        seq.num_registered_blocks = full

    def deallocate(self, seq: Sequence) -> None:
        """Give back `seq`'s blocks; cached ones stay cached until evicted (a preempted sequence finds them
        when it resumes)."""
        if not seq.block_table:
            raise RuntimeError(f"sequence {seq.seq_id} holds no blocks: double free, or never allocated")
        foreign = [b for b in seq.block_table if self._refs[b] <= 0]
        if foreign:
            raise RuntimeError(f"sequence {seq.seq_id} lists blocks {foreign} that are not allocated "
                               "(double free, or a block table copied from another sequence)")
        self._release_claims(seq)
        for block in reversed(seq.block_table):  # its tail first: evicted before its head
            self._refs[block] -= 1
            if self._refs[block] == 0:
                self._free[block] = None
                if self._block_hash[block] is None:
                    self._free.move_to_end(block, last=False)  # nothing to lose: taken before cached ones
        seq.block_table = []
        seq.num_registered_blocks = 0

    def reset_cache(self) -> int:
        """Forget every cached hash (vLLM's reset_prefix_cache); blocks in use keep their K/V. Returns how many
        blocks were cached."""
        count = len(self._cached)
        for block in self._cached.values():
            self._block_hash[block] = None
        self._cached.clear()
        return count

    # ---- internals -------------------------------------------------------------------------------
    def _caches(self, seq: Sequence) -> bool:
        """Whether `seq`'s computed blocks join the cache (caching on, and its salt set at admission)."""
        return self.caching and seq.cache_salt is not None

    def _reads(self, seq: Sequence) -> bool:
        """Whether `seq` may also start from cached blocks (not a prefill that scores its whole prompt)."""
        return self._caches(seq) and seq.reads_cache

    def _fits(self, seq: Sequence, hits: list[int]) -> bool:
        """Whether the free queue holds `seq`'s fresh blocks and its cached ones that nobody uses now."""
        fresh = seq.num_blocks_needed(self.block_size) - len(hits)
        return fresh + sum(self._refs[b] == 0 for b in hits) <= len(self._free)

    def _lookup(self, seq: Sequence) -> list[int]:
        """The cached blocks `seq` can start with: its leading full prompt blocks found in the cache, never the
        block of its last token; none for a sequence that does not read the cache."""
        if not self._reads(seq):
            return []
        blocks = []
        for digest in self._prompt_hashes(seq):
            block = self._cached.get(digest)
            if block is None:
                break
            blocks.append(block)
        return blocks

    def _prompt_hashes(self, seq: Sequence) -> list[bytes]:
        """The hashes of the full blocks before the one holding `seq`'s last token."""
        return self._hashes(seq, (len(seq) - 1) // self.block_size)

    def _hashes(self, seq: Sequence, count: int) -> list[bytes]:
        """The chain of `seq`'s first `count` block hashes (computed once, kept on the sequence). It starts from
        the salt of what computed the first block: the adapter identity's, or for an aLoRA request whose
        invocation comes later, the base model's; the first block its adapter acts in mixes in the identity's, so
        the blocks before it are the base model's requests' own."""
        hashes, size = seq.block_hashes, self.block_size
        first_salt = seq.cache_salt if seq.activation == 0 else seq.base_salt
        while len(hashes) < count:
            i = len(hashes)
            previous = hashes[-1] if hashes else hashlib.sha256(first_salt).digest()
            if seq.activation and i * size <= seq.activation < (i + 1) * size:
                previous = hashlib.sha256(previous + seq.cache_salt).digest()
            tokens = array("q", seq.token_ids[i * size:(i + 1) * size]).tobytes()
            hashes.append(hashlib.sha256(previous + tokens).digest())
        return hashes[:count]

    def _claim(self, seq: Sequence) -> None:
        """The full prompt blocks `seq` will compute are in flight until they are cached or it lets go."""
        if self._caches(seq):
            hashes = self._prompt_hashes(seq)
            seq.claims = list(enumerate(hashes))[seq.num_registered_blocks:]
            self._in_flight.update(digest for _, digest in seq.claims)

    def _release_claims(self, seq: Sequence, below: int | None = None) -> None:
        """Let go of `seq`'s claims on blocks before index `below` (None: all of them)."""
        kept = []
        for index, digest in seq.claims:
            if below is not None and index >= below:
                kept.append((index, digest))
                continue
            self._in_flight[digest] -= 1
            if not self._in_flight[digest]:
                del self._in_flight[digest]
        seq.claims = kept

    def _take(self) -> int:
        """The front free block, its cached hash (if any) evicted."""
        block, _ = self._free.popitem(last=False)
        digest = self._block_hash[block]
        if digest is not None:
            del self._cached[digest]
            self._block_hash[block] = None
        self._refs[block] = 1
        return block
