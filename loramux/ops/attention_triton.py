"""Paged decode attention for CUDA in Triton, same contract as attention_torch.py (the KV store stays torch's
index_copy_, which is one kernel on a GPU).

One program per (sequence, kv head): the kv head's query group at once (GQA reads each key and value once
for the group), the sequence's keys walked in blocks of BLOCK_N positions through its block table with an
online softmax (as vLLM's paged attention and FlashAttention do), so nothing is padded to the longest
sequence of the batch and no [batch, context] tensor is built. Scores and sums in fp32.

Split-KV (flash-decoding): where batch x kv heads programs do not fill the GPU (batch 1: 8 programs on ~130
SMs), each sequence's positions are cut into `split` equal pieces, a program each, writing its piece's running
max, sum and unnormalised output; a second kernel merges the pieces of each head in order (the same bits every
run). The number of pieces follows from host-known shapes only (ops/triton_tiles.py): the batch, the kv heads
and the block table's width, the longest context a step can have; so a CUDA graph replays with it.
"""
from __future__ import annotations

import torch

from loramux.ops.attention_torch import store_kv_torch
from loramux.ops.triton_common import INTERPRET, triton
from loramux.ops.triton_tiles import AttentionTiles, attention_tiles, multiprocessors, splits

if triton is not None:
    import triton.language as tl

    from loramux.ops.triton_common import dot as _dot
    from loramux.ops.triton_common import rounded as _rounded

store_kv_triton = store_kv_torch


def decode_attention_triton(q, k_cache, v_cache, block_tables, context_lens, block_size: int, scale: float):
    tiles = attention_tiles(q.device, q.shape[0])
    split = split_kv(tiles, q.shape[0], k_cache.shape[1], block_tables.shape[1] * block_size, str(q.device))
    return launch(q, k_cache, v_cache, block_tables, context_lens, block_size, scale, tiles, split)


def split_kv(tiles: AttentionTiles, batch: int, kv_heads: int, longest: int, device: str) -> int:
    """Split-KV pieces: batch x kv heads programs against the device's SMs; longest: the longest context the
    step's block tables can hold (their width, not the lengths: those are on the device)."""
    return splits(batch * kv_heads, multiprocessors(device), longest, tiles.split_min_len)


def launch(q, k_cache, v_cache, block_tables, context_lens, block_size: int, scale: float, tiles: AttentionTiles,
           split: int):
    """decode_attention_triton with its tiles and split-KV pieces given (the public op chooses them)."""
    batch, num_heads, head_dim = q.shape
    kv_heads = k_cache.shape[1]
    group = num_heads // kv_heads
    out = torch.empty_like(q)
    if batch == 0:
        return out
    sizes = dict(BLOCK_G=max(16, triton.next_power_of_2(group)), BLOCK_D=max(16, triton.next_power_of_2(head_dim)),
                 BLOCK_N=tiles.block_n, IEEE=q.dtype == torch.float32 or INTERPRET, EMULATE=INTERPRET,
                 num_warps=tiles.num_warps)
    common = (q, k_cache, v_cache, block_tables, context_lens, scale, group, head_dim, block_size,
              q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), v_cache.stride(0), v_cache.stride(1),
              block_tables.stride(0))
    if split == 1:
        _decode[(batch, kv_heads)](*common, out, out.stride(0), out.stride(1), **sizes)
        return out
    part = torch.empty(batch, num_heads, split, head_dim + 2, dtype=torch.float32, device=q.device)  # acc | max | sum
    _decode_piece[(batch, kv_heads, split)](*common, part, part.stride(0), part.stride(1), part.stride(2), **sizes)
    _merge[(batch, num_heads)](part, out, head_dim, part.stride(0), part.stride(1), part.stride(2),
                               out.stride(0), out.stride(1), SPLIT=split, BLOCK_D=sizes["BLOCK_D"],
                               EMULATE=INTERPRET)
    return out


if triton is not None:

    @triton.jit
    def _attend(q, kc, vc, tables, b, kh, lo, hi, scale, group, head_dim, block_size,
                sq_b, sq_h, sk_r, sk_h, sv_r, sv_h, st_b,
                BLOCK_G: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, IEEE: tl.constexpr,
                EMULATE: tl.constexpr):
        """Positions lo..hi-1 of sequence b for the query heads of kv head kh, with an online softmax:
        (acc [G, D] unnormalised output, m [G] running max, l [G] sum of exp(score - m)), all fp32."""
        g, d = tl.arange(0, BLOCK_G), tl.arange(0, BLOCK_D)
        heads = kh * group + g
        q_mask = (g[:, None] < group) & (d[None, :] < head_dim)
        qt = tl.load(q + b * sq_b + heads[:, None] * sq_h + d[None, :], mask=q_mask, other=0.0)  # [G, D]
        m_i = tl.full((BLOCK_G,), float("-inf"), dtype=tl.float32)
        l_i = tl.zeros((BLOCK_G,), dtype=tl.float32)
        acc = tl.zeros((BLOCK_G, BLOCK_D), dtype=tl.float32)
        for p0 in range(lo, hi, BLOCK_N):
            p = p0 + tl.arange(0, BLOCK_N)
            valid = p < hi
            rows = tl.load(tables + b * st_b + p // block_size, mask=valid, other=0) * block_size + p % block_size
            kv_mask = valid[:, None] & (d[None, :] < head_dim)
            kt = tl.load(kc + rows[:, None] * sk_r + kh * sk_h + d[None, :], mask=kv_mask, other=0.0)  # [N, D]
            s = _dot(qt, tl.trans(kt), tl.zeros((BLOCK_G, BLOCK_N), dtype=tl.float32), IEEE) * scale
            s = tl.where(valid[None, :], s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            alpha = tl.exp(m_i - m_new)
            probs = tl.exp(s - m_new[:, None])  # [G, N]
            l_i = l_i * alpha + tl.sum(probs, 1)
            vt = tl.load(vc + rows[:, None] * sv_r + kh * sv_h + d[None, :], mask=kv_mask, other=0.0)  # [N, D]
            acc = _dot(_rounded(probs, vt.dtype, EMULATE), vt, acc * alpha[:, None], IEEE)
            m_i = m_new
        return acc, m_i, l_i

    @triton.jit
    def _decode(q, kc, vc, tables, lens, scale, group, head_dim, block_size,
                sq_b, sq_h, sk_r, sk_h, sv_r, sv_h, st_b, out, so_b, so_h,
                BLOCK_G: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, IEEE: tl.constexpr,
                EMULATE: tl.constexpr):
        """out[b, h] = softmax(scale * K q[b, h]) V over positions 0..lens[b]-1 of sequence b, for the query
        heads h of kv head program_id(1)."""
        b, kh = tl.program_id(0), tl.program_id(1)
        acc, m_i, l_i = _attend(q, kc, vc, tables, b, kh, 0, tl.load(lens + b), scale, group, head_dim, block_size,
                                sq_b, sq_h, sk_r, sk_h, sv_r, sv_h, st_b,
                                BLOCK_G, BLOCK_D, BLOCK_N, IEEE, EMULATE)
        g, d = tl.arange(0, BLOCK_G), tl.arange(0, BLOCK_D)
        heads = kh * group + g
        result = acc / l_i[:, None]
        tl.store(out + b * so_b + heads[:, None] * so_h + d[None, :], _rounded(result, out.dtype.element_ty, EMULATE),
                 mask=(g[:, None] < group) & (d[None, :] < head_dim))

    @triton.jit
    def _decode_piece(q, kc, vc, tables, lens, scale, group, head_dim, block_size,
                      sq_b, sq_h, sk_r, sk_h, sv_r, sv_h, st_b, part, sp_b, sp_h, sp_s,
                      BLOCK_G: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, IEEE: tl.constexpr,
                      EMULATE: tl.constexpr):
        """part[b, h, piece] = (acc[0:D], max, sum) over piece program_id(2) of sequence b's positions (pieces of
        equal length, whole BLOCK_N steps; an empty piece writes acc 0, max -inf, sum 0)."""
        b, kh, piece = tl.program_id(0), tl.program_id(1), tl.program_id(2)
        n = tl.load(lens + b)
        length = tl.cdiv(tl.cdiv(n, tl.num_programs(2)), BLOCK_N) * BLOCK_N
        lo = piece * length
        acc, m_i, l_i = _attend(q, kc, vc, tables, b, kh, lo, tl.minimum(n, lo + length), scale, group, head_dim,
                                block_size, sq_b, sq_h, sk_r, sk_h, sv_r, sv_h, st_b,
                                BLOCK_G, BLOCK_D, BLOCK_N, IEEE, EMULATE)
        g, d = tl.arange(0, BLOCK_G), tl.arange(0, BLOCK_D)
        at = part + b * sp_b + (kh * group + g) * sp_h + piece * sp_s  # [G] pointers to each head's piece
        tl.store(at[:, None] + d[None, :], acc, mask=(g[:, None] < group) & (d[None, :] < head_dim))
        tl.store(at + head_dim, m_i, mask=g < group)
        tl.store(at + head_dim + 1, l_i, mask=g < group)

    @triton.jit
    def _merge(part, out, head_dim, sp_b, sp_h, sp_s, so_b, so_h,
               SPLIT: tl.constexpr, BLOCK_D: tl.constexpr, EMULATE: tl.constexpr):
        """out[b, h] = sum_p exp(max_p - M) acc_p / sum_p exp(max_p - M) sum_p, M the largest max, pieces in order."""
        b, h = tl.program_id(0), tl.program_id(1)
        d = tl.arange(0, BLOCK_D)
        at = part + b * sp_b + h * sp_h
        top = tl.load(at + head_dim)
        for p in tl.static_range(1, SPLIT):
            top = tl.maximum(top, tl.load(at + p * sp_s + head_dim))
        acc = tl.zeros((BLOCK_D,), dtype=tl.float32)
        total = 0.0
        for p in tl.static_range(SPLIT):
            w = tl.exp(tl.load(at + p * sp_s + head_dim) - top)  # 0 for an empty piece (max -inf)
            acc += w * tl.load(at + p * sp_s + d, mask=d < head_dim, other=0.0)
            total += w * tl.load(at + p * sp_s + head_dim + 1)
        tl.store(out + b * so_b + h * so_h + d, _rounded(acc / total, out.dtype.element_ty, EMULATE), mask=d < head_dim)
