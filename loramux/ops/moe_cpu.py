"""The fast CPU path of fused_experts (csrc/moe_cpu.cpp): the (token, expert) pairs sorted by expert once,
one GEMM per expert, and the expert LoRA as one add_lora call per projection over all pairs, the
(slot, expert) pair being add_lora's slot: the C++ LoRA kernel groups the pairs of one adapter's expert
together itself (ops/lora_cpu.py). Same contract as moe_torch.fused_experts."""
from __future__ import annotations

import torch

from loramux.ops import moe_torch
from loramux.ops.cpu_extension import load_extension
from loramux.ops.moe_torch import ExpertLoRA

_NO_SLOTS = torch.empty(0, dtype=torch.long)


def available() -> bool:
    return load_extension("moe_cpu") is not None and load_extension("lora_cpu") is not None


def uses_amx() -> bool:
    """Whether bf16 experts with up to 32 rows run on AMX tiles here (else torch's GEMM, one per expert)."""
    return available() and load_extension("moe_cpu").amx_enabled()


def fused_experts(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, topk_ids: torch.Tensor,
                  topk_weights: torch.Tensor, lora: ExpertLoRA | None = None) -> torch.Tensor:
    if x.dim() != 2 or x.stride(1) != 1 or x.dtype not in (torch.float32, torch.bfloat16) or gate_up.dtype != x.dtype:
        return moe_torch.fused_experts(x, gate_up, down, topk_ids, topk_weights, lora)
    ext = load_extension("moe_cpu")
    slots = _NO_SLOTS if lora is None else lora.token_slots
    order, offsets, pair_slots, xs, gu = ext.experts_up(x, gate_up, topk_ids, slots)
    if lora is not None:
        inter = down.shape[2]
        a, b, ranks = lora.flat("gate_up")
        load_extension("lora_cpu").add_lora(gu, xs, a, b, pair_slots, [inter, inter], ranks)
    h, y = ext.experts_down(gu, down, offsets)
    if lora is not None:
        a, b, ranks = lora.flat("down")
        load_extension("lora_cpu").add_lora(y, h, a, b, pair_slots, [], ranks)
    return ext.combine(y, order, topk_weights)
