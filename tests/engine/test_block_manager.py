"""BlockManager: allocate / append / free / reuse, the errors on misuse, and the prefix cache — plain cases,
then a model-based test (hypothesis) of random allocations, appends, steps that compute K/V, frees and resets
over a small token alphabet (so prefixes collide), checking the invariants after every operation. No torch."""
import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule, run_state_machine_as_test

from loramux.engine.block_manager import BlockManager
from loramux.engine.sequence import Sequence
from loramux.sampling_params import SamplingParams


def seq_of(num_tokens: int) -> Sequence:
    return Sequence(prompt_token_ids=list(range(num_tokens)), params=SamplingParams(max_tokens=8))


@pytest.mark.parametrize(
    "num_blocks, block_size, num_tokens, can, blocks_used",
    [
        (4, 4, 1, True, 1),
        (4, 4, 4, True, 1),
        (4, 4, 5, True, 2),
        (4, 4, 16, True, 4),
        (4, 4, 17, False, 0),
        (1, 16, 16, True, 1),
    ],
)
def test_allocate(num_blocks, block_size, num_tokens, can, blocks_used):
    bm = BlockManager(num_blocks, block_size)
    seq = seq_of(num_tokens)
    assert bm.can_allocate(seq) == can
    if can:
        bm.allocate(seq)
        assert len(seq.block_table) == blocks_used == len(set(seq.block_table))
    assert bm.num_free_blocks == num_blocks - blocks_used


@pytest.mark.parametrize(
    "prompt_len, new_tokens, blocks_after",
    [
        (4, 1, 2),  # position 4 starts block 2
        (3, 1, 1),  # position 3 is the last slot of block 1
        (4, 4, 2),
        (4, 5, 3),
        (1, 7, 2),
    ],
)
def test_append_one_token_per_step(prompt_len, new_tokens, blocks_after):
    bm = BlockManager(8, 4)
    seq = seq_of(prompt_len)
    bm.allocate(seq)
    for _ in range(new_tokens):
        seq.append_token(0)
        assert bm.can_append(seq)
        bm.may_append(seq)
    assert len(seq.block_table) == blocks_after
    assert bm.num_free_blocks == 8 - blocks_after


def test_can_append_without_a_free_block():
    bm = BlockManager(1, 4)
    seq = seq_of(3)
    bm.allocate(seq)
    seq.append_token(0)  # position 3: still in block 0
    assert bm.can_append(seq)
    bm.may_append(seq)
    seq.append_token(0)  # position 4: needs a second block, none free
    assert not bm.can_append(seq)
    with pytest.raises(RuntimeError, match="no free block"):
        bm.may_append(seq)


def test_deallocate_frees_and_blocks_are_reused():
    bm = BlockManager(3, 4)
    a, b = seq_of(8), seq_of(4)
    bm.allocate(a)
    bm.allocate(b)
    held = set(a.block_table)
    bm.deallocate(a)
    assert a.block_table == []
    assert bm.num_free_blocks == 2
    c = seq_of(8)
    bm.allocate(c)
    assert set(c.block_table) == held
    assert not set(c.block_table) & set(b.block_table)


def test_blocks_are_conserved_over_many_cycles():
    bm = BlockManager(5, 2)
    for n in (1, 3, 10, 2, 9, 4):
        seq = seq_of(n)
        bm.allocate(seq)
        bm.deallocate(seq)
    assert bm.num_free_blocks == 5


def allocate_twice(bm, seq):
    bm.allocate(seq)
    bm.allocate(seq)


def allocate_without_room(bm, seq):
    bm.allocate(seq_of(9))


def double_free(bm, seq):
    bm.allocate(seq)
    bm.deallocate(seq)
    bm.deallocate(seq)


def free_a_copied_table(bm, seq):
    bm.allocate(seq)
    twin = seq_of(4)
    twin.block_table = list(seq.block_table)
    bm.deallocate(seq)
    bm.deallocate(twin)


def skip_a_step(bm, seq):
    bm.allocate(seq)
    for _ in range(5):  # positions 4..8: two new blocks needed at once
        seq.append_token(0)
    bm.may_append(seq)


@pytest.mark.parametrize(
    "misuse, words",
    [
        (allocate_twice, "already holds"),
        (allocate_without_room, "needs 3 blocks"),
        (double_free, "double free"),
        (lambda bm, seq: bm.deallocate(seq), "holds no blocks"),
        (free_a_copied_table, "not allocated"),
        (skip_a_step, "more than one"),
    ],
)
def test_misuse_raises(misuse, words):
    bm = BlockManager(2, 4)
    with pytest.raises(RuntimeError, match=words):
        misuse(bm, seq_of(4))


@pytest.mark.parametrize("num_blocks, block_size", [(0, 4), (4, 0), (-1, 16)])
def test_bad_sizes(num_blocks, block_size):
    with pytest.raises(ValueError, match="positive integer"):
        BlockManager(num_blocks, block_size)


def seq(tokens, salt=b"base", **params) -> Sequence:
    """A sequence that reads and fills the prefix cache under `salt` (as admission sets it)."""
    s = Sequence(list(tokens), SamplingParams(max_tokens=8, **params))
    s.cache_salt = salt
    return s


def computed(bm: BlockManager, s: Sequence) -> None:
    """A step ran over all of s's tokens: their K/V are in its blocks."""
    s.num_computed_tokens = len(s)
    bm.cache_computed(s)


# ---- the prefix cache ---------------------------------------------------------------------------------
def test_a_computed_prefix_is_shared_and_the_last_token_is_always_computed():
    bm = BlockManager(num_blocks=16, block_size=4)
    first = seq(range(1, 13))  # 12 tokens: 3 full blocks
    assert bm.allocate(first) == 0
    computed(bm, first)
    second = seq([*range(1, 13), 50, 51])  # the same 12, then 2 more
    assert bm.allocate(second) == 12 and second.block_table[:3] == first.block_table
    again = seq(range(1, 13))  # the whole prompt cached: its last block is computed again (logits, no writes)
    assert bm.allocate(again) == 8 and again.block_table[:2] == first.block_table[:2]
    assert again.block_table[2] != first.block_table[2]
    assert (bm.queries, bm.hits) == (12 + 14 + 12, 12 + 8)


def test_a_hit_ends_at_the_last_full_block_of_the_common_prefix():
    bm = BlockManager(num_blocks=16, block_size=4)
    first = seq([1, 2, 3, 4, 5, 6, 7, 8, 9])
    bm.allocate(first)
    computed(bm, first)
    other = seq([1, 2, 3, 4, 5, 6, 99, 8, 9, 10])  # differs inside block 2
    assert bm.allocate(other) == 4 and other.block_table[0] == first.block_table[0]


@pytest.mark.parametrize("salts", [(b"base", b"lora:1"), (b"lora:1", b"lora:2")])
def test_different_adapters_or_loads_share_no_block(salts):
    """The chain starts with the adapter identity: the same tokens under another adapter, or another load of
    the same adapter, find nothing."""
    bm = BlockManager(num_blocks=16, block_size=4)
    first = seq(range(1, 10), salt=salts[0])
    bm.allocate(first)
    computed(bm, first)
    second = seq(range(1, 10), salt=salts[1])
    assert bm.allocate(second) == 0 and not set(first.block_table) & set(second.block_table)


def test_a_freed_block_stays_cached_until_an_allocation_needs_it():
    bm = BlockManager(num_blocks=4, block_size=4)
    first = seq(range(1, 10))  # 3 blocks, 2 full ones cached once computed
    bm.allocate(first)
    computed(bm, first)
    bm.deallocate(first)
    assert bm.num_free_blocks == 4 and bm.num_cached_blocks == 2  # cached blocks count as free
    back = seq(range(1, 10))
    assert bm.allocate(back) == 8  # still there
    bm.deallocate(back)
    evict = seq(range(100, 116))  # needs all 4 blocks: the cached ones go
    assert bm.allocate(evict) == 0 and bm.num_cached_blocks == 0
    bm.deallocate(evict)
    assert bm.allocate(seq(range(1, 10))) == 0


def test_prompt_logprobs_requests_read_nothing_from_the_cache_but_fill_it():
    bm = BlockManager(num_blocks=16, block_size=4)
    first = seq(range(1, 10))
    bm.allocate(first)
    computed(bm, first)
    scored = seq(range(1, 10), prompt_logprobs=2)
    assert bm.allocate(scored) == 0 and not bm.in_flight(scored)


def test_a_sequence_waits_for_blocks_another_one_is_computing():
    bm = BlockManager(num_blocks=16, block_size=4)
    first, twin = seq(range(1, 10)), seq(range(1, 10))
    bm.allocate(first)
    assert bm.in_flight(twin)  # its first block is being computed by `first`
    first.num_computed_tokens = 4
    bm.cache_computed(first)  # block 0 done: the next one is still in flight
    assert bm.in_flight(twin)
    computed(bm, first)
    assert not bm.in_flight(twin) and bm.allocate(twin) == 8
    bm.deallocate(first)
    bm.deallocate(twin)
    assert not bm._in_flight


def test_reset_forgets_every_cached_block():
    bm = BlockManager(num_blocks=8, block_size=4)
    first = seq(range(1, 10))
    bm.allocate(first)
    computed(bm, first)
    assert bm.reset_cache() == 2 and bm.num_cached_blocks == 0
    assert bm.allocate(seq(range(1, 10))) == 0


# ---- a model-based test -------------------------------------------------------------------------------
class Blocks(RuleBasedStateMachine):
    """Sequences over tokens 1-3 and two salts, blocks of 2: prefixes collide often. `written` records what
    each block's K/V were computed from; a block handed out from the cache must hold its taker's prefix."""

    def __init__(self):
        super().__init__()
        self.bm = BlockManager(num_blocks=12, block_size=2)
        self.live: list[Sequence] = []
        self.own: dict[int, int] = {}  # seq_id -> index of its first block it writes itself (after the shared)
        self.written: dict[int, tuple] = {}  # block -> (salt, the tokens up to its end)

    def _prefix(self, s: Sequence, index: int) -> tuple:
        return s.cache_salt, tuple(s.token_ids[:2 * (index + 1)])

    @rule(tokens=st.lists(st.integers(1, 3), min_size=1, max_size=9), salt=st.sampled_from([b"a", b"b"]))
    def allocate(self, tokens, salt):
        s = seq(tokens, salt)
        if not self.bm.can_allocate(s) or self.bm.in_flight(s):
            return
        cached = self.bm.allocate(s)
        assert cached % 2 == 0 and cached < len(s)
        for i in range(cached // 2):
            assert self.written[s.block_table[i]] == self._prefix(s, i)
        s.num_computed_tokens = cached
        self.own[s.seq_id] = cached // 2
        self.live.append(s)

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def compute(self, data):
        s = data.draw(st.sampled_from(self.live))
        s.num_computed_tokens = len(s)
        for i in range(self.own[s.seq_id], len(s) // 2):
            self.written[s.block_table[i]] = self._prefix(s, i)
        self.bm.cache_computed(s)

    @precondition(lambda self: self.live)
    @rule(data=st.data(), token=st.integers(1, 3))
    def append(self, data, token):
        s = data.draw(st.sampled_from(self.live))
        if s.num_computed_tokens == len(s):
            s.append_token(token)
            if self.bm.can_append(s):
                self.bm.may_append(s)
            else:
                s.token_ids.pop()

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def free(self, data):
        s = data.draw(st.sampled_from(self.live))
        self.live.remove(s)
        self.bm.deallocate(s)

    @rule()
    def reset(self):
        self.bm.reset_cache()

    @invariant()
    def counts_agree(self):
        bm = self.bm
        users = {}
        for s in self.live:
            for b in s.block_table:
                users[b] = users.get(b, 0) + 1
        assert all(bm._refs[b] == users.get(b, 0) >= 0 for b in range(bm.num_blocks))
        assert set(bm._free) == {b for b in range(bm.num_blocks) if not users.get(b)}  # free xor in use
        for digest, block in bm._cached.items():  # a cached block holds what its hash says
            assert bm._block_hash[block] == digest and block in self.written
        assert sum(h is not None for h in bm._block_hash) == len(bm._cached)
        assert all(v > 0 for v in bm._in_flight.values())


def test_random_operations_keep_the_invariants():
    run_state_machine_as_test(Blocks, settings=settings(max_examples=300, stateful_step_count=40, deadline=None))
