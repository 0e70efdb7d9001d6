"""Paged decode attention for CUDA in Triton, same contract as attention_torch.py (the KV store stays torch's
index_copy_, which is one kernel on a GPU).

One program per (sequence, kv head): the kv head's query group at once (GQA reads each key and value once
for the group), the sequence's keys walked in blocks of BLOCK_N positions through its block table with an
online softmax (as vLLM's paged attention and FlashAttention do), so nothing is padded to the longest
sequence of the batch and no [batch, context] tensor is built. Scores and sums in fp32.
"""
from __future__ import annotations

import torch

from loramux.ops.attention_torch import store_kv_torch
from loramux.ops.triton_common import INTERPRET, triton

if triton is not None:
    import triton.language as tl

    from loramux.ops.triton_common import dot as _dot
    from loramux.ops.triton_common import rounded as _rounded

store_kv_triton = store_kv_torch


def decode_attention_triton(q, k_cache, v_cache, block_tables, context_lens, block_size: int, scale: float):
    batch, num_heads, head_dim = q.shape
    kv_heads = k_cache.shape[1]
    group = num_heads // kv_heads
    out = torch.empty_like(q)
    if batch == 0:
        return out
    _decode[(batch, kv_heads)](
        q, k_cache, v_cache, block_tables, context_lens, out, scale, group, head_dim, block_size,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), v_cache.stride(0), v_cache.stride(1),
        block_tables.stride(0), out.stride(0), out.stride(1),
        BLOCK_G=max(16, triton.next_power_of_2(group)), BLOCK_D=max(16, triton.next_power_of_2(head_dim)),
        BLOCK_N=64, IEEE=q.dtype == torch.float32 or INTERPRET, EMULATE=INTERPRET)
    return out


if triton is not None:

    @triton.jit
    def _decode(q, kc, vc, tables, lens, out, scale, group, head_dim, block_size,
                sq_b, sq_h, sk_r, sk_h, sv_r, sv_h, st_b, so_b, so_h,
                BLOCK_G: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, IEEE: tl.constexpr,
                EMULATE: tl.constexpr):
        """out[b, h] = softmax(scale * K q[b, h]) V over positions 0..lens[b]-1 of sequence b, for the query
        heads h of kv head program_id(1)."""
        b, kh = tl.program_id(0), tl.program_id(1)
        n = tl.load(lens + b)
        g, d = tl.arange(0, BLOCK_G), tl.arange(0, BLOCK_D)
        heads = kh * group + g
        q_mask = (g[:, None] < group) & (d[None, :] < head_dim)
        qt = tl.load(q + b * sq_b + heads[:, None] * sq_h + d[None, :], mask=q_mask, other=0.0)  # [G, D]
        m_i = tl.full((BLOCK_G,), float("-inf"), dtype=tl.float32)
        l_i = tl.zeros((BLOCK_G,), dtype=tl.float32)
        acc = tl.zeros((BLOCK_G, BLOCK_D), dtype=tl.float32)
        for p0 in range(0, n, BLOCK_N):
            p = p0 + tl.arange(0, BLOCK_N)
            valid = p < n
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
        result = acc / l_i[:, None]
        tl.store(out + b * so_b + heads[:, None] * so_h + d[None, :], _rounded(result, out.dtype.element_ty, EMULATE),
                 mask=q_mask)
