"""The fast CPU path for RMSNorm: a C++ kernel (csrc/norm_cpu.cpp), one pass per row. Same contract as
norm_torch.py; inputs it cannot take (not 2-D, a strided last dim, a weight of another dtype) go to
the torch path."""
from __future__ import annotations

from loramux.ops.cpu_extension import load_extension
from loramux.ops.norm_torch import rms_norm_torch


def available() -> bool:
    return load_extension("norm_cpu") is not None


def rms_norm_cpu(x, weight, eps: float):
    if x.dim() != 2 or x.stride(1) != 1 or weight.dtype != x.dtype:
        return rms_norm_torch(x, weight, eps)
    return load_extension("norm_cpu").rms_norm(x, weight, float(eps))
