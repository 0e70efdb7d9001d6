"""The LoRA math. Slot -1 means "base model": those tokens are left untouched by every op.

All backends share one signature, `add_lora(y, x, lora_a, lora_b, mapping, output_slices=()) -> None`
(see lora_torch.py for the contract and shapes). The backend is chosen once, when the LoRA layers are
built; nothing in a forward pass branches on it.
"""
from __future__ import annotations

from collections.abc import Callable

import torch

from loramux.ops import lora_cpu
from loramux.ops.lora_torch import add_lora_gathered, add_lora_segmented
from loramux.ops.mapping import LoRAMapping, RowSlots, UniformSlot

AddLoRA = Callable[..., None]

BACKENDS: dict[str, AddLoRA] = {
    "torch": add_lora_segmented,
    "torch-gathered": add_lora_gathered,
    "cpu": lora_cpu.add_lora_cpu,
}


def select_backend(name: str = "auto", device: str | torch.device = "cpu") -> AddLoRA:
    """The op for `name`; "auto" picks the fastest one that runs on `device` on this machine."""
    if name == "auto":
        cpu = torch.device(device).type == "cpu"
        name = "cpu" if cpu and lora_cpu.available() else "torch"
    if name not in BACKENDS:
        raise ValueError(f"unknown LoRA backend {name!r}; choose one of: auto, {', '.join(BACKENDS)}")
    if name == "cpu" and not lora_cpu.available():
        raise ValueError("the 'cpu' LoRA backend needs an x86 CPU with AVX-512 BF16, a C++ compiler and ninja")
    return BACKENDS[name]


__all__ = ["BACKENDS", "LoRAMapping", "RowSlots", "UniformSlot", "select_backend"]
