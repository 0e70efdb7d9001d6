"""Rotary position embeddings (Su et al. 2021) with every scaling variant HF transformers knows.

The cos/sin table comes from the model's own HF rotary class (llama3, linear, dynamic, yarn, ...), so
our positions rotate exactly as theirs do; it is computed once for all positions up to max_len.
"""
from __future__ import annotations

import torch
from torch import nn


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class RotaryEmbedding(nn.Module):
    def __init__(self):
        super().__init__()
        self.cos: torch.Tensor | None = None  # [max_len, head_dim]
        self.sin: torch.Tensor | None = None

    def init_table(self, hf_rotary: nn.Module, max_len: int, dtype: torch.dtype, device) -> None:
        positions = torch.arange(max_len, device=device)[None]
        probe = torch.empty(0, dtype=torch.float32, device=device)
        cos, sin = hf_rotary.to(device)(probe, positions)
        self.cos, self.sin = cos[0].to(dtype), sin[0].to(dtype)

    def lookup(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """positions: [num_tokens] -> (cos, sin), each [num_tokens, 1, head_dim]; once per forward pass."""
        return self.cos[positions].unsqueeze(1), self.sin[positions].unsqueeze(1)

    @staticmethod
    def apply(rope: tuple[torch.Tensor, torch.Tensor], q: torch.Tensor, k: torch.Tensor):
        """q: [num_tokens, heads, head_dim]; k: [num_tokens, kv_heads, head_dim]; rope from lookup()."""
        cos, sin = rope
        return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin
