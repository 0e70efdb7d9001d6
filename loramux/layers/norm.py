"""RMSNorm (Zhang & Sennrich 2019), computed in float32 as HF transformers does.

The op comes from the pointwise backend the model runner picks once the device is known
(ops.select_pointwise_backend); the module holds the weight and eps.
"""
from __future__ import annotations

import torch
from torch import nn

from loramux.ops import pointwise_torch


class RMSNorm(nn.Module):
    pointwise_op = "rms_norm"  # the model runner sets self.op to the backend's op of this name

    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps
        self.op = pointwise_torch.rms_norm

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() == 2:
            return self.op(x, self.weight, self.eps)
        return self.op(x.reshape(-1, x.shape[-1]), self.weight, self.eps).view(x.shape)
