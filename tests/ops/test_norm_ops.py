"""Every RMSNorm backend against HF transformers' LlamaRMSNorm formula, written out."""
import pytest
import torch

from loramux.ops import NORM_BACKENDS, norm_cpu


def hf_rms_norm(x, weight, eps):
    """transformers' LlamaRMSNorm.forward, step by step."""
    hidden = x.to(torch.float32)
    variance = hidden.pow(2).mean(-1, keepdim=True)
    hidden = hidden * torch.rsqrt(variance + eps)
    return weight * hidden.to(x.dtype)


@pytest.mark.parametrize("backend", list(NORM_BACKENDS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows, dim", [(1, 16), (7, 40), (300, 576)])  # 300 rows: the kernel's parallel path
def test_rms_norm_matches_hf(backend, dtype, rows, dim):
    torch.manual_seed(0)
    wide = torch.randn(rows, dim + 24, dtype=dtype) * 3
    x = wide[:, 5 : 5 + dim]  # rows with a stride, as a slice of a fused projection's output
    weight = (torch.randn(dim) * 0.5 + 1).to(dtype)
    if backend == "cpu" and not norm_cpu.available():
        pytest.skip("needs the C++ CPU kernel")
    out = NORM_BACKENDS[backend](x, weight, 1e-5)
    expected = hf_rms_norm(x, weight, 1e-5)
    assert out.dtype == dtype and out.shape == (rows, dim)
    if dtype == torch.float32:
        torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
    else:  # the fp32 sum's order may move a value across a bf16 rounding boundary: one ulp, rarely
        torch.testing.assert_close(out.float(), expected.float(), atol=0, rtol=2 ** -6)  # two roundings: <= 2 ulp
        assert (out == expected).float().mean() > 0.99


@pytest.mark.skipif(not norm_cpu.available(), reason="needs the C++ CPU kernel")
def test_cpu_norm_takes_what_the_kernel_cannot_through_torch():
    x = torch.randn(3, 4, 8)  # 3-D
    weight = torch.ones(8)
    torch.testing.assert_close(norm_cpu.rms_norm_cpu(x, weight, 1e-6), hf_rms_norm(x, weight, 1e-6))
    bf16_x = torch.randn(4, 8, dtype=torch.bfloat16)  # weight of another dtype: torch's promotion rules
    assert norm_cpu.rms_norm_cpu(bf16_x, weight, 1e-6).dtype == torch.float32
