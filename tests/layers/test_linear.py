"""PrepackedLinear (oneDNN's blocked weights) against nn.Linear, where this CPU can prepack the dtype."""
import pytest
import torch
from torch import nn

from loramux.layers.linear import PackedLinear, PrepackedLinear, can_prepack, prepack_linears


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("rows", [1, 7, 32])
def test_prepacked_equals_linear(dtype, tol, rows):
    if not can_prepack(torch.device("cpu"), dtype):
        pytest.skip(f"oneDNN cannot prepack {dtype} on this CPU (bf16 needs AVX-512 or AVX-NE-CONVERT)")
    torch.manual_seed(0)
    linear = nn.Linear(48, 80, bias=True).to(dtype)
    x = torch.randn(rows, 48, dtype=dtype)
    torch.testing.assert_close(PrepackedLinear(linear)(x), linear(x), atol=tol, rtol=tol)


def test_prepack_linears_keeps_output_sizes_and_replaces_every_linear():
    if not can_prepack(torch.device("cpu"), torch.float32):
        pytest.skip("oneDNN is not available")
    model = nn.Sequential(PackedLinear(16, (8, 4)), nn.ReLU(), nn.Linear(12, 3))
    x = torch.randn(5, 16)
    expected = model(x)
    assert prepack_linears(model) == 2
    assert isinstance(model[0], PrepackedLinear) and model[0].output_sizes == (8, 4)
    torch.testing.assert_close(model(x), expected)


@pytest.mark.parametrize("rows", [1, 5, 32, 33, 70])
def test_fixed_rows_linear_is_the_linear_and_each_row_is_independent_of_the_others(rows):
    from loramux.layers.linear import FixedRowsLinear

    torch.manual_seed(0)
    linear = nn.Linear(64, 48).to(torch.bfloat16)
    fixed = FixedRowsLinear(linear, rows=32)
    x = torch.randn(rows, 64, dtype=torch.bfloat16)
    out = fixed(x)
    torch.testing.assert_close(out, linear(x), atol=2e-2, rtol=2e-2)
    for i in range(rows):  # bit for bit: the same row alone gives the same result
        assert torch.equal(fixed(x[i:i + 1])[0], out[i])
    assert fixed(x.view(1, rows, 64)).shape == (1, rows, 48)
