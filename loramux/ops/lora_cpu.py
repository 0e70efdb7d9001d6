"""The fast CPU path for add_lora: an AVX-512 (+ AVX512_BF16) C++ kernel (csrc/lora_cpu.cpp).

Tokens are grouped by slot inside the kernel (a counting sort), so any token order works; the
shrink is tiled over tokens x rank rows and the expand over 16-row output blocks (row dot products
for groups of a few tokens), skipping the zero padding beyond each slot's real rank (Punica's SGMV
idea, for CPUs). Same contract as lora_torch.py.
"""
from __future__ import annotations

from loramux.ops.cpu_extension import load_extension
from loramux.ops.mapping import LoRAMapping


def available() -> bool:
    return load_extension("lora_cpu") is not None


def add_lora_cpu(y, x, lora_a, lora_b, mapping: LoRAMapping, output_slices: tuple[int, ...] = (),
                 slot_ranks=None) -> None:
    load_extension("lora_cpu").add_lora(y, x, lora_a, lora_b, mapping.token_slots, list(output_slices),
                                        slot_ranks=slot_ranks)
