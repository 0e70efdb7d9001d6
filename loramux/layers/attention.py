"""Attention over a paged KV cache, in pure torch (SDPA).

The cache of one layer is flat: k_cache / v_cache [num_blocks * block_size, kv_heads, head_dim]; a
token's K/V live at index block_table[pos // block_size] * block_size + pos % block_size.
Prefill steps hold only new sequences (recompute preemption, no prefix cache), so they attend within
their own tokens: padded to [batch, max_len] and run causally. Decode steps call a paged
decode-attention op, and every step a KV-store op (ops.select_attention_backend and
select_kv_store_backend, chosen once by the model runner).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from loramux.ops.attention_torch import decode_attention_torch, store_kv_torch

_HAS_GQA = tuple(int(p) for p in torch.__version__.split(".")[:2]) >= (2, 5)


@dataclass
class AttentionMetadata:
    is_prefill: bool
    slot_mapping: torch.Tensor  # [num_tokens] cache index where each new token's K/V is written
    pad_index: torch.Tensor | None = None  # prefill: [batch, max_len] token index per padded position
    unpad_index: torch.Tensor | None = None  # prefill: [num_tokens] position in the flattened padding
    block_tables: torch.Tensor | None = None  # decode: [batch, max_blocks] block ids (padding: block 0)
    context_lens: torch.Tensor | None = None  # decode: [batch] keys per sequence, this token's included
    block_size: int = 16


class Attention(nn.Module):
    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.scale = scale
        self.k_cache: torch.Tensor | None = None  # assigned by the model runner, with decode_op and store_op
        self.v_cache: torch.Tensor | None = None
        self.decode_op = decode_attention_torch
        self.store_op = store_kv_torch

    def forward(self, q, k, v, meta: AttentionMetadata) -> torch.Tensor:
        """q: [num_tokens, heads, head_dim]; k, v: [num_tokens, kv_heads, head_dim] -> [num_tokens, heads * head_dim]."""
        if self.k_cache is not None:
            self.store_op(self.k_cache, self.v_cache, k, v, meta.slot_mapping)
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
        out = self.decode_op(q, self.k_cache, self.v_cache, meta.block_tables, meta.context_lens, meta.block_size,
                             self.scale)  # [batch, heads, head_dim]
        return out.reshape(q.shape[0], self.num_heads * self.head_dim)
