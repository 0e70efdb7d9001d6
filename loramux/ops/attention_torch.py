"""Paged decode attention and the KV-cache store in pure torch: the specification, the oracle and the
portable fallback.

Every decode-attention op has the signature
    op(q, k_cache, v_cache, block_tables, context_lens, block_size, scale) -> out
  q:            [batch, heads, head_dim]              one query token per sequence
  k/v_cache:    [num_blocks * block_size, kv_heads, head_dim]; position p of a sequence lives at
                row block_tables[b, p // block_size] * block_size + p % block_size
  block_tables: [batch, max_blocks] int64 (padding: any block id)
  context_lens: [batch] int64, >= 1: keys 0..len-1 are attended
  out:          [batch, heads, head_dim]; GQA: head h uses kv head h // (heads // kv_heads)

Every KV-store op has the signature
    store(k_cache, v_cache, k, v, cache_rows) -> None, in place
  k, v:         [num_tokens, kv_heads, head_dim] the new tokens' keys and values (any strides)
  cache_rows: [num_tokens] int64, the cache row of each token: k_cache[cache_rows[t]] = k[t], same for v
"""
from __future__ import annotations

import torch


def decode_attention_torch(q, k_cache, v_cache, block_tables, context_lens, block_size: int, scale: float):
    batch, num_heads, head_dim = q.shape
    kv_heads = k_cache.shape[1]
    context = block_tables.shape[1] * block_size
    k, v = (c.view(-1, block_size, kv_heads, head_dim)[block_tables].view(batch, context, kv_heads, head_dim)
            .transpose(1, 2) for c in (k_cache, v_cache))  # [batch, kv_heads, context, head_dim]
    # Each kv head's query group becomes the query-length axis: GQA without repeated K/V.
    qg = q.reshape(batch, kv_heads, num_heads // kv_heads, head_dim)
    scores = torch.matmul(qg, k.transpose(-1, -2)).float().mul_(scale)  # [batch, kv_heads, group, context]
    pad = torch.arange(context, device=q.device) >= context_lens[:, None, None, None]
    scores.masked_fill_(pad, float("-inf"))
    return torch.matmul(scores.softmax(-1).to(q.dtype), v).reshape(batch, num_heads, head_dim)


def decode_attention_by_length(q, k_cache, v_cache, block_tables, context_lens, block_size: int, scale: float):
    """decode_attention_torch over groups of sequences with the same number of blocks, each group padded to
    its own length only: a sequence's result depends on its own length, never on its batch mates' (the
    padded reductions of one call over the whole batch follow the longest sequence). For batch invariance."""
    blocks = (context_lens + block_size - 1) // block_size
    out = torch.empty_like(q)
    for count in blocks.unique().tolist():
        rows = (blocks == count).nonzero().squeeze(1)
        out[rows] = decode_attention_torch(q[rows], k_cache, v_cache, block_tables[rows, :count], context_lens[rows],
                                           block_size, scale)
    return out


def store_kv_torch(k_cache, v_cache, k, v, cache_rows) -> None:
    k_cache.index_copy_(0, cache_rows, k)
    v_cache.index_copy_(0, cache_rows, v)
