"""PackedLinear: one Linear computing several projections side by side (q|k|v, gate|up)."""
from __future__ import annotations

import functools
from collections.abc import Sequence

import torch
from torch import nn

from loramux.layers import DirectCall
from loramux.layers.quantized import QuantizedLinear


class PackedLinear(nn.Linear):
    """`output_sizes` says which output columns belong to which projection; LoRAManager reads it to
    put each sub-adapter in its slice (the model's `packed_modules_mapping` names the projections)."""

    def __init__(self, in_features: int, output_sizes: Sequence[int], bias: bool = False):
        super().__init__(in_features, sum(output_sizes), bias=bias)
        self.output_sizes = tuple(output_sizes)


class PrepackedLinear(DirectCall, nn.Module):
    """A Linear whose weight lives in oneDNN's blocked layout, packed once at load (CPU only).

    At decode sizes (tens of rows) this runs the GEMM 1.2-2.4x faster than nn.Linear on this kind of
    CPU, the vocabulary projection most of all. The plain weight is not kept: no extra memory."""

    def __init__(self, linear: nn.Linear, batch_hint: int = 32):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        weight = linear.weight.detach()
        self.dtype, self.device = weight.dtype, weight.device
        # A plain attribute, not a buffer: an opaque oneDNN tensor has no place in a state_dict.
        self.packed_weight = torch.ops.mkldnn._reorder_linear_weight(weight, batch_hint)
        self.row_squares = weight.float().square().sum(1)  # [out] fp32: what DoRA needs of the weight, kept
        self.bias = linear.bias
        if hasattr(linear, "output_sizes"):
            self.output_sizes = linear.output_sizes

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.packed_weight, self.bias, "none", [], "")


class FixedRowsLinear(nn.Module):
    """A Linear whose every GEMM runs on exactly `rows` rows (the input split, the last piece zero-padded),
    so that a row's result never depends on how many rows share the call: GEMM libraries choose kernels and
    blockings by the row count, and their results differ in the last bits. For batch invariance."""

    def __init__(self, linear: nn.Module, rows: int = 32):
        super().__init__()
        self.linear, self.rows = linear, rows
        self.in_features, self.out_features = linear.in_features, linear.out_features

    @property
    def bias(self) -> torch.Tensor | None:
        return self.linear.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, self.in_features)
        n = flat.shape[0]
        pad = -n % self.rows
        if pad:
            flat = torch.cat([flat, flat.new_zeros(pad, self.in_features)])
        out = torch.cat([self.linear(chunk) for chunk in flat.split(self.rows)])
        return out[:n].view(*x.shape[:-1], self.out_features)


def fix_linear_rows(model: nn.Module, rows: int = 32) -> int:
    """Wrap every Linear in `model` (prepacked, quantized or not; LoRA layers' base Linears too) in a
    FixedRowsLinear."""
    targets = [(n, m) for n, m in model.named_modules() if isinstance(m, (nn.Linear, PrepackedLinear, QuantizedLinear))]
    for name, linear in targets:
        prefix, _, attr = name.rpartition(".")
        parent = model.get_submodule(prefix) if prefix else model
        parent.register_module(attr, FixedRowsLinear(linear, rows))
    return len(targets)


def can_prepack(device: torch.device, dtype: torch.dtype) -> bool:
    return device.type == "cpu" and dtype in (torch.float32, torch.bfloat16) and _onednn_packs(dtype)


@functools.cache
def _onednn_packs(dtype: torch.dtype) -> bool:
    """Whether oneDNN prepacks `dtype` weights on this CPU: bf16 needs AVX-512 (bw, vl, dq) or AVX-NE-CONVERT,
    and without them the reorder raises (an AVX2-only CPU then runs bf16 through plain nn.Linear)."""
    if not torch.backends.mkldnn.is_available():
        return False
    try:
        torch.ops.mkldnn._reorder_linear_weight(torch.zeros(16, 16, dtype=dtype), 1)
    except RuntimeError:
        return False
    return True


def prepack_linears(model: nn.Module) -> int:
    """Replace every nn.Linear in `model` (LoRA layers' base Linears too) by a PrepackedLinear."""
    targets = [(name, m) for name, m in model.named_modules() if isinstance(m, nn.Linear)]
    for name, linear in targets:
        prefix, _, attr = name.rpartition(".")
        parent = model.get_submodule(prefix) if prefix else model
        parent.register_module(attr, PrepackedLinear(linear))
    return len(targets)
