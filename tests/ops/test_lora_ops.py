"""Every backend against the per-token loop that defines the op."""
import os
import subprocess
import sys
import textwrap

import pytest
import torch

from conftest import backend_params
from loramux.ops import BACKENDS, LoRAMapping, RowSlots, UniformSlot, lora_cpu
from loramux.ops.cpu_extension import load_extension
from loramux.ops.lora_torch import add_lora_gathered
from loramux.ops.mapping import segments_of


def per_token_loop(y, x, lora_a, lora_b, token_slots):
    for t, s in enumerate(token_slots.tolist()):
        if s >= 0:
            y[t] += lora_b[s] @ (lora_a[s] @ x[t])


@pytest.mark.parametrize(
    "slots, segments",
    [
        ([], ()),
        ([-1, -1], ()),
        ([0, 0, 1, -1, 1], ((0, 0, 2), (1, 2, 3), (1, 4, 5))),
        ([2, 2, 2], ((2, 0, 3),)),
        ([-1, 3, 3, -1], ((3, 1, 3),)),
    ],
)
def test_segments(slots, segments):
    assert segments_of(slots) == segments


@pytest.mark.parametrize("backend", backend_params(BACKENDS, lora_cpu.available))
@pytest.mark.parametrize("dtype, atol", [(torch.float32, 1e-5), (torch.bfloat16, 3e-2)])
@pytest.mark.parametrize("order", ["sorted", "shuffled"])
@pytest.mark.parametrize("b_layout", ["out-major", "rank-major"])  # rank-major: as LoRALinear stores it
def test_backend_matches_per_token_loop(backend, dtype, atol, order, b_layout):
    torch.manual_seed(0)
    num_slots, rank, n_in, n_out, n_tokens = 5, 8, 24, 40, 37
    x = torch.randn(n_tokens, n_in, dtype=dtype)
    lora_a = torch.randn(num_slots, rank, n_in, dtype=dtype) * 0.3
    lora_b = torch.randn(num_slots, n_out, rank, dtype=dtype) * 0.3
    if b_layout == "rank-major":
        lora_b = lora_b.transpose(1, 2).contiguous().transpose(1, 2)
    slots = torch.randint(-1, num_slots, (n_tokens,))
    if order == "sorted":
        slots = slots.sort().values
    y0 = torch.randn(n_tokens, n_out, dtype=dtype)
    expected = y0.float().clone()
    per_token_loop(expected, x.float(), lora_a.float(), lora_b.float(), slots)
    y = y0.clone()
    BACKENDS[backend](y, x, lora_a, lora_b, LoRAMapping.from_slots(slots.tolist()))
    torch.testing.assert_close(y.float(), expected, atol=atol * 10, rtol=atol)
    base_rows = slots < 0
    assert torch.equal(y[base_rows], y0[base_rows])  # slot -1 rows are untouched, bit for bit


def test_row_and_uniform_mappings_expand_per_token_count():
    rows = RowSlots([1, -1, 0])
    mapping = rows.for_tokens(6)
    assert mapping.token_slots.tolist() == [1, 1, -1, -1, 0, 0] and rows.for_tokens(6) is mapping
    assert rows.for_tokens(3).token_slots.tolist() == [1, -1, 0]
    with pytest.raises(ValueError, match="7 tokens"):
        rows.for_tokens(7)
    assert UniformSlot(2).for_tokens(4).segments == ((2, 0, 4),)
    with pytest.raises(ValueError, match="covers 2 tokens"):
        LoRAMapping.from_slots([0, 0]).for_tokens(3)


def block_diagonal(lora_b, slices):
    """The packed layout spelled out: slice k's output rows read shrunk rows [k*rank, (k+1)*rank)."""
    num_slots, out, rank = lora_b.shape
    full = torch.zeros(num_slots, out, len(slices) * rank, dtype=lora_b.dtype)
    row = 0
    for k, size in enumerate(slices):
        full[:, row : row + size, k * rank : (k + 1) * rank] = lora_b[:, row : row + size]
        row += size
    return full


# (activations, LoRA weights, tolerance): bf16 weights under fp32 activations are LoRAConfig.lora_dtype="bfloat16"
DTYPES = [(torch.float32, torch.float32, 1e-5), (torch.bfloat16, torch.bfloat16, 3e-2),
          (torch.float32, torch.bfloat16, 1e-5)]


@pytest.mark.parametrize("backend", backend_params(BACKENDS, lora_cpu.available))
@pytest.mark.parametrize("dtype, wdtype, atol", DTYPES)
@pytest.mark.parametrize("rank", [4, 5])  # bf16: the kernel's expand pairs rank rows; odd ranks end on half a pair
@pytest.mark.parametrize("per_slot", [1, 4, 11])  # the kernel's token tiles: 1, 4, 8 + 3
@pytest.mark.parametrize("with_ranks", [False, True])
def test_packed_output_slices(backend, dtype, wdtype, atol, rank, per_slot, with_ranks):
    """A packed layer (q|k|v): one shrink over K*rank rows of A; B [slots, out, rank] holds each slice's rows."""
    torch.manual_seed(1)
    slices, n_in, num_slots = (40, 16, 24), 32, 3
    ranks = [rank, rank - 2, 0] if with_ranks else [rank] * num_slots
    lora_a = torch.zeros(num_slots, 3 * rank, n_in, dtype=wdtype)
    lora_b = torch.zeros(num_slots, sum(slices), rank, dtype=wdtype)
    for slot, r in enumerate(ranks):
        for k in range(3):
            lora_a[slot, k * rank : k * rank + r] = torch.randn(r, n_in, dtype=wdtype) * 0.3
        lora_b[slot, :, :r] = torch.randn(sum(slices), r, dtype=wdtype) * 0.3
    slots = [s for s in (0, 1, 2) for _ in range(per_slot)] + [-1]
    x = torch.randn(len(slots), n_in, dtype=dtype)
    mapping = LoRAMapping.from_slots(slots)
    expected = torch.zeros(len(slots), sum(slices))
    per_token_loop(expected, x.float(), lora_a.float(), block_diagonal(lora_b, slices).float(), mapping.token_slots)
    y = torch.zeros(len(slots), sum(slices), dtype=dtype)
    BACKENDS[backend](y, x, lora_a, lora_b, mapping, slices, torch.tensor(ranks) if with_ranks else None)
    torch.testing.assert_close(y.float(), expected, atol=atol * 10, rtol=atol)


@pytest.mark.parametrize("backend", backend_params(BACKENDS, lora_cpu.available))
def test_packed_shapes_are_checked(backend):
    lora_a, lora_b = torch.zeros(2, 12, 8), torch.zeros(2, 20, 4)  # 12 rows of A: 3 slices of rank 4, not 2
    with pytest.raises((ValueError, RuntimeError), match="do not fit|lora_b must be"):
        BACKENDS[backend](torch.zeros(1, 20), torch.zeros(1, 8), lora_a, lora_b, LoRAMapping.from_slots([0]), (10, 10))


@pytest.mark.parametrize("backend", backend_params(BACKENDS, lora_cpu.available))
@pytest.mark.parametrize("dtype, atol", [(torch.float32, 1e-5), (torch.bfloat16, 3e-2)])
def test_slot_ranks_hint_on_zero_padded_slots(backend, dtype, atol):
    """Slots padded with zeros beyond their real rank (0 = free): the hint may skip the padding."""
    torch.manual_seed(2)
    ranks, max_rank, n_in, n_out = [3, 8, 0, 5], 8, 24, 40
    lora_a = torch.zeros(len(ranks), max_rank, n_in, dtype=dtype)
    lora_b = torch.zeros(len(ranks), n_out, max_rank, dtype=dtype)
    for slot, r in enumerate(ranks):
        lora_a[slot, :r] = torch.randn(r, n_in, dtype=dtype) * 0.3
        lora_b[slot, :, :r] = torch.randn(n_out, r, dtype=dtype) * 0.3
    x = torch.randn(9, n_in, dtype=dtype)
    mapping = LoRAMapping.from_slots([3, 0, 0, 1, -1, 2, 1, 3, 3])
    expected = torch.zeros(9, n_out)
    per_token_loop(expected, x.float(), lora_a.float(), lora_b.float(), mapping.token_slots)
    y = torch.zeros(9, n_out, dtype=dtype)
    BACKENDS[backend](y, x, lora_a, lora_b, mapping, (), torch.tensor(ranks))
    torch.testing.assert_close(y.float(), expected, atol=atol * 10, rtol=atol)


@pytest.mark.skipif(not lora_cpu.available(), reason="needs the C++ CPU kernel")
@pytest.mark.parametrize("dtype, wdtype, atol", DTYPES)
@pytest.mark.parametrize("tokens_per_slot", [[4] * 8, [3, 5, 4, 4, 6, 2, 4, 4], [32], [29, 1, 1, 1], [1], [2]])
def test_cpu_kernel_threaded_paths(dtype, wdtype, atol, tokens_per_slot):
    """Big enough for two threads (the small tests above run on one): many slots, where each thread owns
    whole slots, and one slot or an uneven mix, where every slot is split over the threads."""
    torch.manual_seed(3)
    slices, n_in, max_rank = (96, 40, 40), 256, 16
    ranks = [max_rank if i % 2 == 0 else 7 for i in range(len(tokens_per_slot))]
    lora_a = torch.zeros(len(ranks), 3 * max_rank, n_in, dtype=wdtype)
    lora_b = torch.zeros(len(ranks), sum(slices), max_rank, dtype=wdtype)
    for slot, r in enumerate(ranks):
        for k in range(3):
            lora_a[slot, k * max_rank : k * max_rank + r] = torch.randn(r, n_in, dtype=wdtype) * 0.1
        lora_b[slot, :, :r] = torch.randn(sum(slices), r, dtype=wdtype) * 0.1
    lora_b = lora_b.transpose(1, 2).contiguous().transpose(1, 2)
    slots = [s for s, n in enumerate(tokens_per_slot) for _ in range(n)] + [-1, -1]
    slots = [slots[i] for i in torch.randperm(len(slots)).tolist()]
    mapping = LoRAMapping.from_slots(slots)
    x = torch.randn(len(slots), n_in, dtype=dtype)
    expected = torch.zeros(len(slots), sum(slices))
    per_token_loop(expected, x.float(), lora_a.float(), block_diagonal(lora_b, slices).float(), mapping.token_slots)
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        y = torch.zeros(len(slots), sum(slices), dtype=dtype)
        lora_cpu.add_lora_cpu(y, x, lora_a, lora_b, mapping, slices, torch.tensor(ranks))
    finally:
        torch.set_num_threads(threads)
    torch.testing.assert_close(y.float(), expected, atol=atol * 10, rtol=atol)


@pytest.mark.skipif(not lora_cpu.available(), reason="needs the C++ CPU kernel")
@pytest.mark.parametrize("rank", [1, 5, 16, 32])  # odd ranks end on half a pair of the expand's tiles
@pytest.mark.parametrize("tokens_per_slot", [[16], [40, 17, 3]])  # whole and partial 16-token tiles, a small group
@pytest.mark.parametrize("threads", [1, 2])
def test_cpu_kernel_bf16_prefill_groups(rank, tokens_per_slot, threads):
    """Groups of 16+ tokens in bf16 (AMX tiles where the CPU has them): every row is the reference computed as
    the kernel rounds, h = bf16(x A^T) and y = bf16(y + h B^T), up to the order of the fp32 sums."""
    torch.manual_seed(4)
    slices, n_in = (40, 24, 24), 96
    lora_a = torch.randn(len(tokens_per_slot), 3 * rank, n_in).bfloat16() * 0.2
    lora_b = (torch.randn(len(tokens_per_slot), sum(slices), rank) * 0.2).bfloat16()
    lora_b = lora_b.transpose(1, 2).contiguous().transpose(1, 2)
    slots = [s for s, n in enumerate(tokens_per_slot) for _ in range(n)] + [-1]
    slots = [slots[i] for i in torch.randperm(len(slots)).tolist()]
    x, y0 = torch.randn(len(slots), n_in).bfloat16(), torch.randn(len(slots), sum(slices)).bfloat16()
    expected = y0.float().clone()
    for t, s in enumerate(slots):
        if s >= 0:
            h = (lora_a[s].float() @ x[t].float()).bfloat16().float()  # [3 * rank]
            expected[t] += block_diagonal(lora_b, slices)[s].float() @ h
    expected = expected.bfloat16().float()
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        y = y0.clone()
        lora_cpu.add_lora_cpu(y, x, lora_a, lora_b, LoRAMapping.from_slots(slots), slices)
    finally:
        torch.set_num_threads(previous)
    torch.testing.assert_close(y.float(), expected, atol=2e-2, rtol=8e-3)
    assert torch.equal(y[torch.tensor(slots) < 0], y0[torch.tensor(slots) < 0])


@pytest.mark.skipif(not lora_cpu.available(), reason="needs the C++ CPU kernel")
def test_cpu_kernel_prompt_rows_equal_the_same_rows_one_by_one():
    """Prompts on adapters of real ranks 3, 8, 5 under a padded rank of 8 (AMX tiles where the CPU has them, a
    tile configuration per rank), rows of x and y wider than their data: each row as the kernel computes it
    one token at a time (the AVX-512 path), to the last bit but where the two orders of the fp32 sums round
    differently (never by more than one bf16 step)."""
    torch.manual_seed(5)
    slices, n_in, max_rank, ranks = (40, 24, 24), 96, 8, [3, 8, 5]
    lora_a = torch.zeros(3, 3 * max_rank, n_in, dtype=torch.bfloat16)
    lora_b = torch.zeros(3, sum(slices), max_rank, dtype=torch.bfloat16)
    for slot, r in enumerate(ranks):
        for k in range(3):
            lora_a[slot, k * max_rank : k * max_rank + r] = torch.randn(r, n_in) * 0.2
        lora_b[slot, :, :r] = torch.randn(sum(slices), r) * 0.2
    lora_b = lora_b.transpose(1, 2).contiguous().transpose(1, 2)
    slots = [s for s, n in enumerate([20, 37, 18]) for _ in range(n)]
    slots = [slots[i] for i in torch.randperm(len(slots)).tolist()]
    x = torch.randn(len(slots), n_in + 8).bfloat16()[:, 4 : 4 + n_in]  # row stride != width
    y0 = torch.randn(len(slots), sum(slices) + 3).bfloat16()
    together, one_by_one = y0.clone(), y0.clone()
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        lora_cpu.add_lora_cpu(together[:, : sum(slices)], x, lora_a, lora_b, LoRAMapping.from_slots(slots), slices,
                              torch.tensor(ranks))
        for t, s in enumerate(slots):
            lora_cpu.add_lora_cpu(one_by_one[t : t + 1, : sum(slices)], x[t : t + 1], lora_a, lora_b,
                                  LoRAMapping.from_slots([s]), slices, torch.tensor(ranks))
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(together[:, sum(slices) :], y0[:, sum(slices) :])  # nothing past the width
    differ = together != one_by_one
    assert differ.float().mean() < 0.02
    step = one_by_one.float().abs().clamp_min(2**-20) * 2**-7  # one bf16 step at that magnitude, and then some
    assert ((together.float() - one_by_one.float()).abs() <= step)[differ].all()


SMALLER_TEAM = textwrap.dedent("""
    import torch
    from loramux.ops import LoRAMapping, lora_cpu
    from loramux.ops.lora_torch import add_lora_segmented
    torch.manual_seed(0)
    torch.set_num_threads(2)
    lora_a, lora_b = torch.randn(8, 16, 256) * 0.1, torch.randn(8, 512, 16) * 0.1
    lora_b = lora_b.transpose(1, 2).contiguous().transpose(1, 2)
    mapping = LoRAMapping.from_slots([t % 8 for t in range(64)])
    x, y, expected = torch.randn(64, 256), torch.zeros(64, 512), torch.zeros(64, 512)
    lora_cpu.add_lora_cpu(y, x, lora_a, lora_b, mapping)
    add_lora_segmented(expected, x, lora_a, lora_b, mapping)
    torch.testing.assert_close(y, expected, atol=1e-5, rtol=1e-5)
""")


@pytest.mark.skipif(not lora_cpu.available(), reason="needs the C++ CPU kernel")
def test_cpu_kernel_with_a_smaller_openmp_team_than_torch_asks_for():
    """OMP_THREAD_LIMIT below torch's thread count gives the kernel fewer threads than it planned whole
    adapters for: it must still compute every adapter (it once dropped the missing threads' share)."""
    env = dict(os.environ, OMP_THREAD_LIMIT="1")
    cmd = [sys.executable, "-c", SMALLER_TEAM]
    result = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]


@pytest.mark.skipif(not lora_cpu.available(), reason="needs the C++ CPU kernel")
def test_cpu_kernel_copies_a_b_that_is_not_rank_major():
    ext = load_extension("lora_cpu")
    gen = torch.Generator().manual_seed(0)
    lora_a, lora_b = torch.randn(2, 4, 8, generator=gen), torch.randn(2, 16, 4, generator=gen)  # out-major B
    x, slots = torch.randn(3, 8, generator=gen), torch.tensor([1, -1, 0])
    expected = torch.zeros(3, 16)
    add_lora_gathered(expected, x, lora_a, lora_b, LoRAMapping(slots))
    for b in (lora_b, lora_b.transpose(1, 2).contiguous().transpose(1, 2)):
        y = torch.zeros(3, 16)
        ext.add_lora(y, x, lora_a, b, slots)
        torch.testing.assert_close(y, expected, rtol=1e-5, atol=1e-5)
