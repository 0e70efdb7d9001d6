"""Every paged decode-attention backend against a per-sequence loop that defines the op; every KV store
against a per-token copy."""
import math

import pytest
import torch

from conftest import backend_params
from loramux.ops import ATTENTION_BACKENDS, KV_STORE_BACKENDS, attention_cpu, attention_triton, select_attention_backend, triton_common
from loramux.ops.triton_tiles import AttentionTiles
from loramux.ops.attention_torch import decode_attention_by_length


def per_sequence_loop(q, k_cache, v_cache, block_tables, context_lens, block_size, scale):
    batch, heads, head_dim = q.shape
    group = heads // k_cache.shape[1]
    out = torch.empty(batch, heads, head_dim, dtype=torch.float64)
    for b in range(batch):
        n = int(context_lens[b])
        rows = [int(block_tables[b, p // block_size]) * block_size + p % block_size for p in range(n)]
        for h in range(heads):
            k = k_cache[rows, h // group].double()
            v = v_cache[rows, h // group].double()
            weights = torch.softmax(k @ q[b, h].double() * scale, dim=0)
            out[b, h] = weights @ v
    return out


CASES = [  # batch, heads, kv_heads, head_dim, block_size, context lengths
    (3, 9, 3, 64, 16, [1, 17, 40]),
    (2, 8, 8, 32, 4, [4, 9]),
    (4, 8, 2, 128, 16, [16, 32, 5, 33]),
    (1, 4, 1, 24, 5, [23]),
    (12, 9, 3, 64, 16, [1, 5, 16, 17, 31, 32, 33, 47, 64, 65, 100, 161]),  # enough sequences for a unit each
    (1, 9, 3, 64, 16, [700]),  # one long sequence: its keys split across threads and merged
    (2, 16, 2, 64, 16, [300, 45]),  # 8 query heads a kv head; the long one split, the short one whole
]


OPS = {**ATTENTION_BACKENDS, "torch-by-length": decode_attention_by_length}  # the last: batch_invariant's


@pytest.mark.parametrize("backend", backend_params(OPS, attention_cpu.available))
@pytest.mark.parametrize("dtype, atol", [(torch.float32, 1e-5), (torch.bfloat16, 3e-2)])
@pytest.mark.parametrize("case", CASES)
def test_backend_matches_per_sequence_loop(backend, dtype, atol, case):
    batch, heads, kv_heads, head_dim, block_size, lengths = case
    torch.manual_seed(0)
    max_blocks = max(math.ceil(n / block_size) for n in lengths) + 1  # one spare: padding is ignored
    num_blocks = batch * max_blocks + 2
    k_cache = torch.randn(num_blocks * block_size, kv_heads, head_dim, dtype=dtype)
    v_cache = torch.randn(num_blocks * block_size, kv_heads, head_dim, dtype=dtype)
    block_tables = torch.randperm(num_blocks)[: batch * max_blocks].view(batch, max_blocks)
    q = torch.randn(batch, heads, head_dim, dtype=dtype)
    context_lens = torch.tensor(lengths)
    scale = head_dim**-0.5
    out = OPS[backend](q, k_cache, v_cache, block_tables, context_lens, block_size, scale)
    expected = per_sequence_loop(q, k_cache, v_cache, block_tables, context_lens, block_size, scale)
    assert out.dtype == dtype and out.shape == (batch, heads, head_dim)
    torch.testing.assert_close(out.double(), expected, atol=atol, rtol=atol)


def test_by_length_results_do_not_depend_on_batch_mates():
    """decode_attention_by_length: a sequence's output is bit-identical alone and beside longer ones."""
    torch.manual_seed(1)
    block_size, kv_heads, heads, head_dim = 16, 2, 8, 32
    k_cache = torch.randn(64 * block_size, kv_heads, head_dim, dtype=torch.bfloat16)
    v_cache = torch.randn(64 * block_size, kv_heads, head_dim, dtype=torch.bfloat16)
    q = torch.randn(3, heads, head_dim, dtype=torch.bfloat16)
    tables = torch.randperm(64)[:30].view(3, 10)
    lens = torch.tensor([20, 150, 70])
    batch = decode_attention_by_length(q, k_cache, v_cache, tables, lens, block_size, 0.1)
    for i in range(3):
        alone = decode_attention_by_length(q[i:i + 1], k_cache, v_cache, tables[i:i + 1, :int(lens[i] + 15) // 16],
                                           lens[i:i + 1], block_size, 0.1)
        assert torch.equal(alone[0], batch[i])


def test_unknown_backend_is_named():
    with pytest.raises(ValueError, match="unknown attention backend 'flash'"):
        select_attention_backend("flash")


def test_cpu_backend_on_another_device_is_refused():
    with pytest.raises(ValueError, match="the 'cpu' attention backend runs on CPU tensors; the device is cuda"):
        select_attention_backend("cpu", "cuda")


@pytest.mark.parametrize("backend", list(KV_STORE_BACKENDS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tokens", [1, 32, 600])  # 600: the kernel's parallel path (prefill)
def test_kv_store_writes_each_token_to_its_slot(backend, dtype, tokens):
    if backend == "cpu" and not attention_cpu.available():
        pytest.skip("needs the C++ CPU kernel")
    torch.manual_seed(3)
    kv_heads, head_dim, slots = 3, 64, 1024
    qkv = torch.randn(tokens, (4 + 2 * kv_heads) * head_dim, dtype=dtype)  # k, v: strided views, as in the model
    k = qkv[:, 4 * head_dim : (4 + kv_heads) * head_dim].view(tokens, kv_heads, head_dim)
    v = qkv[:, (4 + kv_heads) * head_dim :].view(tokens, kv_heads, head_dim)
    k_cache, v_cache = torch.randn(2, slots, kv_heads, head_dim, dtype=dtype)
    cache_rows = torch.randperm(slots)[:tokens]
    expected_k, expected_v = k_cache.clone(), v_cache.clone()
    for t, slot in enumerate(cache_rows.tolist()):
        expected_k[slot], expected_v[slot] = k[t], v[t]
    KV_STORE_BACKENDS[backend](k_cache, v_cache, k, v, cache_rows)
    assert torch.equal(k_cache, expected_k) and torch.equal(v_cache, expected_v)


def test_cpu_kv_store_refuses_a_slot_outside_the_cache():
    if not attention_cpu.available():
        pytest.skip("needs the C++ CPU kernel")
    k_cache, v_cache = torch.zeros(2, 16, 2, 8)
    k = v = torch.ones(2, 2, 8)
    with pytest.raises(RuntimeError, match=r"cache_rows\[1\] = 16 outside \[0, 16\)"):
        attention_cpu.store_kv_cpu(k_cache, v_cache, k, v, torch.tensor([3, 16]))
    assert not k_cache.any()  # checked before anything is written


@pytest.mark.skipif(not triton_common.available("cpu"), reason="needs triton (its interpreter runs here)")
@pytest.mark.parametrize("split", [2, 3, 7])
@pytest.mark.parametrize("case", [CASES[0], CASES[3], CASES[6]])
def test_split_kv_pieces_merge_to_the_whole(split, case):
    """Split-KV (flash-decoding) with the pieces given: empty pieces (a context of 1 in 7 pieces) included."""
    batch, heads, kv_heads, head_dim, block_size, lengths = case
    torch.manual_seed(split)
    max_blocks = max(math.ceil(n / block_size) for n in lengths)
    k_cache = torch.randn(batch * max_blocks * block_size, kv_heads, head_dim)
    v_cache = torch.randn(batch * max_blocks * block_size, kv_heads, head_dim)
    block_tables = torch.randperm(batch * max_blocks).view(batch, max_blocks)
    q, context_lens = torch.randn(batch, heads, head_dim), torch.tensor(lengths)
    tiles = AttentionTiles(block_n=16)
    out = attention_triton.launch(q, k_cache, v_cache, block_tables, context_lens, block_size, 0.125, tiles, split)
    expected = per_sequence_loop(q, k_cache, v_cache, block_tables, context_lens, block_size, 0.125)
    torch.testing.assert_close(out.double(), expected, atol=1e-5, rtol=1e-5)
    again = attention_triton.launch(q, k_cache, v_cache, block_tables, context_lens, block_size, 0.125, tiles, split)
    assert torch.equal(out, again)  # pieces merged in a fixed order: the same bits every run
