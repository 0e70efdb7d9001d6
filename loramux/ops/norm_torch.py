"""RMSNorm in pure torch: the specification, the oracle and the portable fallback.

Every RMSNorm op has the signature  op(x, weight, eps) -> out  with
  x:      [num_tokens, dim]  (any strides)
  weight: [dim], x's dtype
  out:    [num_tokens, dim], x's dtype: weight * to_dtype(x * rsqrt(mean(x^2) + eps)), normalized in
          float32 and rounded to x's dtype before the weight is applied, as HF transformers' LlamaRMSNorm.
"""
from __future__ import annotations

import torch


def rms_norm_torch(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    normed = torch.nn.functional.rms_norm(x.float(), (x.shape[-1],), eps=eps)
    return weight * normed.to(x.dtype)
