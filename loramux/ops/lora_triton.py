"""The GPU path for add_lora: Triton kernels, same contract as lora_torch.py.

The method is Punica's SGMV (Chen et al., "Punica: Multi-Tenant LoRA Serving", 2023) as S-LoRA and vLLM
run it: the tokens of a batch are ordered by slot (on the device, no host sync), and one launch covers every
slot's tokens for a layer, decode and prefill alike:
  shrink  h[t, k*R:(k+1)*R] = x[t] @ A[s, k*R:(k+1)*R]^T      programs (work item, slice k)
  expand  y[t, o] += h[t, k(o)*R:(k(o)+1)*R] @ B[s, o, :]^T    programs (work item, output block)
where k(o) is the packed slice (q|k|v, gate|up) output column o belongs to. A work item is a (slot, token
block) pair that has tokens, from a table built on the device once per forward pass (work_items): axis 0 spans
at most cdiv(tokens, BLOCK_M) + slots - 1 of them, where a grid of slots x token blocks would be all but ~1/slots
empty programs. An expand block reads h and B only for the slices its columns meet. Rows of A and columns of B
beyond a slot's real rank (slot_ranks) are never read; tokens of slot -1 get no programs.

Split-K: where the work items do not fill the GPU (batch-1 decode: one per slice) the shrink's inputs are cut
into `split` pieces, a program each (ops/triton_tiles.py decides from the shapes alone). Each piece writes its
fp32 partial sum to a plane of h [split, tokens, slices * rank]; the expand adds the planes in a fixed order
(the same bits every run, no atomics) and rounds the sum to x's dtype, as the reference's shrink result is.

Under Triton's interpreter (ops/triton_common.py) the kernels run on CPU tensors: that is how CI checks them
against the reference on a machine without a GPU.
"""
from __future__ import annotations

import functools

import torch

from loramux.ops.lora_torch import slices_of
from loramux.ops.mapping import LoRAMapping
from loramux.ops.triton_common import INTERPRET, available, triton
from loramux.ops.triton_tiles import LoRATiles, lora_tiles, multiprocessors, splits

if triton is not None:
    import triton.language as tl

    from loramux.ops.triton_common import dot as _dot
    from loramux.ops.triton_common import rounded as _rounded

MAX_SLICES = 3  # q|k|v; the expand's slice lookup is unrolled over at most this many


def add_lora_triton(y, x, lora_a, lora_b, mapping: LoRAMapping, output_slices=(), slot_ranks=None) -> None:
    tiles = lora_tiles(y.device, y.shape[0])
    split = split_k(tiles, y.shape[0], lora_a.shape[0], len(slices_of(output_slices, lora_a, lora_b)),
                    lora_a.shape[2], str(y.device))
    launch(y, x, lora_a, lora_b, mapping, output_slices, slot_ranks, tiles, split)


def split_k(tiles: LoRATiles, n_tokens: int, num_slots: int, num_slices: int, n_in: int, device: str) -> int:
    """The shrink's split-K pieces: its grid (work items x slices) against the device's SMs."""
    programs = (n_tokens + tiles.block_m - 1) // tiles.block_m + min(num_slots, n_tokens) - 1
    return splits(num_slices * max(1, programs), multiprocessors(device), n_in, tiles.split_min_k)


def launch(y, x, lora_a, lora_b, mapping: LoRAMapping, output_slices, slot_ranks, tiles: LoRATiles,
           split: int) -> None:
    """add_lora_triton with its tiles and split-K pieces given (the public op chooses them from the shapes)."""
    num_slots, a_rows, n_in = lora_a.shape
    n_tokens, n_out = y.shape
    rank = lora_b.shape[2]
    slices = slices_of(output_slices, lora_a, lora_b)
    if len(slices) > MAX_SLICES:
        raise ValueError(f"the Triton LoRA op takes at most {MAX_SLICES} output slices, got {len(slices)}")
    if n_tokens == 0 or num_slots == 0:
        return
    block_m, block_r = tiles.block_m, max(16, triton.next_power_of_2(rank))
    order, counts, starts = by_slot(mapping, num_slots)
    work = work_items(mapping, num_slots, block_m)  # [programs, 2]
    bounds = _bounds(tuple(o1 for _, o1, _, _ in slices), y.device)
    ranks = slot_ranks if slot_ranks is not None else torch.full((num_slots,), rank, device=y.device)
    h = torch.empty(split, n_tokens, a_rows, dtype=torch.float32, device=x.device)  # fp32 partials
    piece = triton.cdiv(triton.cdiv(n_in, split), tiles.block_k) * tiles.block_k  # inputs a split-K piece sums
    # the interpreter's bf16 dot is wrong (triton 3.9: garbage sums), so it runs every dot in fp32
    fp32 = x.dtype == torch.float32 or INTERPRET
    _shrink[(work.shape[0], len(slices), split)](
        x, lora_a, h, work, order, counts, starts, ranks, n_in, rank, piece,
        x.stride(0), x.stride(1), lora_a.stride(0), lora_a.stride(1), lora_a.stride(2), h.stride(0), h.stride(1),
        BLOCK_M=block_m, BLOCK_R=block_r, BLOCK_K=tiles.block_k, IEEE=fp32, num_warps=tiles.num_warps)
    _expand[(work.shape[0], triton.cdiv(n_out, tiles.block_n))](
        h, x, lora_b, y, work, order, counts, starts, ranks, bounds, rank,
        h.stride(0), h.stride(1), lora_b.stride(0), lora_b.stride(1), lora_b.stride(2), y.stride(0), y.stride(1),
        NUM_SLICES=len(slices), SPLIT=split, BLOCK_M=block_m, BLOCK_N=tiles.block_n, BLOCK_R=block_r, IEEE=fp32,
        EMULATE=INTERPRET, num_warps=tiles.num_warps)


def by_slot(mapping: LoRAMapping, num_slots: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The tokens ordered by slot, once per forward pass (every layer shares the mapping), on its device:
    (order [num_tokens] int64: token indices, slot -1 first; counts [num_slots + 1]: tokens per slot, base
    first; starts [num_slots + 1]: where each slot's tokens begin in order)."""
    cache = mapping.__dict__.setdefault("_by_slot", {})
    if num_slots not in cache:
        slots = mapping.token_slots
        order = torch.argsort(slots, stable=True)
        counts = counts_of(slots + 1, num_slots + 1)  # base first
        cache[num_slots] = order, counts, torch.cumsum(counts, 0) - counts
    return cache[num_slots]


def work_items(mapping: LoRAMapping, num_slots: int, block_m: int) -> torch.Tensor:
    """[programs, 2] int32 (slot, token block within the slot): a row per (slot >= 0, block of block_m of its
    tokens) pair that has tokens, in slot order, then (-1, 0) rows up to programs = cdiv(tokens, block_m) +
    min(slots, tokens) - 1, which the pairs never exceed (only a slot's last block is partial). On the device,
    no host sync (the grid size is the bound, not the count), once per forward pass and block size."""
    cache = mapping.__dict__.setdefault("_work_items", {})
    if (num_slots, block_m) not in cache:
        n = mapping.num_tokens
        counts = by_slot(mapping, num_slots)[1][1:]  # [num_slots], base left out
        blocks = (counts + block_m - 1) // block_m  # [num_slots] token blocks per slot
        ends = torch.cumsum(blocks, 0)  # [num_slots] where each slot's work items end
        programs = max(0, (n + block_m - 1) // block_m + min(num_slots, n) - 1)
        p = torch.arange(programs, device=counts.device)
        slot = torch.searchsorted(ends, p, right=True)  # [programs] the slot whose items cover p; num_slots past them
        real = slot < num_slots
        first = (ends - blocks)[slot.clamp(max=num_slots - 1)]  # [programs] the slot's first work item
        cache[num_slots, block_m] = torch.stack(
            [torch.where(real, slot, -1), torch.where(real, p - first, 0)], 1).to(torch.int32)
    return cache[num_slots, block_m]


def counts_of(ids: torch.Tensor, n: int) -> torch.Tensor:
    """[n] how many of `ids` are 0..n-1, on their device (torch.bincount, without its host syncs on CUDA: the
    min and max checks)."""
    return torch.zeros(n, dtype=torch.long, device=ids.device).scatter_add_(0, ids, torch.ones_like(ids))


@functools.lru_cache(maxsize=64)
def _bounds_cached(ends: tuple[int, ...], device: str) -> torch.Tensor:
    return torch.tensor((0, *ends), dtype=torch.long, device=device)


def _bounds(ends: tuple[int, ...], device: torch.device) -> torch.Tensor:
    """[num_slices + 1] output row where each slice starts (and the last ends); one tensor per layer shape."""
    return _bounds_cached(ends, str(device))


if triton is not None:

    @triton.jit
    def _shrink(x, a, h, work, order, counts, starts, ranks, n_in, rank, piece,
                sx_t, sx_i, sa_s, sa_r, sa_i, sh_p, sh_t,
                BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr, IEEE: tl.constexpr):
        """h[q, t, k*rank + r] = sum over i of piece q of x[t, i] * a[s, k*rank + r, i], in fp32, for this
        program's tokens t of slot s."""
        p, k, q = tl.program_id(0), tl.program_id(1), tl.program_id(2)
        s, mb = tl.load(work + 2 * p), tl.load(work + 2 * p + 1)  # slot, token block within it
        if s < 0:  # past the real work items
            return
        count = tl.load(counts + s + 1)
        m = mb * BLOCK_M + tl.arange(0, BLOCK_M)
        tokens = tl.load(order + tl.load(starts + s + 1) + m, mask=m < count, other=0)  # [BLOCK_M]
        r = tl.arange(0, BLOCK_R)
        real = tl.minimum(tl.load(ranks + s), rank)
        rows = a + s * sa_s + (k * rank + r) * sa_r  # [BLOCK_R] pointers to A's rows
        acc = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
        end = tl.minimum(n_in, (q + 1) * piece)
        for i0 in range(q * piece, end, BLOCK_K):
            i = i0 + tl.arange(0, BLOCK_K)
            xt = tl.load(x + tokens[:, None] * sx_t + i[None, :] * sx_i,
                         mask=(m[:, None] < count) & (i[None, :] < end), other=0.0)  # [BLOCK_M, BLOCK_K]
            at = tl.load(rows[None, :] + i[:, None] * sa_i,
                         mask=(r[None, :] < real) & (i[:, None] < end), other=0.0)  # [BLOCK_K, BLOCK_R]
            acc = _dot(xt, at.to(xt.dtype), acc, IEEE)  # (A may be bf16 under fp32 x: lora_dtype)
        out = h + q * sh_p + tokens[:, None] * sh_t + k * rank + r[None, :]
        tl.store(out, acc, mask=(m[:, None] < count) & (r[None, :] < rank))

    @triton.jit
    def _expand(h, x, b, y, work, order, counts, starts, ranks, bounds, rank,
                sh_p, sh_t, sb_s, sb_o, sb_r, sy_t, sy_o,
                NUM_SLICES: tl.constexpr, SPLIT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                BLOCK_R: tl.constexpr, IEEE: tl.constexpr, EMULATE: tl.constexpr):
        """y[t, o] += sum_r round_x(sum_q h[q, t, k(o)*rank + r]) * b[s, o, r] for this program's tokens t of slot
        s (x: only its dtype is read, the shrink result's)."""
        p, nb = tl.program_id(0), tl.program_id(1)
        s, mb = tl.load(work + 2 * p), tl.load(work + 2 * p + 1)  # slot, token block within it
        if s < 0:  # past the real work items
            return
        count = tl.load(counts + s + 1)
        m = mb * BLOCK_M + tl.arange(0, BLOCK_M)
        tokens = tl.load(order + tl.load(starts + s + 1) + m, mask=m < count, other=0)
        o = nb * BLOCK_N + tl.arange(0, BLOCK_N)
        r = tl.arange(0, BLOCK_R)
        real = tl.minimum(tl.load(ranks + s), rank)
        n_out = tl.load(bounds + NUM_SLICES)
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k in tl.static_range(NUM_SLICES):
            lo, hi = tl.load(bounds + k), tl.load(bounds + k + 1)
            if (lo < nb * BLOCK_N + BLOCK_N) & (hi > nb * BLOCK_N):  # slice k meets this block: read its h and B
                cols = (o >= lo) & (o < hi)  # this block's columns in slice k (some or all)
                h_mask = (m[:, None] < count) & (r[None, :] < real)
                hs = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
                for q in tl.static_range(SPLIT):  # the pieces' partials, in order
                    hs += tl.load(h + q * sh_p + tokens[:, None] * sh_t + k * rank + r[None, :], mask=h_mask, other=0.0)
                ht = _rounded(hs, x.dtype.element_ty, EMULATE)  # [BLOCK_M, BLOCK_R]
                bt = tl.load(b + s * sb_s + o[None, :] * sb_o + r[:, None] * sb_r,
                             mask=cols[None, :] & (r[:, None] < real), other=0.0)  # [BLOCK_R, BLOCK_N]
                acc = _dot(ht, bt.to(ht.dtype), acc, IEEE)
        out = y + tokens[:, None] * sy_t + o[None, :] * sy_o
        keep = (m[:, None] < count) & (o[None, :] < n_out)
        total = tl.load(out, mask=keep, other=0.0).to(tl.float32) + acc
        tl.store(out, _rounded(total, y.dtype.element_ty, EMULATE), mask=keep)
