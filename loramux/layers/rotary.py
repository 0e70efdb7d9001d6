"""Rotary position embeddings (Su et al. 2021) with every scaling variant HF transformers knows.

The cos/sin table comes from the model's own HF rotary class (llama3, linear, dynamic, yarn, ...), so
our positions rotate exactly as theirs do; it is computed once for all positions up to max_len.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
from torch import nn

from loramux.ops import pointwise_torch


@dataclass
class Rope:
    """cos/sin of one forward pass's positions ([num_tokens, head_dim] each) and the rotary op."""
    cos: torch.Tensor
    sin: torch.Tensor
    op: Callable

    def apply(self, q: torch.Tensor, k: torch.Tensor):
        """q: [num_tokens, heads, head_dim]; k: [num_tokens, kv_heads, head_dim]; may rotate in place."""
        return self.op(q, k, self.cos, self.sin)


class RotaryEmbedding(nn.Module):
    pointwise_ops = {"op": "rotary"}  # the model runner sets self.op to the backend's op of this name

    def __init__(self):
        super().__init__()
        self.cos: torch.Tensor | None = None  # [max_len, head_dim]
        self.sin: torch.Tensor | None = None
        self.op = pointwise_torch.rotary

    def init_table(self, hf_rotary: nn.Module, max_len: int, dtype: torch.dtype, device) -> None:
        positions = torch.arange(max_len, device=device)[None]
        probe = torch.empty(0, dtype=torch.float32, device=device)
        cos, sin = hf_rotary.to(device)(probe, positions)
        self.cos, self.sin = cos[0].to(dtype), sin[0].to(dtype)

    def lookup(self, positions: torch.Tensor) -> Rope:
        """positions: [num_tokens] -> their Rope; once per forward pass."""
        return Rope(self.cos[positions], self.sin[positions], self.op)
