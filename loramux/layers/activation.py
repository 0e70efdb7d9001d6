"""SiluAndMul: the SwiGLU activation over a fused gate|up projection's output (silu(gate) * up)."""
from __future__ import annotations

import torch
from torch import nn

from loramux.layers import DirectCall
from loramux.ops import pointwise_torch


class SiluAndMul(DirectCall, nn.Module):
    pointwise_ops = {"op": "silu_and_mul"}  # the model runner sets self.op to the backend's op of this name

    def __init__(self):
        super().__init__()
        self.op = pointwise_torch.silu_and_mul

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: [num_tokens, 2 * d] -> [num_tokens, d]."""
        return self.op(x)
