"""RMSNorm (Zhang & Sennrich 2019), computed in float32 as HF transformers does.

The op is chosen by the model runner (ops.select_norm_backend) once the device is known; the module
only holds the weight and eps.
"""
from __future__ import annotations

import torch
from torch import nn

from loramux.ops.norm_torch import rms_norm_torch


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps
        self.op = rms_norm_torch  # see ops.norm_torch for the contract

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() == 2:
            return self.op(x, self.weight, self.eps)
        return self.op(x.reshape(-1, x.shape[-1]), self.weight, self.eps).view(x.shape)
