"""RMSNorm (Zhang & Sennrich 2019), computed in float32 as HF transformers does.

The ops come from the pointwise backend the model runner picks once the device is known
(ops.select_pointwise_backend); the module holds the weight and eps. Given the residual stream too, it
adds x to it first (one pass, as vLLM's fused_add_rms_norm) and returns both the normed sum and the sum.
"""
from __future__ import annotations

import torch
from torch import nn

from loramux.layers import DirectCall
from loramux.ops import pointwise_torch


class RMSNorm(DirectCall, nn.Module):
    pointwise_ops = {"op": "rms_norm", "add_op": "add_rms_norm"}  # set by the model runner from the backend

    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps
        self.op = pointwise_torch.rms_norm
        self.add_op = pointwise_torch.add_rms_norm

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        """norm(x); or, with residual [num_tokens, dim]: (norm(residual + x), residual + x), x 2-D."""
        if residual is not None:
            return self.add_op(x, residual, self.weight, self.eps)
        if x.dim() == 2:
            return self.op(x, self.weight, self.eps)
        return self.op(x.reshape(-1, x.shape[-1]), self.weight, self.eps).view(x.shape)
