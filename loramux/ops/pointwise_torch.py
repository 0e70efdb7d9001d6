"""The per-token pointwise ops of a Llama layer in pure torch: the specification, the oracle and the
portable fallback. Each follows HF transformers' order of operations and roundings in x's dtype.

  rms_norm(x, weight, eps) -> out
      x [num_tokens, dim] (any strides), weight [dim] -> [num_tokens, dim]:
      weight * to_dtype(x * rsqrt(mean(x^2) + eps)), normalized in float32 (LlamaRMSNorm)
  add_rms_norm(x, residual, weight, eps) -> (out, new_residual)
      new_residual = residual + x in x's dtype (a decoder layer's residual add), out = rms_norm(new_residual)
  silu_and_mul(x) -> out
      x [num_tokens, 2 * d] = gate | up (a fused gate_up projection) -> silu(gate) * up, [num_tokens, d]
      (LlamaMLP: the activation rounded to x's dtype, then the product)
  rotary(q, k, cos, sin) -> (q, k)
      q [num_tokens, heads, head_dim], k [num_tokens, kv_heads, head_dim] (last dim contiguous, any
      other strides), cos/sin [num_tokens, head_dim] -> x * cos + rotate_half(x) * sin for both
      (apply_rotary_pos_emb); an op may rotate q and k in place and return them.
  argmax(x) -> ids
      x [num_tokens, vocab] float32 logits -> int64 [num_tokens]: the first index of each row's maximum,
      a NaN counting as the maximum (torch.argmax); greedy sampling
"""
from __future__ import annotations

import torch
import torch.nn.functional as F


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    normed = F.rms_norm(x.float(), (x.shape[-1],), eps=eps)
    return weight * normed.to(x.dtype)


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float):
    residual = residual + x
    return rms_norm(residual, weight, eps), residual


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate).mul_(up)  # in place: one [tokens, d] buffer less


def argmax(x: torch.Tensor) -> torch.Tensor:
    return x.argmax(dim=-1)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def rotary(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)  # broadcast over heads
    return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin
