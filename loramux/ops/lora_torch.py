"""Pure-torch LoRA ops: the specification, the test oracle and the portable fallback.

Every op has the signature  op(y, x, lora_a, lora_b, mapping, output_slices=()) -> None  and adds
in place:
    y[t] += lora_b[s] @ (lora_a[s] @ x[t])   for every token t whose slot s = mapping.token_slots[t] >= 0
  x:      [num_tokens, in]
  y:      [num_tokens, out]
  lora_a: [max_loras, rank, in]    (rank padded with zero rows)
  lora_b: [max_loras, out, rank]   (scaling folded in, padded with zero columns)
  output_slices: a hint for packed layers: lora_b is block diagonal over these output slices and
                 equal rank chunks; an op may skip the zero blocks.
  slot_ranks:    a hint, [max_loras] int64 or None: the real rank of each slot (within every slice);
                 the rows/columns beyond it are zero, and an op may skip them.
The results do not depend on the hints.
"""
from __future__ import annotations

import torch

from loramux.ops.mapping import LoRAMapping


def add_lora_gathered(y, x, lora_a, lora_b, mapping: LoRAMapping, output_slices=(), slot_ranks=None) -> None:
    """Decode-like form: gather each token's A and B (Punica's BGMV, done with bmm)."""
    rows = (mapping.token_slots >= 0).nonzero().squeeze(1)  # [num_lora_tokens]
    if rows.numel() == 0:
        return
    slots = mapping.token_slots[rows]
    shrunk = torch.bmm(lora_a[slots], x[rows].unsqueeze(2))  # [n, rank, 1]
    y.index_add_(0, rows, torch.bmm(lora_b[slots], shrunk).squeeze(2))


def add_lora_segmented(y, x, lora_a, lora_b, mapping: LoRAMapping, output_slices=(), slot_ranks=None) -> None:
    """Prefill-like form: one shrink/expand GEMM pair per run of tokens sharing a slot (SGMV)."""
    for slot, start, end in mapping.segments:
        shrunk = x[start:end] @ lora_a[slot].t()  # [run, rank]
        y[start:end].addmm_(shrunk, lora_b[slot].t())
