"""The per-token pointwise ops of a Llama layer in Triton, for CUDA; the contract is pointwise_torch.py's.

Each is one launch where the torch form takes several (the residual add and the norm; the activation and the
product; q's and k's rotation together): a decode step's kernels, and with them a CUDA graph's nodes, are few.
One program per token row (rotary: per token and head). Math in fp32, rounded to x's dtype wherever HF's
formulas round (rounded(): bf16 rounded to nearest even, emulated in the interpreter). What the kernels do
not take (another dtype for the weight or the tables, rows that are not 2-D) goes to the torch form.
"""
from __future__ import annotations

import torch

from loramux.ops import pointwise_torch
from loramux.ops.triton_common import INTERPRET, triton

if triton is not None:
    import triton.language as tl

    from loramux.ops.triton_common import rounded as _rounded


def _plain(x: torch.Tensor, *others: torch.Tensor) -> bool:
    """Rows the kernels take: 2-D, unit last stride, every other tensor of x's dtype."""
    return x.dim() == 2 and x.stride(-1) == 1 and all(t.dtype == x.dtype for t in others)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    if not _plain(x, weight) or not x.shape[0]:
        return pointwise_torch.rms_norm(x, weight, eps)
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    _norm[(x.shape[0],)](x, x, weight, out, out, x.shape[1], eps, x.stride(0), 0, out.stride(0), 0,
                         HAS_RESIDUAL=False, BLOCK=triton.next_power_of_2(x.shape[1]), EMULATE=INTERPRET)
    return out


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float):
    if not _plain(x, residual, weight) or residual.stride(-1) != 1 or not x.shape[0]:
        return pointwise_torch.add_rms_norm(x, residual, weight, eps)
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    summed = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    _norm[(x.shape[0],)](x, residual, weight, out, summed, x.shape[1], eps, x.stride(0), residual.stride(0),
                         out.stride(0), summed.stride(0), HAS_RESIDUAL=True, BLOCK=triton.next_power_of_2(x.shape[1]),
                         EMULATE=INTERPRET)
    return out, summed


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    if not _plain(x) or not x.shape[0]:
        return pointwise_torch.silu_and_mul(x)
    d = x.shape[1] // 2
    out = torch.empty(x.shape[0], d, dtype=x.dtype, device=x.device)
    block = min(1024, triton.next_power_of_2(d))
    _silu_and_mul[(x.shape[0], triton.cdiv(d, block))](x, out, d, x.stride(0), out.stride(0), BLOCK=block,
                                                        EMULATE=INTERPRET)
    return out


def rotary(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
    """In place: q and k rotated and returned."""
    plain = q.dim() == 3 and k.dim() == 3 and q.stride(-1) == 1 and k.stride(-1) == 1 and cos.stride(-1) == 1 \
        and sin.stride(-1) == 1 and all(t.dtype == q.dtype for t in (k, cos, sin))
    if not plain or not q.shape[0]:
        return pointwise_torch.rotary(q, k, cos, sin)
    tokens, heads, head_dim = q.shape
    _rotary[(tokens, heads + k.shape[1])](q, k, cos, sin, heads, head_dim // 2, q.stride(0), q.stride(1),
                                          k.stride(0), k.stride(1), cos.stride(0), sin.stride(0),
                                          BLOCK=triton.next_power_of_2(head_dim // 2), EMULATE=INTERPRET)
    return q, k


argmax = pointwise_torch.argmax  # (one kernel already)


if triton is not None:

    @triton.jit
    def _norm(x, res, w, out, summed, dim, eps, sx, sr, so, ss, HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr,
              EMULATE: tl.constexpr):
        """out[t] = w * round(v * rsqrt(mean(v^2) + eps)), v = x[t] (HAS_RESIDUAL: v = round(res[t] + x[t]),
        stored to summed[t])."""
        t = tl.program_id(0)
        d = tl.arange(0, BLOCK)
        keep = d < dim
        v = tl.load(x + t * sx + d, mask=keep, other=0.0).to(tl.float32)
        if HAS_RESIDUAL:
            v = v + tl.load(res + t * sr + d, mask=keep, other=0.0).to(tl.float32)
            v = _rounded(v, summed.dtype.element_ty, EMULATE)
            tl.store(summed + t * ss + d, v, mask=keep)
            v = v.to(tl.float32)
        normed = v * tl.rsqrt(tl.sum(v * v, 0) / dim + eps)
        normed = _rounded(normed, out.dtype.element_ty, EMULATE).to(tl.float32)
        weight = tl.load(w + d, mask=keep, other=0.0).to(tl.float32)
        tl.store(out + t * so + d, _rounded(weight * normed, out.dtype.element_ty, EMULATE), mask=keep)

    @triton.jit
    def _silu_and_mul(x, out, d, sx, so, BLOCK: tl.constexpr, EMULATE: tl.constexpr):
        """out[t, i] = round(round(silu(gate)) * up), gate = x[t, i], up = x[t, d + i]."""
        t, b = tl.program_id(0), tl.program_id(1)
        i = b * BLOCK + tl.arange(0, BLOCK)
        keep = i < d
        gate = tl.load(x + t * sx + i, mask=keep, other=0.0).to(tl.float32)
        up = tl.load(x + t * sx + d + i, mask=keep, other=0.0).to(tl.float32)
        act = _rounded(gate / (1.0 + tl.exp(-gate)), out.dtype.element_ty, EMULATE).to(tl.float32)
        tl.store(out + t * so + i, _rounded(act * up, out.dtype.element_ty, EMULATE), mask=keep)

    @triton.jit
    def _rotary(q, k, cos, sin, heads, half, sq_t, sq_h, sk_t, sk_h, sc_t, ss_t, BLOCK: tl.constexpr,
                EMULATE: tl.constexpr):
        """Head h of token t (q's heads, then k's): x * cos + rotate_half(x) * sin, each product rounded, then
        their sum."""
        t, h = tl.program_id(0), tl.program_id(1)
        if h < heads:
            row = q + t * sq_t + h * sq_h
        else:
            row = k + t * sk_t + (h - heads) * sk_h
        i = tl.arange(0, BLOCK)
        keep = i < half
        x1 = tl.load(row + i, mask=keep, other=0.0)
        x2 = tl.load(row + half + i, mask=keep, other=0.0)
        c1 = tl.load(cos + t * sc_t + i, mask=keep, other=0.0).to(tl.float32)
        c2 = tl.load(cos + t * sc_t + half + i, mask=keep, other=0.0).to(tl.float32)
        s1 = tl.load(sin + t * ss_t + i, mask=keep, other=0.0).to(tl.float32)
        s2 = tl.load(sin + t * ss_t + half + i, mask=keep, other=0.0).to(tl.float32)
        dtype = x1.dtype
        x1, x2 = x1.to(tl.float32), x2.to(tl.float32)
        # rotate_half(x) = (-x2, x1)
        first = _rounded(x1 * c1, dtype, EMULATE).to(tl.float32) + _rounded(-x2 * s1, dtype, EMULATE).to(tl.float32)
        second = _rounded(x2 * c2, dtype, EMULATE).to(tl.float32) + _rounded(x1 * s2, dtype, EMULATE).to(tl.float32)
        tl.store(row + i, _rounded(first, dtype, EMULATE), mask=keep)
        tl.store(row + half + i, _rounded(second, dtype, EMULATE), mask=keep)
