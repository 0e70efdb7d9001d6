"""The fast ops and their pure-torch references: the LoRA math and paged decode attention.

Slot -1 means "base model": those tokens are left untouched by every LoRA op.

All backends share one signature, `add_lora(y, x, lora_a, lora_b, mapping, output_slices=()) -> None`
(see lora_torch.py for the contract and shapes). The backend is chosen once, when the LoRA layers are
built; nothing in a forward pass branches on it.
"""
from __future__ import annotations

from collections.abc import Callable

import torch

from loramux.ops import attention_cpu, lora_cpu
from loramux.ops.attention_torch import decode_attention_torch
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


ATTENTION_BACKENDS = {"torch": decode_attention_torch, "cpu": attention_cpu.decode_attention_cpu}


def select_attention_backend(name: str = "auto", device: str | torch.device = "cpu"):
    """The paged decode-attention op (see attention_torch.py); "auto": the CPU kernel where it runs."""
    if name == "auto":
        name = "cpu" if torch.device(device).type == "cpu" and attention_cpu.available() else "torch"
    if name not in ATTENTION_BACKENDS:
        raise ValueError(f"unknown attention backend {name!r}; choose one of: auto, {', '.join(ATTENTION_BACKENDS)}")
    if name == "cpu" and not attention_cpu.available():
        raise ValueError("the 'cpu' attention backend needs an x86 CPU with AVX-512 BF16, a C++ compiler and ninja")
    return ATTENTION_BACKENDS[name]


__all__ = ["ATTENTION_BACKENDS", "BACKENDS", "LoRAMapping", "RowSlots", "UniformSlot", "select_attention_backend",
           "select_backend"]
