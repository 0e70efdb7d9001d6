"""The fast CPU path for paged decode attention: a C++ kernel (csrc/attention_cpu.cpp).

One work item per (sequence, kv head): keys are read through the block table (no gather copy),
scores for the whole query group at once (fp32 FMA, or AVX512_BF16 dot products with fp32
accumulation), softmax in fp32, V accumulated in fp32; long sequences with few work items are split
and merged (flash-decoding). The KV store copies each token's rows in one call (torch's index_copy_
pays ~15-30 us per call in a decode step). Same contracts as attention_torch.py.
"""
from __future__ import annotations

from loramux.ops.attention_torch import store_kv_torch
from loramux.ops.cpu_extension import load_extension


def available() -> bool:
    return load_extension("attention_cpu") is not None


def decode_attention_cpu(q, k_cache, v_cache, block_tables, context_lens, block_size: int, scale: float):
    return load_extension("attention_cpu").decode_attention(q, k_cache, v_cache, block_tables, context_lens,
                                                            int(block_size), float(scale))


def store_kv_cpu(k_cache, v_cache, k, v, cache_rows) -> None:
    if k.stride(-1) != 1 or v.stride(-1) != 1 or not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        return store_kv_torch(k_cache, v_cache, k, v, cache_rows)
    load_extension("attention_cpu").store_kv(k_cache, v_cache, k, v, cache_rows)
