"""Every pointwise backend (RMSNorm, add + RMSNorm, SiLU-and-mul, rotary, argmax) against HF transformers' formulas
(argmax: torch's); the Triton kernels in its interpreter on CPU tensors."""
import pytest
import torch

from loramux.ops import POINTWISE_BACKENDS, pointwise_cpu, triton_common

DTYPES = [torch.float32, torch.bfloat16]


def backend_or_skip(name):
    if name == "cpu" and not pointwise_cpu.available():
        pytest.skip("needs the C++ CPU kernel")
    if name == "triton" and not triton_common.available("cpu"):
        pytest.skip("needs triton and TRITON_INTERPRET=1")
    return POINTWISE_BACKENDS[name]


def rows_for(backend: str, rows: int) -> int:
    """The Triton kernels run one program per row, each row alike: in the interpreter, 17 rows show as much as
    300 (and take a tenth of the time)."""
    return min(rows, 17) if backend == "triton" else rows


def assert_matches(out, expected):
    """fp32: to rounding; bf16: an fp32 sum or exp may land a value on the other side of a bf16 rounding
    boundary, rarely: then it differs by an ulp or two."""
    assert out.dtype == expected.dtype and out.shape == expected.shape
    if out.dtype == torch.float32:
        torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
    else:
        torch.testing.assert_close(out.float(), expected.float(), atol=1e-6, rtol=2 ** -6)
        assert (out == expected).float().mean() > 0.99


def hf_rms_norm(x, weight, eps):
    """transformers' LlamaRMSNorm.forward, step by step."""
    hidden = x.to(torch.float32)
    variance = hidden.pow(2).mean(-1, keepdim=True)
    hidden = hidden * torch.rsqrt(variance + eps)
    return weight * hidden.to(x.dtype)


def hf_rotate_half(x):
    return torch.cat((-x[..., x.shape[-1] // 2 :], x[..., : x.shape[-1] // 2]), dim=-1)


@pytest.mark.parametrize("backend", list(POINTWISE_BACKENDS))
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows, dim", [(1, 16), (7, 40), (300, 576)])  # 300 rows: the kernels' parallel path
@pytest.mark.parametrize("with_residual", [False, True])
def test_rms_norm_matches_hf(backend, dtype, rows, dim, with_residual):
    """rms_norm(x); add_rms_norm(x, residual): LlamaDecoderLayer's `hidden_states = residual + hidden_states` in
    the model's dtype, then the norm of that."""
    ops, rows = backend_or_skip(backend), rows_for(backend, rows)
    torch.manual_seed(0)
    x = (torch.randn(rows, dim + 24, dtype=dtype) * 3)[:, 5 : 5 + dim]  # strided rows, as a fused output's slice
    weight = (torch.randn(dim) * 0.5 + 1).to(dtype)
    if not with_residual:
        assert_matches(ops.rms_norm(x, weight, 1e-5), hf_rms_norm(x, weight, 1e-5))
        return
    residual = (torch.randn(rows, dim + 8, dtype=dtype) * 5)[:, 8:]  # strided too
    out, new_residual = ops.add_rms_norm(x, residual, weight, 1e-5)
    assert torch.equal(new_residual, residual + x)
    assert_matches(out, hf_rms_norm(residual + x, weight, 1e-5))


@pytest.mark.parametrize("backend", list(POINTWISE_BACKENDS))
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows, d", [(1, 8), (5, 40), (300, 1536)])
def test_silu_and_mul_matches_hf(backend, dtype, rows, d):
    ops, rows = backend_or_skip(backend), rows_for(backend, rows)
    torch.manual_seed(1)
    x = torch.randn(rows, 2 * d, dtype=dtype) * 4  # [gate | up], as the fused gate_up projection
    gate, up = x[:, :d], x[:, d:]
    expected = torch.nn.functional.silu(gate) * up  # LlamaMLP: act_fn(gate_proj(x)) * up_proj(x)
    assert_matches(ops.silu_and_mul(x), expected)


@pytest.mark.parametrize("backend", list(POINTWISE_BACKENDS))
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens, head_dim", [(1, 8), (3, 40), (300, 64)])
def test_rotary_matches_hf(backend, dtype, tokens, head_dim):
    ops, tokens = backend_or_skip(backend), rows_for(backend, tokens)
    torch.manual_seed(2)
    heads, kv_heads = 4, 2
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * head_dim, dtype=dtype)  # q, k: strided views of a fused output
    q = qkv[:, : heads * head_dim].view(tokens, heads, head_dim)
    k = qkv[:, heads * head_dim : (heads + kv_heads) * head_dim].view(tokens, kv_heads, head_dim)
    angles = torch.randn(tokens, head_dim // 2) * 3
    cos, sin = (torch.cat((f(angles), f(angles)), dim=-1).to(dtype) for f in (torch.cos, torch.sin))
    # transformers' apply_rotary_pos_emb (unsqueeze_dim=1 for [tokens, heads, head_dim])
    expected = [x * cos[:, None] + hf_rotate_half(x) * sin[:, None] for x in (q.clone(), k.clone())]
    q_out, k_out = ops.rotary(q, k, cos, sin)
    assert_matches(q_out, expected[0])
    assert_matches(k_out, expected[1])


@pytest.mark.skipif(not pointwise_cpu.available(), reason="needs the C++ CPU kernel")
def test_cpu_ops_take_what_the_kernels_cannot_through_torch():
    x, weight = torch.randn(3, 4, 8), torch.ones(8)  # 3-D
    torch.testing.assert_close(pointwise_cpu.rms_norm(x, weight, 1e-6), hf_rms_norm(x, weight, 1e-6))
    bf16_x = torch.randn(4, 8, dtype=torch.bfloat16)  # weight of another dtype: torch's promotion rules
    assert pointwise_cpu.rms_norm(bf16_x, weight, 1e-6).dtype == torch.float32
    q, k = torch.randn(2, 2, 8), torch.randn(2, 1, 8)
    cos, sin = torch.ones(2, 8, dtype=torch.float64), torch.zeros(2, 8, dtype=torch.float64)  # another dtype
    q_out, k_out = pointwise_cpu.rotary(q, k, cos, sin)
    torch.testing.assert_close(q_out, q.double())
    torch.testing.assert_close(k_out, k.double())
    residual = torch.randn(3, 4, 8)
    out, new_residual = pointwise_cpu.add_rms_norm(x, residual, weight, 1e-6)  # 3-D
    torch.testing.assert_close(out, hf_rms_norm(residual + x, weight, 1e-6))
    assert pointwise_cpu.add_rms_norm(bf16_x, bf16_x.float(), weight, 1e-6)[1].dtype == torch.float32  # mixed dtypes
    logits = torch.randn(3, 50, dtype=torch.bfloat16)  # not fp32
    assert torch.equal(pointwise_cpu.argmax(logits), logits.argmax(dim=-1))
    assert pointwise_cpu.argmax(torch.randn(0, 50)).shape == (0,)


@pytest.mark.parametrize("backend", list(POINTWISE_BACKENDS))
@pytest.mark.parametrize("rows, vocab", [(1, 7), (5, 40), (32, 49152)])  # 49152: SmolLM2's vocabulary
def test_argmax_is_torch_argmax(backend, rows, vocab):
    ops = backend_or_skip(backend)
    torch.manual_seed(2)
    x = torch.randn(rows, vocab + 3)[:, :vocab]  # strided rows
    x[0, vocab // 2] = x[0, vocab - 1] = x[0].max() + 1  # a tie: the first index wins
    if rows > 1:
        x[1, -1] = x[1].max() + 1  # the maximum in the last (partial) vector
    assert torch.equal(ops.argmax(x), x.argmax(dim=-1))


@pytest.mark.parametrize("backend", list(POINTWISE_BACKENDS))
def test_argmax_nan_and_infinities_as_torch(backend):
    ops = backend_or_skip(backend)
    x = torch.randn(5, 37)
    x[0, 5], x[0, 30] = float("nan"), float("nan")  # the first NaN counts as the maximum
    x[1] = float("-inf")  # all -inf: index 0
    x[2, 20], x[2, 36] = float("inf"), float("inf")
    x[3, 3], x[3, 33] = float("inf"), float("nan")
    x[4] = -1.0
    x[4, 9], x[4, 30] = -0.0, 0.0  # equal maxima: the first
    expected = x.argmax(dim=-1)
    assert expected.tolist() == [5, 0, 20, 33, 9]
    assert torch.equal(ops.argmax(x), expected)
