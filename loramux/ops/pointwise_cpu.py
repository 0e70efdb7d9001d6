"""The fast CPU paths for the pointwise ops: C++ kernels (csrc/pointwise_cpu.cpp), one pass over each
row with the reference's roundings. Same contract as pointwise_torch.py; inputs a kernel cannot take
go to the torch path. torch runs each of these as a chain of elementwise ops (RMSNorm alone ~50 us for
32 x 576 bf16, 61 calls per SmolLM2 decode step)."""
from __future__ import annotations

import torch

from loramux.ops import pointwise_torch
from loramux.ops.cpu_extension import load_extension


def available() -> bool:
    return load_extension("pointwise_cpu") is not None


def rms_norm(x, weight, eps: float):
    if x.dim() != 2 or x.stride(1) != 1 or weight.dtype != x.dtype:
        return pointwise_torch.rms_norm(x, weight, eps)
    return load_extension("pointwise_cpu").rms_norm(x, weight, float(eps))


def add_rms_norm(x, residual, weight, eps: float):
    fits = x.dim() == 2 and x.shape == residual.shape and x.stride(1) == 1 and residual.stride(1) == 1
    if not (fits and weight.dtype == x.dtype and residual.dtype == x.dtype):
        return pointwise_torch.add_rms_norm(x, residual, weight, eps)
    out, new_residual = load_extension("pointwise_cpu").add_rms_norm(x, residual, weight, float(eps))
    return out, new_residual


def silu_and_mul(x):
    if x.dim() != 2 or x.stride(1) != 1 or x.shape[1] % 2:
        return pointwise_torch.silu_and_mul(x)
    return load_extension("pointwise_cpu").silu_and_mul(x)


def rotary(q, k, cos, sin):
    fits = all(t.dim() == 3 and t.stride(2) == 1 and t.dtype == q.dtype for t in (q, k)) and q.shape[2] % 2 == 0
    if not (fits and cos.dtype == q.dtype and cos.is_contiguous() and sin.is_contiguous()):
        return pointwise_torch.rotary(q, k, cos, sin)
    load_extension("pointwise_cpu").rotary_(q, k, cos, sin)
    return q, k


def argmax(x):
    if x.dim() != 2 or x.stride(1) != 1 or x.dtype != torch.float32 or x.shape[1] == 0:
        return pointwise_torch.argmax(x)
    return load_extension("pointwise_cpu").argmax(x)
