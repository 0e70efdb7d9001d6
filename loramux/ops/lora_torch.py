"""Pure-torch LoRA ops: the specification, the test oracle and the portable fallback.

Every op has the signature  op(y, x, lora_a, lora_b, mapping, output_slices=(), slot_ranks=None) -> None
and adds in place, for every token t whose slot s = mapping.token_slots[t] >= 0:
    y[t] += lora_b[s] @ (lora_a[s] @ x[t])                      (one output slice)
  x:      [num_tokens, in]
  y:      [num_tokens, out]
  lora_a: [max_loras, K * rank, in]  (rank padded with zero rows; K = len(output_slices), 1 if empty)
  lora_b: [max_loras, out, rank]     (scaling folded in, padded with zero columns; any memory order,
                                      LoRALinear stores it rank-major for the CPU kernel)
  output_slices: the sizes of a packed layer's output slices (q|k|v, gate|up), summing to out. The
                 output rows of slice k use the shrunk rows [k*rank, (k+1)*rank):
                 y[t, rows_k] += lora_b[s, rows_k] @ (lora_a[s, k*rank:(k+1)*rank] @ x[t])
                 so B holds no zero blocks and is [max_loras, out, rank] whatever K is.
  lora_a/lora_b may be bf16 under fp32 x and y (LoRAConfig.lora_dtype): the math is fp32 on their exact widening.
  slot_ranks:    a hint, [max_loras] int64 or None: the real rank of each slot (within every slice);
                 the rows/columns beyond it are zero, and an op may skip them.
The results do not depend on the hint.
"""
from __future__ import annotations

import torch

from loramux.ops.mapping import LoRAMapping


def slices_of(output_slices, lora_a, lora_b):
    """(output rows, shrunk rows) per slice: [(row_start, row_end, rank_start, rank_end)]."""
    sizes = tuple(output_slices) or (lora_b.shape[1],)
    rank = lora_b.shape[2]
    if sum(sizes) != lora_b.shape[1] or lora_a.shape[1] != len(sizes) * rank:
        raise ValueError(f"output slices {sizes} do not fit lora_a {tuple(lora_a.shape)} / lora_b {tuple(lora_b.shape)}")
    starts = [sum(sizes[:k]) for k in range(len(sizes))]
    return [(start, start + size, k * rank, (k + 1) * rank) for k, (start, size) in enumerate(zip(starts, sizes))]


def add_lora_gathered(y, x, lora_a, lora_b, mapping: LoRAMapping, output_slices=(), slot_ranks=None) -> None:
    """Decode-like form: gather each token's A and B (Punica's BGMV, done with bmm)."""
    rows = (mapping.token_slots >= 0).nonzero().squeeze(1)  # [num_lora_tokens]
    if rows.numel() == 0:
        return
    slots = mapping.token_slots[rows]
    shrunk = torch.bmm(lora_a[slots].to(x.dtype), x[rows].unsqueeze(2))  # [n, K * rank, 1]
    for o0, o1, r0, r1 in slices_of(output_slices, lora_a, lora_b):
        expanded = torch.bmm(lora_b[slots, o0:o1].to(x.dtype), shrunk[:, r0:r1]).squeeze(2)  # [n, o1 - o0]
        y[:, o0:o1].index_add_(0, rows, expanded)


def add_lora_segmented(y, x, lora_a, lora_b, mapping: LoRAMapping, output_slices=(), slot_ranks=None) -> None:
    """Prefill-like form: one shrink GEMM and one expand GEMM per slice per run of tokens sharing a slot (SGMV)."""
    slices = slices_of(output_slices, lora_a, lora_b)
    for slot, start, end in mapping.segments:
        shrunk = x[start:end] @ lora_a[slot].t().to(x.dtype)  # [run, K * rank]
        for o0, o1, r0, r1 in slices:
            y[start:end, o0:o1].addmm_(shrunk[:, r0:r1], lora_b[slot, o0:o1].t().to(x.dtype))


FIXED_ROWS = 32


def _fixed_rows_mm(a: torch.Tensor, b: torch.Tensor, rows: int = FIXED_ROWS) -> torch.Tensor:
    """a @ b with every GEMM on exactly `rows` rows of a (the last piece zero-padded): a row's result does not
    depend on how many rows share the call (see layers.linear.FixedRowsLinear)."""
    n = a.shape[0]
    pad = -n % rows
    if pad:
        a = torch.cat([a, a.new_zeros(pad, a.shape[1])])
    return torch.cat([chunk @ b for chunk in a.split(rows)])[:n]


def add_lora_segmented_fixed_rows(y, x, lora_a, lora_b, mapping: LoRAMapping, output_slices=(), slot_ranks=None) -> None:
    """add_lora_segmented with every GEMM on a fixed row count: batch-invariant (EngineConfig.batch_invariant),
    and cheap in prefill (the gathered form copies every token's A and B)."""
    slices = slices_of(output_slices, lora_a, lora_b)
    for slot, start, end in mapping.segments:
        shrunk = _fixed_rows_mm(x[start:end], lora_a[slot].t().to(x.dtype))  # [run, K * rank]
        for o0, o1, r0, r1 in slices:
            y[start:end, o0:o1] += _fixed_rows_mm(shrunk[:, r0:r1].contiguous(), lora_b[slot, o0:o1].t().to(x.dtype))
