"""The fast CPU path for add_lora: an AVX-512 (+ AVX512_BF16) C++ kernel (csrc/lora_cpu.cpp).

Tokens are grouped by slot inside the kernel (a counting sort), so any token order works; the
shrink is tiled over tokens x rank rows and the expand over 16-output blocks, skipping the zero
padding beyond each slot's real rank (Punica's SGMV idea, for CPUs). bf16 groups of 16+ tokens (prefill) run
on AMX tiles where the CPU has them. Same contract as lora_torch.py;
the kernel reads lora_b rank-major, as LoRALinear stores it (any other layout is copied per call);
lora_a and lora_b may be bf16 under fp32 x and y (LoRAConfig.lora_dtype).
"""
from __future__ import annotations

from loramux.ops.cpu_extension import load_extension
from loramux.ops.mapping import LoRAMapping


def available() -> bool:
    return load_extension("lora_cpu") is not None


def add_lora_cpu(y, x, lora_a, lora_b, mapping: LoRAMapping, output_slices: tuple[int, ...] = (),
                 slot_ranks=None) -> None:
    # positional: pybind's keyword matching costs ~0.5 us, and a decode step makes 120 of these calls; a lora_b
    # that is not rank-major (LoRALinear's always is) is copied by the kernel, per call
    load_extension("lora_cpu").add_lora(y, x, lora_a, lora_b, mapping.token_slots, list(output_slices), slot_ranks)
