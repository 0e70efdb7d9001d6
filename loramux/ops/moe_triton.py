"""fused_experts for CUDA: the (token, expert) pairs ordered by expert on the device, each projection of
every expert one grouped-GEMM launch (programs over (expert, block of its pairs) x output blocks, the work-item
table of ops/lora_triton.py with the expert as the slot), and the expert LoRA as one Triton SGMV call per
projection over all pairs, the (slot, expert) pair s * E + e being the LoRA op's slot, as the C++ CPU path
does it (moe_cpu.py). Same contract as moe_torch.fused_experts.

Nothing is read on the host and the launches depend on shapes only (the pair count is tokens x top_k), so a
CUDA graph captures MoE decode steps: any routing replays right.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from loramux.ops import lora_triton, triton_common
from loramux.ops.mapping import LoRAMapping
from loramux.ops.moe_torch import ExpertLoRA
from loramux.ops.triton_common import INTERPRET, triton

if triton is not None:
    import triton.language as tl

    from loramux.ops.triton_common import dot as _dot
    from loramux.ops.triton_common import rounded as _rounded

BLOCK_M, BLOCK_N, BLOCK_K = 16, 64, 64


def available(device: str | torch.device = "cuda") -> bool:
    return triton_common.available(device)


def fused_experts(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, topk_ids: torch.Tensor,
                  topk_weights: torch.Tensor, lora: ExpertLoRA | None = None) -> torch.Tensor:
    """[T, H] -> [T, H]."""
    num_experts, top_k = gate_up.shape[0], topk_ids.shape[1]
    order = torch.argsort(topk_ids.flatten(), stable=True)  # [P] pairs t * k + j, by expert (stable: by token)
    token_of = order // top_k  # [P]
    pair_expert = topk_ids.flatten()[order]  # [P], ascending
    by_expert = LoRAMapping(pair_expert)  # the grouped GEMMs' "slots": each pair's expert
    xs = x[token_of]  # [P, H]
    mapping = None
    if lora is not None:
        token_slots = lora.token_slots.to(x.device)[token_of]
        mapping = LoRAMapping(torch.where(token_slots >= 0, token_slots * num_experts + pair_expert, -1))
    gu = grouped_mm(xs, gate_up, by_expert)  # [P, 2I]
    if mapping is not None:
        a, b, ranks = lora.flat("gate_up")
        lora_triton.add_lora_triton(gu, xs, a, b, mapping, (down.shape[2], down.shape[2]), ranks)
    gate, up = gu.chunk(2, dim=-1)
    h = F.silu(gate) * up  # [P, I]
    y = grouped_mm(h, down, by_expert)  # [P, H]
    if mapping is not None:
        a, b, ranks = lora.flat("down")
        lora_triton.add_lora_triton(y, h, a, b, mapping, (), ranks)
    weighted = torch.empty_like(y)
    weighted[order] = (y * topk_weights.flatten()[order, None]).to(x.dtype)  # back in (token, k) order
    # a token's k outputs summed in one reduction, not by atomic adds (whose order would change run to run)
    return weighted.view(x.shape[0], top_k, -1).sum(1)


def grouped_mm(rows: torch.Tensor, weights: torch.Tensor, by_expert: LoRAMapping) -> torch.Tensor:
    """rows [P, in], weights [E, out, in], by_expert: each row's expert -> [P, out]: rows @ weights[e].T for
    each row's own e, in one launch (fp32 sums, rounded once to rows' dtype, as torch.mm's)."""
    num_experts, n_out, n_in = weights.shape
    out = rows.new_empty(rows.shape[0], n_out)
    if rows.shape[0] == 0:
        return out
    order, counts, starts = lora_triton.by_slot(by_expert, num_experts)
    work = lora_triton.work_items(by_expert, num_experts, BLOCK_M)
    _grouped[(work.shape[0], triton.cdiv(n_out, BLOCK_N))](
        rows, weights, out, work, order, counts, starts, n_in, n_out,
        rows.stride(0), rows.stride(1), weights.stride(0), weights.stride(1), weights.stride(2), out.stride(0),
        BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K, IEEE=rows.dtype == torch.float32 or INTERPRET,
        EMULATE=INTERPRET)
    return out


if triton is not None:

    @triton.jit
    def _grouped(x, w, out, work, order, counts, starts, n_in, n_out, sx_t, sx_i, sw_e, sw_o, sw_i, so_t,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, IEEE: tl.constexpr,
                 EMULATE: tl.constexpr):
        """out[t, o] = sum_i x[t, i] * w[e, o, i] for this program's rows t of expert e (work item
        program_id(0)) and output block program_id(1)."""
        p, nb = tl.program_id(0), tl.program_id(1)
        e, mb = tl.load(work + 2 * p), tl.load(work + 2 * p + 1)
        if e < 0:  # past the real work items
            return
        count = tl.load(counts + e + 1)
        m = mb * BLOCK_M + tl.arange(0, BLOCK_M)
        rows = tl.load(order + tl.load(starts + e + 1) + m, mask=m < count, other=0)  # [BLOCK_M]
        o = nb * BLOCK_N + tl.arange(0, BLOCK_N)
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for i0 in range(0, n_in, BLOCK_K):
            i = i0 + tl.arange(0, BLOCK_K)
            xt = tl.load(x + rows[:, None] * sx_t + i[None, :] * sx_i, mask=(m[:, None] < count) & (i[None, :] < n_in),
                         other=0.0)  # [BLOCK_M, BLOCK_K]
            wt = tl.load(w + e * sw_e + o[None, :] * sw_o + i[:, None] * sw_i,
                         mask=(o[None, :] < n_out) & (i[:, None] < n_in), other=0.0)  # [BLOCK_K, BLOCK_N]
            acc = _dot(xt, wt.to(xt.dtype), acc, IEEE)
        keep = (m[:, None] < count) & (o[None, :] < n_out)
        tl.store(out + rows[:, None] * so_t + o[None, :], _rounded(acc, out.dtype.element_ty, EMULATE), mask=keep)
