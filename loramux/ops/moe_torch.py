"""Mixture-of-experts ops in pure torch: top-k routing and the fused experts (with per-token LoRA), as HF
transformers computes them. The reference every faster backend of these ops must equal.

Shapes: x [T, H] (T tokens); gate_up [E, 2I, H] (each expert's gate rows, then its up rows); down [E, H, I];
topk_ids / topk_weights [T, k]. An expert's output for a token is down(silu(gate x) * up x), scaled by the
token's routing weight, summed over the token's k experts.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


def route(logits: torch.Tensor, top_k: int, normalize: bool, keep_float: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Router logits [T, E] -> (topk_weights, topk_ids) [T, k]: softmax in fp32, the k largest, renormalized
    to sum to 1 when `normalize`; weights back in the logits' dtype unless `keep_float` (Mixtral keeps fp32)."""
    probs = torch.softmax(logits, dim=-1, dtype=torch.float)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if normalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return (weights if keep_float else weights.to(logits.dtype)), ids


@dataclass
class ExpertLoRA:
    """Per-slot LoRA over the experts of one block, read by the fused-experts op for the tokens that use it.

    gate_up: a [slots, E, 2R, H] (rows 0..R-1 the gate's A, R..2R-1 the up's), b [slots, E, 2I, R] (gate rows,
    then up rows), scaling folded into b; down: a [slots, E, R, I], b [slots, E, H, R]; b stored rank-major
    (b.transpose(-1, -2) contiguous, as add_lora's kernel reads it). ranks [slots]: each slot's rank (0 = no
    expert LoRA); expert_ranks: the same as int64 [slots * E], slot s's repeated for its E experts;
    token_slots [T]: each token's slot (-1 = base)."""

    gate_up_a: torch.Tensor
    gate_up_b: torch.Tensor
    down_a: torch.Tensor
    down_b: torch.Tensor
    ranks: list[int]
    expert_ranks: torch.Tensor
    token_slots: torch.Tensor

    def flat(self, which: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """`which` ("gate_up" or "down") as add_lora's (lora_a, lora_b, slot_ranks), its slot being the
        (slot, expert) pair s * E + e: a [slots * E, K*R, in], b [slots * E, out, R] (views, no copy)."""
        a, b = (self.gate_up_a, self.gate_up_b) if which == "gate_up" else (self.down_a, self.down_b)
        return a.flatten(0, 1), b.flatten(0, 1), self.expert_ranks

    def gate_up_delta(self, x: torch.Tensor, rows: torch.Tensor, expert: int) -> torch.Tensor | None:
        """The LoRA update of gate_up for tokens `rows` (their inputs x [n, H]) on `expert`: [n, 2I] or None."""
        return self._delta(x, rows, expert, self.gate_up_a, self.gate_up_b, slices=2)

    def down_delta(self, h: torch.Tensor, rows: torch.Tensor, expert: int) -> torch.Tensor | None:
        return self._delta(h, rows, expert, self.down_a, self.down_b, slices=1)

    def _delta(self, x, rows, expert, a, b, slices: int) -> torch.Tensor | None:
        slots = self.token_slots[rows]
        out = None
        for slot in slots.unique().tolist():
            r = self.ranks[slot] if slot >= 0 else 0
            if not r:
                continue
            mine = (slots == slot).nonzero().squeeze(1)
            size, width = b.shape[2] // slices, a.shape[2] // slices
            parts = [(x[mine] @ a[slot, expert, i * width:i * width + r].t()) @ b[slot, expert, i * size:(i + 1) * size, :r].t()
                     for i in range(slices)]
            delta = torch.cat(parts, dim=-1) if slices > 1 else parts[0]
            out = torch.zeros(x.shape[0], b.shape[2], dtype=x.dtype, device=x.device) if out is None else out
            out[mine] += delta.to(x.dtype)
        return out


def fused_experts(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, topk_ids: torch.Tensor,
                  topk_weights: torch.Tensor, lora: ExpertLoRA | None = None) -> torch.Tensor:
    """[T, H] -> [T, H]: expert by expert (in id order, as HF transformers sums them), the tokens routed to it."""
    out = torch.zeros_like(x)
    for expert in topk_ids.unique().tolist():
        token_idx, pos = (topk_ids == expert).nonzero(as_tuple=True)
        rows = x[token_idx]
        gu = F.linear(rows, gate_up[expert])
        if lora is not None and (delta := lora.gate_up_delta(rows, token_idx, expert)) is not None:
            gu = gu + delta
        gate, up = gu.chunk(2, dim=-1)
        h = F.silu(gate) * up
        y = F.linear(h, down[expert])
        if lora is not None and (delta := lora.down_delta(h, token_idx, expert)) is not None:
            y = y + delta
        out.index_add_(0, token_idx, (y * topk_weights[token_idx, pos, None]).to(out.dtype))
    return out
