"""Rotary position embeddings (Su et al. 2021) with every scaling variant HF transformers knows.

The cos/sin table comes from HF transformers' own RoPE functions (llama3, linear, dynamic, yarn, longrope,
...) as its models' rotary classes call them, so our positions rotate exactly as theirs do; it is computed
once for all positions up to max_len.
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

    def init_table(self, hf_config, max_len: int, dtype: torch.dtype, device) -> None:
        positions = torch.arange(max_len, device=device)[None]
        probe = torch.empty(0, dtype=torch.float32, device=device)
        cos, sin = hf_rotary(hf_config, device)(probe, positions)
        self.cos, self.sin = cos[0].to(dtype), sin[0].to(dtype)

    def lookup(self, positions: torch.Tensor) -> Rope:
        """positions: [num_tokens] -> their Rope; once per forward pass."""
        return Rope(self.cos[positions], self.sin[positions], self.op)


def hf_rotary(hf_config, device) -> nn.Module:
    """A module giving (cos, sin) [1, positions, head_dim] for (x, position_ids [1, positions]) as the rotary class
    of the config's HF model does. Built from transformers' RoPE functions rather than that class: importing a
    modeling module costs ~2.8 s of every engine start (it pulls in transformers' whole modeling stack)."""
    if getattr(hf_config, "rope_parameters", None) is None:  # transformers 4: the class itself
        from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

        return LlamaRotaryEmbedding(hf_config).to(device)
    return _HFRotary(hf_config, device)


class _HFRotary(nn.Module):
    """HF's Llama rotary class, with the attributes that transformers' `dynamic_rope_update` reads and updates
    (dynamic and longrope types change their frequencies with the positions asked for)."""

    def __init__(self, hf_config, device):
        from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

        super().__init__()
        self.config = hf_config
        self.max_seq_len_cached = self.original_max_seq_len = hf_config.max_position_embeddings
        self.rope_type = hf_config.rope_parameters["rope_type"]
        init = _default_frequencies if self.rope_type == "default" else ROPE_INIT_FUNCTIONS[self.rope_type]
        inv_freq, self.attention_scaling = init(hf_config, device)
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        self.register_buffer("original_inv_freq", inv_freq.clone(), persistent=False)

    def forward(self, x: torch.Tensor, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        from transformers.modeling_rope_utils import dynamic_rope_update

        return dynamic_rope_update(_HFRotary._table)(self, x, position_ids)

    def _table(self, x: torch.Tensor, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = position_ids[..., None].float() * self.inv_freq.to(device=x.device, dtype=torch.float)
        emb = torch.cat((freqs, freqs), dim=-1)
        return (emb.cos() * self.attention_scaling).to(x.dtype), (emb.sin() * self.attention_scaling).to(x.dtype)


def _default_frequencies(hf_config, device=None) -> tuple[torch.Tensor, float]:
    """Plain RoPE (Su et al.): inv_freq [head_dim / 2] of the config's rope_theta, no attention scaling."""
    base = hf_config.rope_parameters["rope_theta"]
    dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // hf_config.num_attention_heads
    return 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float, device=device) / dim)), 1.0
