"""The Triton LoRA kernels (ops/lora_triton.py) against the reference, in Triton's interpreter on CPU tensors
(tests/conftest.py sets TRITON_INTERPRET=1 where there is no GPU): the shapes the common backend tests do not
reach (several token blocks per slot, input and output dimensions across several blocks, slices that start
inside an output block, rank 64, fp16, decode- and prefill-like slot patterns)."""
import pytest
import torch

from loramux.ops import LoRAMapping, lora_triton, select_backend
from loramux.ops.lora_torch import add_lora_gathered

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
