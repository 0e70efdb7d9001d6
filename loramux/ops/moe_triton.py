"""fused_experts for CUDA: the (token, expert) pairs ordered by expert on the device, one GEMM per expert
that has tokens, and the expert LoRA as one Triton SGMV call per projection (ops/lora_triton.py) over all
pairs, the (slot, expert) pair s * E + e being the LoRA op's slot, as the C++ CPU path does it (moe_cpu.py).
Same contract as moe_torch.fused_experts.

One host sync a call: the per-expert pair counts, which size the GEMMs (a grouped-GEMM kernel would remove
it). The expert LoRA needs none: its kernels find each pair slot's tokens on the device.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from loramux.ops import lora_triton, triton_common
from loramux.ops.mapping import LoRAMapping
from loramux.ops.moe_torch import ExpertLoRA


def available(device: str | torch.device = "cuda") -> bool:
    return triton_common.available(device)


def fused_experts(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, topk_ids: torch.Tensor,
                  topk_weights: torch.Tensor, lora: ExpertLoRA | None = None) -> torch.Tensor:
    """[T, H] -> [T, H]."""
    num_experts, top_k = gate_up.shape[0], topk_ids.shape[1]
    order = torch.argsort(topk_ids.flatten(), stable=True)  # [P] pairs t * k + j, by expert (stable: by token)
    token_of = order // top_k  # [P]
    runs = lora_triton.counts_of(topk_ids.flatten(), num_experts).tolist()  # the one sync
    xs = x[token_of]  # [P, H]
    mapping = None
    if lora is not None:
        pair_expert = topk_ids.flatten()[order]
        token_slots = lora.token_slots.to(x.device)[token_of]
        mapping = LoRAMapping(torch.where(token_slots >= 0, token_slots * num_experts + pair_expert, -1))
    gu = _per_expert(xs, gate_up, runs)  # [P, 2I]
    if mapping is not None:
        a, b, ranks = lora.flat("gate_up")
        lora_triton.add_lora_triton(gu, xs, a, b, mapping, (down.shape[2], down.shape[2]), ranks)
    gate, up = gu.chunk(2, dim=-1)
    h = F.silu(gate) * up  # [P, I]
    y = _per_expert(h, down, runs)  # [P, H]
    if mapping is not None:
        a, b, ranks = lora.flat("down")
        lora_triton.add_lora_triton(y, h, a, b, mapping, (), ranks)
    weighted = torch.empty_like(y)
    weighted[order] = (y * topk_weights.flatten()[order, None]).to(x.dtype)  # back in (token, k) order
    # a token's k outputs summed in one reduction, not by atomic adds (whose order would change run to run)
    return weighted.view(x.shape[0], top_k, -1).sum(1)


def _per_expert(rows: torch.Tensor, weights: torch.Tensor, runs: list[int]) -> torch.Tensor:
    """rows [P, in] ordered by expert, runs[e] of them for expert e -> [P, out]: rows @ weights[e].T per run."""
    out = rows.new_empty(rows.shape[0], weights.shape[1])
    start = 0
    for expert, n in enumerate(runs):
        if n:
            torch.mm(rows[start:start + n], weights[expert].t(), out=out[start:start + n])
            start += n
    return out
