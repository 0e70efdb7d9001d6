"""Attention over a paged KV cache, in pure torch (SDPA).

The cache of one layer is flat: k_cache / v_cache [num_blocks * block_size, kv_heads, head_dim]; a
token's K/V live at index block_table[pos // block_size] * block_size + pos % block_size.
A prompt computed whole attends within its own tokens: padded to [batch, max_len] and run causally. Chunked
prefill mixes decode rows and prompt chunks in one step; a chunk that starts after a sequence's first token (a
later chunk, or a prompt whose first blocks the prefix cache holds) reads its earlier keys from the cache.
Decode steps call a paged decode-attention op, and every step a KV-store op (attention_ops:
ops.select_attention_ops's, bound once by the model runner with ops.bind_ops). Where that op is the C++ kernel,
the model runner hands every step to it as decode rows, prompt tokens included (ModelRunner.rows_attention), and
the SDPA paths here serve the torch and Triton backends.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from loramux.layers import DirectCall
from loramux.ops.attention_torch import decode_attention_torch, store_kv_torch

_HAS_GQA = tuple(int(p) for p in torch.__version__.split(".")[:2]) >= (2, 5)


@dataclass
class AttentionMetadata:
    is_prefill: bool
    cache_rows: torch.Tensor  # [num_tokens] cache index where each new token's K/V is written
    pad_index: torch.Tensor | None = None  # prefill: [batch, max_len] token index per padded position
    unpad_index: torch.Tensor | None = None  # prefill: [num_tokens] position in the flattened padding
    seq_offsets: list[int] | None = None  # prefill: [batch + 1] where each sequence's tokens start (and end)
    # decode: one row per new token (each decoding sequence's, or with rows_attention every token of the step)
    block_tables: torch.Tensor | None = None  # decode: [rows, max_blocks] the row's block ids (padding: block 0)
    context_lens: torch.Tensor | None = None  # decode: [rows] keys the row attends to, its own included
    block_size: int = 16
    # chunked prefill (a mixed step): the first num_decode tokens are decode rows (block_tables and
    # context_lens describe them); then prompt chunks, each (token offset, start, end): its query rows are
    # tokens offset .. offset + end - start, at positions start..end-1, and it attends to its sequence's
    # positions 0..end-1. A chunk with start 0 attends causally within its own new K/V; a later one reads
    # them from the cache: chunk_context holds its (cache index [end], mask [end - start, end]), built once
    # a step for all layers (None for a chunk with start 0). On a GPU (ModelRunner.pad_fresh_chunks) two or
    # more chunks with start 0 run as one padded call instead: fresh holds their rows [n] in the step,
    # pad_index and unpad_index (as a whole prefill's), and chunks lists the others.
    num_decode: int = 0
    chunks: list[tuple[int, int, int]] | None = None
    chunk_context: list[tuple[torch.Tensor, torch.Tensor] | None] | None = None
    fresh: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None


class Attention(DirectCall, nn.Module):
    attention_ops = {"decode_op": "decode_attention", "store_op": "store_kv"}  # bound by the model runner (ops.bind_ops)

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.scale = scale
        self.k_cache: torch.Tensor | None = None  # assigned by the model runner
        self.v_cache: torch.Tensor | None = None
        self.decode_op = decode_attention_torch  # the references until the model runner binds attention_ops
        self.store_op = store_kv_torch
        self.prefill = self.prefill_padded  # or prefill_per_sequence (batch-invariant); chosen by the model runner

    def forward(self, q, k, v, meta: AttentionMetadata) -> torch.Tensor:
        """q: [num_tokens, heads, head_dim]; k, v: [num_tokens, kv_heads, head_dim] -> [num_tokens, heads * head_dim]."""
        if self.k_cache is not None:
            self.store_op(self.k_cache, self.v_cache, k, v, meta.cache_rows)
        if meta.chunks is not None:
            return self._mixed(q, k, v, meta)
        if meta.is_prefill:
            return self.prefill(q, k, v, meta)
        return self._decode(q, meta)

    def _mixed(self, q, k, v, meta: AttentionMetadata) -> torch.Tensor:
        """A chunked-prefill step: decode rows through the decode op; a chunk that starts its prompt through
        causal SDPA over its own new K/V (the values just stored), a later one over its sequence's cached
        keys (this chunk's included) with the causal mask shifted by its start."""
        if meta.num_decode == q.shape[0]:  # decode rows only: no output to assemble (one copy less a layer)
            return self._decode(q, meta)
        out = q.new_empty(q.shape[0], self.num_heads * self.head_dim)
        if meta.num_decode:
            out[:meta.num_decode] = self._decode(q[:meta.num_decode], meta)
        if meta.fresh is not None:
            rows, pad_index, unpad_index = meta.fresh
            out[rows] = self._padded(q, k, v, pad_index, unpad_index)
        for (offset, start, end), context in zip(meta.chunks, meta.chunk_context):
            rows = slice(offset, offset + end - start)
            if context is None:
                keys, values, mask = k[rows], v[rows], None
            else:
                index, mask = context
                keys, values = self.k_cache[index], self.v_cache[index]
            out[rows] = self._sdpa_rows(q[rows], keys, values, mask)
        return out

    def prefill_padded(self, q, k, v, meta: AttentionMetadata) -> torch.Tensor:
        """All sequences in one call: [batch, heads, max_len, head_dim]; padded query rows are computed and then
        dropped. (A sequence's result may depend on max_len: the kernel's blocking follows the padded length.)"""
        if meta.pad_index.shape[0] == 1:  # one sequence: nothing to pad (the same call, without the gathers)
            return self._sdpa_rows(q, k, v)
        return self._padded(q, k, v, meta.pad_index, meta.unpad_index)

    def _padded(self, q, k, v, pad_index: torch.Tensor, unpad_index: torch.Tensor) -> torch.Tensor:
        """Causal attention of several sequences' new tokens in one call: pad_index [batch, max_len] gathers
        each one's rows (padding repeats its last token, which no real query sees), unpad_index [tokens]
        picks the real rows of the [batch * max_len] result -> [tokens, heads * head_dim]."""
        q, k, v = (t[pad_index].transpose(1, 2) for t in (q, k, v))
        out = self._sdpa(q, k, v).transpose(1, 2).reshape(-1, self.num_heads * self.head_dim)
        return out[unpad_index]

    def prefill_per_sequence(self, q, k, v, meta: AttentionMetadata) -> torch.Tensor:
        """One call per sequence, at its own length: its result never depends on its batch mates."""
        offsets = meta.seq_offsets
        return torch.cat([self._sdpa_rows(q[s:e], k[s:e], v[s:e]) for s, e in zip(offsets, offsets[1:])])

    def _sdpa_rows(self, q, k, v, mask: torch.Tensor | None = None) -> torch.Tensor:
        """One sequence's rows: q [len, heads, d], k, v [keys, kv_heads, d] -> [len, heads * d]."""
        out = self._sdpa(*(t.transpose(0, 1).unsqueeze(0) for t in (q, k, v)), mask)  # [1, heads, len, d]
        return out[0].transpose(0, 1).reshape(q.shape[0], self.num_heads * self.head_dim)

    def _sdpa(self, q, k, v, mask: torch.Tensor | None = None) -> torch.Tensor:
        """Causal, or with `mask` ([q_len, k_len] bool, True = attend) when queries start after keys do."""
        causal = mask is None
        if _HAS_GQA:
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal, scale=self.scale,
                                                  enable_gqa=True)
        groups = self.num_heads // self.num_kv_heads
        k, v = k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal, scale=self.scale)

    def _decode(self, q, meta: AttentionMetadata) -> torch.Tensor:
        out = self.decode_op(q, self.k_cache, self.v_cache, meta.block_tables, meta.context_lens, meta.block_size,
                             self.scale)  # [batch, heads, head_dim]
        return out.reshape(q.shape[0], self.num_heads * self.head_dim)
