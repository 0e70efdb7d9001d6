"""The LoRA math. Slot -1 means "base model": those tokens are left untouched by every op.

All backends share one signature, `add_lora(y, x, lora_a, lora_b, mapping) -> None` (see
lora_torch.py for the contract and shapes). The backend is chosen once, when a layer is built;
nothing in a forward pass branches on it.
"""
from __future__ import annotations

from collections.abc import Callable

from loramux.ops.lora_torch import add_lora_gathered, add_lora_segmented
from loramux.ops.mapping import LoRAMapping, RowSlots, UniformSlot

AddLoRA = Callable[..., None]

BACKENDS: dict[str, AddLoRA] = {
    "torch": add_lora_segmented,
    "torch-gathered": add_lora_gathered,
}


def select_backend(name: str = "auto") -> AddLoRA:
    """The op for `name`; "auto" picks the fastest one available on this machine."""
    if name == "auto":
        name = "torch"
    if name not in BACKENDS:
        raise ValueError(f"unknown LoRA backend {name!r}; choose one of: auto, {', '.join(BACKENDS)}")
    return BACKENDS[name]


__all__ = ["BACKENDS", "LoRAMapping", "RowSlots", "UniformSlot", "select_backend"]
