"""The CPU kernel for weight-only quantized linear layers (csrc/quant_cpu.cpp): same contract as
quant_torch.quantized_linear. Decode (a few rows of x) reads each weight once, decoded in registers;
prefill decodes panels of W and runs torch's GEMM."""
from __future__ import annotations

import functools

import torch

from loramux.ops import lora_cpu, quant_torch
from loramux.ops.cpu_extension import load_extension
from loramux.ops.quant_torch import QuantizedWeight


def available() -> bool:
    return load_extension("quant_cpu") is not None


_DTYPES = (torch.float32, torch.bfloat16)


@functools.cache
def _has_lora() -> bool:
    """Whether the build has qlinear_lora (AVX-512: the rest of the kernel needs AVX2 only)."""
    return load_extension("quant_cpu").has_lora()


def quantized_linear(x: torch.Tensor, weight: QuantizedWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
    # ~120 calls a decode step: the common case (2-D x) first, with as few tensor-attribute reads as possible
    if x.dtype in _DTYPES and not weight.in_features % 32 and x.is_cpu:
        if x.dim() == 2:
            return load_extension("quant_cpu").qlinear(x, weight.data, weight.fmt, weight.in_features, bias)
        out = load_extension("quant_cpu").qlinear(x.reshape(-1, weight.in_features), weight.data, weight.fmt,
                                                  weight.in_features, bias)
        return out.view(*x.shape[:-1], weight.out_features)
    return quant_torch.quantized_linear(x, weight, bias)


def quantized_linear_lora(x: torch.Tensor, weight: QuantizedWeight, bias: torch.Tensor | None, lora_a: torch.Tensor,
                          lora_b: torch.Tensor, slot_ranks: torch.Tensor, slot: int, output_slices) -> torch.Tensor:
    """quant_torch.quantized_linear_lora's contract. One row of x (batch-1 decode) runs the base matmul and the
    LoRA in one C++ call; anything else, this backend's matmul and then the C++ LoRA kernel (the op a LoRA layer
    that calls this one has: ops.fuses_with_quantized), or the reference LoRA where that kernel cannot run."""
    kernels_take = x.is_cpu and x.dtype in _DTYPES and (x.dtype is torch.float32 or lora_a.dtype is torch.bfloat16)
    if kernels_take and x.dim() == 2 and x.shape[0] == 1 and not weight.in_features % 32 and _has_lora():
        return load_extension("quant_cpu").qlinear_lora(x, weight.data, weight.fmt, weight.in_features, bias, lora_a,
                                                        lora_b, slot_ranks, slot, output_slices)
    add_lora = lora_cpu.add_lora_cpu if kernels_take and lora_cpu.available() else None
    return quant_torch.add_slot_lora(quantized_linear(x, weight, bias), x, lora_a, lora_b, slot_ranks, slot,
                                     output_slices, add_lora)


def dequantize(weight: QuantizedWeight, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    if dtype not in (torch.float32, torch.bfloat16) or weight.in_features % 32:
        return quant_torch.dequantize(weight).to(dtype)
    return load_extension("quant_cpu").dequantize(weight.data, weight.fmt, weight.in_features, dtype)
