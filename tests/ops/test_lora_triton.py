"""The Triton LoRA kernels (ops/lora_triton.py) against the reference, in Triton's interpreter on CPU tensors
(tests/conftest.py sets TRITON_INTERPRET=1 where there is no GPU): the shapes the common backend tests do not
reach (several token blocks per slot, input and output dimensions across several blocks, slices that start
inside an output block, rank 64, fp16, decode- and prefill-like slot patterns)."""
import pytest
import torch

from loramux.ops import LoRAMapping, lora_triton, select_backend
from loramux.ops.lora_torch import add_lora_gathered
from loramux.ops.triton_tiles import LoRATiles

pytestmark = pytest.mark.skipif(not lora_triton.available("cpu"), reason="needs triton (its interpreter runs here)")

PATTERNS = {
    "decode": lambda n, slots: [t % slots for t in range(n)],  # one token per row, adapters interleaved
    "prefill": lambda n, slots: [s for s in range(slots) for _ in range(n // slots)],  # long runs per slot
    "mixed": lambda n, slots: [(-1 if t % 5 == 0 else (t * 7) % slots) for t in range(n)],
}


def _weights(num_slots, rank, n_in, slices, dtype, ranks):
    lora_a = torch.zeros(num_slots, len(slices) * rank, n_in, dtype=dtype)
    lora_b = torch.zeros(num_slots, sum(slices), rank, dtype=dtype)
    for slot, r in enumerate(ranks):
        for k in range(len(slices)):
            lora_a[slot, k * rank : k * rank + r] = torch.randn(r, n_in, dtype=dtype) * 0.2
        lora_b[slot, :, :r] = torch.randn(sum(slices), r, dtype=dtype) * 0.2
    return lora_a, lora_b.transpose(1, 2).contiguous().transpose(1, 2)  # rank-major, as LoRALinear stores it


@pytest.mark.parametrize("pattern", list(PATTERNS))
@pytest.mark.parametrize("rank, slices", [(8, (100,)), (16, (72, 24, 24)), (64, (96, 96))])
@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2), (torch.float16, 2e-3)])
def test_matches_reference(pattern, rank, slices, dtype, tol):
    torch.manual_seed(rank)
    num_slots, n_in, n_tokens = 4, 80, 40  # 80 inputs: two 64-wide chunks; 40 tokens of a slot: 3 token blocks
    ranks = [rank, max(1, rank // 2), rank, 0]  # slot 3 loaded with nothing (rank 0)
    lora_a, lora_b = _weights(num_slots, rank, n_in, slices, dtype, ranks)
    slots = PATTERNS[pattern](n_tokens, num_slots)
    x = torch.randn(len(slots), n_in, dtype=dtype)
    y0 = torch.randn(len(slots), sum(slices), dtype=dtype)
    mapping = LoRAMapping.from_slots(slots)
    expected = y0.clone().float()
    add_lora_gathered(expected, x.float(), lora_a.float(), lora_b.float(), mapping, slices)
    y = y0.clone()
    lora_triton.add_lora_triton(y, x, lora_a, lora_b, mapping, slices, torch.tensor(ranks))
    torch.testing.assert_close(y.float(), expected, atol=tol * 10, rtol=tol)
    untouched = torch.tensor([s in (-1, 3) for s in slots])  # base rows and the rank-0 slot's rows
    assert torch.equal(y[untouched], y0[untouched])


def test_slot_ranks_only_skip_zero_padding():
    """Without the hint every padded row is read (zeros); with it they are skipped: the same sums."""
    torch.manual_seed(3)
    lora_a, lora_b = _weights(3, 16, 32, (48, 16), torch.float32, [5, 16, 9])
    x, mapping = torch.randn(7, 32), LoRAMapping.from_slots([0, 2, 1, -1, 0, 2, 1])
    with_hint, without = torch.zeros(7, 64), torch.zeros(7, 64)
    lora_triton.add_lora_triton(with_hint, x, lora_a, lora_b, mapping, (48, 16), torch.tensor([5, 16, 9]))
    lora_triton.add_lora_triton(without, x, lora_a, lora_b, mapping, (48, 16))
    torch.testing.assert_close(with_hint, without, atol=1e-6, rtol=1e-6)


def test_the_slot_order_is_computed_once_per_mapping():
    mapping = LoRAMapping.from_slots([2, -1, 0, 2, 1])
    order, counts, starts = lora_triton.by_slot(mapping, 3)
    assert order.tolist() == [1, 2, 4, 0, 3] and counts.tolist() == [1, 1, 1, 2] and starts.tolist() == [0, 1, 2, 3]
    assert lora_triton.by_slot(mapping, 3)[0] is order


def test_more_slices_than_the_kernel_unrolls_are_refused():
    lora_a, lora_b = torch.zeros(1, 16, 8), torch.zeros(1, 16, 4)
    with pytest.raises(ValueError, match="at most 3 output slices"):
        lora_triton.add_lora_triton(torch.zeros(1, 16), torch.zeros(1, 8), lora_a, lora_b,
                                    LoRAMapping.from_slots([0]), (4, 4, 4, 4))


def test_backend_selection():
    assert select_backend("triton", "cpu") is lora_triton.add_lora_triton  # the interpreter runs it here
    assert select_backend("auto", "cpu") is not lora_triton.add_lora_triton  # CPUs keep the C++ kernel / torch


BLOCK_M = 16  # the wrapper's token block
UNEVEN = {  # tokens per slot around the token block (0, 1, BLOCK_M - 1, BLOCK_M, BLOCK_M + 1), base tokens
    "edges": ([0, 1, 15, 16, 17, 0, 33], 5),  # empty slots first and between busy ones
    "one_busy_slot": ([0, 0, 0, 40, 0], 3),
    "all_base": ([0, 0, 0], 21),
    "more_slots_than_tokens": ([1, 0] * 20, 2),
}


def _uneven_slots(counts, base, seed):
    """Token slots with counts[s] tokens of slot s and `base` of -1, shuffled (the kernels order them)."""
    slots = torch.tensor([s for s, c in enumerate(counts) for _ in range(c)] + [-1] * base)
    return slots[torch.randperm(len(slots), generator=torch.Generator().manual_seed(seed))].tolist()


@pytest.mark.parametrize("case", list(UNEVEN))
def test_work_items_cover_every_token_block_once(case):
    counts, base = UNEVEN[case]
    mapping = LoRAMapping.from_slots(_uneven_slots(counts, base, 0))
    work = lora_triton.work_items(mapping, len(counts), BLOCK_M)
    n = mapping.num_tokens
    assert work.shape[0] == -(-n // BLOCK_M) + min(len(counts), n) - 1 <= -(-n // BLOCK_M) + len(counts)
    pairs = [tuple(w) for w in work.tolist()]
    expected = [(s, b) for s, c in enumerate(counts) for b in range(-(-c // BLOCK_M))]
    assert pairs[: len(expected)] == expected  # each non-empty (slot, token block) once, base blocks none
    assert all(p == (-1, 0) for p in pairs[len(expected):])  # the rest: programs that return at once
    assert lora_triton.work_items(mapping, len(counts), BLOCK_M) is work  # once per forward pass


@pytest.mark.parametrize("case", list(UNEVEN))
@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_uneven_slot_counts_match_reference(case, dtype, tol):
    """A token block skipped or done twice (in h or in y) shows in some row."""
    counts, base = UNEVEN[case]
    torch.manual_seed(len(counts))
    num_slots, n_in, slices = len(counts), 24, (40, 30)
    lora_a, lora_b = _weights(num_slots, 8, n_in, slices, dtype, [8] * num_slots)
    slots = _uneven_slots(counts, base, 1)
    mapping = LoRAMapping.from_slots(slots)
    x, y0 = torch.randn(len(slots), n_in, dtype=dtype), torch.randn(len(slots), sum(slices), dtype=dtype)
    expected = y0.clone().float()
    add_lora_gathered(expected, x.float(), lora_a.float(), lora_b.float(), mapping, slices)
    y = y0.clone()
    lora_triton.add_lora_triton(y, x, lora_a, lora_b, mapping, slices)
    torch.testing.assert_close(y.float(), expected, atol=tol * 10, rtol=tol)
    base_rows = torch.tensor(slots) < 0
    assert torch.equal(y[base_rows], y0[base_rows])
    work = mapping._work_items[num_slots, BLOCK_M]  # the table the launch used: its axis 0
    assert work.shape[0] <= -(-len(slots) // BLOCK_M) + num_slots


@pytest.mark.parametrize("slices", [(50, 30, 45), (70, 3), (130, 5, 60), (10, 100, 20), (64, 1)],
                         ids=lambda s: "-".join(map(str, s)))
def test_slices_bounded_inside_column_blocks(slices):
    """Output widths off the 64-column block, slice bounds inside a block: a block touching one, two or three
    slices adds each slice's columns from its own h and B, and only those."""
    torch.manual_seed(sum(slices))
    rank, n_in, num_slots = 8, 16, 3
    lora_a, lora_b = _weights(num_slots, rank, n_in, slices, torch.float32, [8, 3, 8])
    slots = [0, 1, 2, -1, 2, 0] * 3 + [1] * 17  # slot 1: two token blocks
    mapping = LoRAMapping.from_slots(slots)
    x, y0 = torch.randn(len(slots), n_in), torch.randn(len(slots), sum(slices))
    expected = y0.clone()
    add_lora_gathered(expected, x, lora_a, lora_b, mapping, slices)
    y = y0.clone()
    lora_triton.add_lora_triton(y, x, lora_a, lora_b, mapping, slices, torch.tensor([8, 3, 8]))
    torch.testing.assert_close(y, expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("split", [2, 3, 5])
@pytest.mark.parametrize("pattern, n_tokens", [("decode", 1), ("decode", 6), ("mixed", 40)])
@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_split_k_pieces_sum_to_the_whole(split, pattern, n_tokens, dtype, tol):
    """The shrink's inputs cut into pieces (200 inputs: pieces of whole 16-wide steps, the last one short or
    empty), the expand adding the pieces' partials: the reference's sums, the same bits every run, and the same
    result as one piece up to the fp32 order of the partial sums."""
    torch.manual_seed(split + n_tokens)
    num_slots, n_in, slices = 4, 200, (72, 24, 24)
    lora_a, lora_b = _weights(num_slots, 16, n_in, slices, dtype, [16, 8, 16, 0])
    slots = PATTERNS[pattern](n_tokens, num_slots)
    mapping = LoRAMapping.from_slots(slots)
    x, y0 = torch.randn(len(slots), n_in, dtype=dtype), torch.randn(len(slots), sum(slices), dtype=dtype)
    expected = y0.clone().float()
    add_lora_gathered(expected, x.float(), lora_a.float(), lora_b.float(), mapping, slices)
    tiles = LoRATiles(block_k=16)
    runs = []
    for pieces in (split, split, 1):
        y = y0.clone()
        lora_triton.launch(y, x, lora_a, lora_b, mapping, slices, torch.tensor([16, 8, 16, 0]), tiles, pieces)
        runs.append(y)
    torch.testing.assert_close(runs[0].float(), expected, atol=tol * 10, rtol=tol)
    assert torch.equal(runs[0], runs[1])
    torch.testing.assert_close(runs[0], runs[2], atol=tol, rtol=tol)
