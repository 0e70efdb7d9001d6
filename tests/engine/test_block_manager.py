"""BlockManager: allocate / append / free / reuse, and the errors on misuse. No torch here."""
import pytest

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
