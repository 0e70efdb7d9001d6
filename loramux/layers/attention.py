"""Attention over a paged KV cache, in pure torch (SDPA).

The cache of one layer is flat: k_cache / v_cache [num_blocks * block_size, kv_heads, head_dim]; a
token's K/V live at index block_table[pos // block_size] * block_size + pos % block_size.
Prefill steps hold only new sequences (recompute preemption, no prefix cache), so they attend within
their own tokens: padded to [batch, max_len] and run causally. Decode steps gather each sequence's
whole blocks through its block table (block-sized copies, not per-token ones) and mask the padding.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

_HAS_GQA = tuple(int(p) for p in torch.__version__.split(".")[:2]) >= (2, 5)


@dataclass
class AttentionMetadata:
    is_prefill: bool
    slot_mapping: torch.Tensor  # [num_tokens] cache index where each new token's K/V is written
    pad_index: torch.Tensor | None = None  # prefill: [batch, max_len] token index per padded position
    unpad_index: torch.Tensor | None = None  # prefill: [num_tokens] position in the flattened padding
    block_tables: torch.Tensor | None = None  # decode: [batch, max_blocks] block ids (padding: block 0)
    pad_mask: torch.Tensor | None = None  # decode: [batch, 1, 1, max_blocks * block_size] True = padding


class Attention(nn.Module):
    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.scale = scale
        self.k_cache: torch.Tensor | None = None  # assigned by the model runner
        self.v_cache: torch.Tensor | None = None

    def forward(self, q, k, v, meta: AttentionMetadata) -> torch.Tensor:
        """q: [num_tokens, heads, head_dim]; k, v: [num_tokens, kv_heads, head_dim] -> [num_tokens, heads * head_dim]."""
        if self.k_cache is not None:
            self.k_cache.index_copy_(0, meta.slot_mapping, k)
            self.v_cache.index_copy_(0, meta.slot_mapping, v)
        if meta.is_prefill:
            return self._prefill(q, k, v, meta)
        return self._decode(q, meta)

    def _prefill(self, q, k, v, meta: AttentionMetadata) -> torch.Tensor:
        # [batch, heads, max_len, head_dim]; padded query rows are computed and then dropped.
        q, k, v = (t[meta.pad_index].transpose(1, 2) for t in (q, k, v))
        if _HAS_GQA:
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=self.scale, enable_gqa=True)
        else:
            groups = self.num_heads // self.num_kv_heads
            k, v = k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1)
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=self.scale)
        out = out.transpose(1, 2).reshape(-1, self.num_heads * self.head_dim)
        return out[meta.unpad_index]

    def _decode(self, q, meta: AttentionMetadata) -> torch.Tensor:
        batch, context = q.shape[0], meta.pad_mask.shape[-1]
        k, v = (self._gather(cache, meta.block_tables, context) for cache in (self.k_cache, self.v_cache))
        # One query per sequence: each kv head's query group becomes the query-length axis, so GQA
        # needs no repeated K/V. Plain matmuls beat SDPA's CPU kernel at this shape (1.5x, bf16 1.7x).
        q = q.view(batch, self.num_kv_heads, self.num_heads // self.num_kv_heads, self.head_dim)
        scores = torch.matmul(q, k.transpose(-1, -2)).float().mul_(self.scale)  # [batch, kv_heads, group, context]
        scores.masked_fill_(meta.pad_mask, float("-inf"))
        out = torch.matmul(scores.softmax(-1).to(q.dtype), v)
        return out.reshape(batch, self.num_heads * self.head_dim)

    def _gather(self, cache: torch.Tensor, block_tables: torch.Tensor, context: int) -> torch.Tensor:
        """[batch, kv_heads, max_blocks * block_size, head_dim] keys (or values) of each sequence."""
        batch, max_blocks = block_tables.shape
        blocks = cache.view(-1, context // max_blocks, self.num_kv_heads, self.head_dim)
        return blocks[block_tables].view(batch, context, self.num_kv_heads, self.head_dim).transpose(1, 2)
