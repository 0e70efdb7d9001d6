"""The fast CPU path for add_lora: an AVX-512 (+ AVX512_BF16) C++ kernel (csrc/lora_cpu.cpp).

Tokens are grouped by slot inside the kernel (a counting sort), so any token order works; the
shrink is tiled over tokens x rank rows and the expand over 16-output blocks, skipping the zero
padding beyond each slot's real rank (Punica's SGMV idea, for CPUs). bf16 groups of 16+ tokens (prefill) run
on AMX tiles where the CPU has them. Same contract as lora_torch.py;
the kernel reads lora_b rank-major, as LoRALinear stores it (any other layout is copied per call).
"""
from __future__ import annotations

from loramux.ops.cpu_extension import load_extension
from loramux.ops.mapping import LoRAMapping


def available() -> bool:
    return load_extension("lora_cpu") is not None


def add_lora_cpu(y, x, lora_a, lora_b, mapping: LoRAMapping, output_slices: tuple[int, ...] = (),
                 slot_ranks=None) -> None:
    if not is_rank_major(lora_b):  # LoRALinear's buffers always are; anything else pays a copy per call
        lora_b = lora_b.transpose(1, 2).contiguous().transpose(1, 2)
    # positional: pybind's keyword matching costs ~0.5 us, and a decode step makes 120 of these calls
    load_extension("lora_cpu").add_lora(y, x, lora_a, lora_b, mapping.token_slots, list(output_slices), slot_ranks)


def is_rank_major(lora_b) -> bool:
    """lora_b [L, out, r] laid out as a contiguous [L, r, out] (the kernel's layout)."""
    _, out, rank = lora_b.shape
    return lora_b.stride()[:2] == (out * rank, 1) and (rank == 1 or lora_b.stride(2) == out)  # rank 1: any stride
