"""The fast ops and their pure-torch references: the LoRA math, paged decode attention, the KV-cache
store and the per-token pointwise ops (RMSNorm, SiLU-and-mul, rotary, greedy argmax).

Slot -1 means "base model": those tokens are left untouched by every LoRA op.

All backends share one signature,
`add_lora(y, x, lora_a, lora_b, mapping, output_slices=(), slot_ranks=None) -> None`
(see lora_torch.py for the contract and shapes). The backend is chosen once, when the LoRA layers are
built; nothing in a forward pass branches on it.
"""
from __future__ import annotations

from collections.abc import Callable
from types import SimpleNamespace

import torch

from loramux.ops import (attention_cpu, attention_triton, lora_cpu, lora_triton, moe_cpu, moe_torch, moe_triton,
                         pointwise_cpu, pointwise_torch, pointwise_triton, quant_cpu, quant_torch, triton_common)
from loramux.ops.attention_torch import decode_attention_by_length, decode_attention_torch, store_kv_torch
from loramux.ops.lora_torch import add_lora_gathered, add_lora_segmented, add_lora_segmented_fixed_rows
from loramux.ops.mapping import LoRAMapping, RowSlots, UniformSlot

AddLoRA = Callable[..., None]

BACKENDS: dict[str, AddLoRA] = {
    "torch": add_lora_segmented,
    "torch-gathered": add_lora_gathered,
    "torch-fixed-rows": add_lora_segmented_fixed_rows,  # batch-invariant (EngineConfig.batch_invariant)
    "cpu": lora_cpu.add_lora_cpu,
    "triton": lora_triton.add_lora_triton,  # CUDA (or any device under TRITON_INTERPRET=1)
}


# LoRA ops whose cost does not depend on the order of the tokens (the C++ kernel groups them by slot
# itself; the gathered form indexes per token). For the segmented form a batch ordered by slot means
# fewer, longer runs: one GEMM pair per run.
ORDER_FREE: frozenset[AddLoRA] = frozenset({lora_cpu.add_lora_cpu, lora_triton.add_lora_triton, add_lora_gathered})


# Ops that read no tensor on the host and launch the same kernels whatever the values: a CUDA graph captured
# around them replays right for any later inputs of the same shapes (engine/cuda_graphs.py).
GRAPH_SAFE: frozenset[Callable] = frozenset({lora_triton.add_lora_triton, attention_triton.decode_attention_triton,
                                             decode_attention_torch, moe_triton.fused_experts})


def captures_in_graphs(op: Callable) -> bool:
    return op in GRAPH_SAFE


def wants_grouped_tokens(op: AddLoRA) -> bool:
    """Whether `op` runs faster when the tokens of one slot are next to each other."""
    return op not in ORDER_FREE


def fuses_with_quantized(op: AddLoRA) -> bool:
    """Whether a LoRA layer over a quantized base may run a one-token pass as the quantized-matmul backend's
    quantized_linear_lora instead of base + `op`: for the C++ kernel (the same fp32 math in one call); the torch
    references and batch_invariant's fixed-rows form keep their own arithmetic."""
    return op is lora_cpu.add_lora_cpu


def _choose(what: str, backends: dict, cpu_available, name: str, device) -> Callable:
    """backends[name]; "auto" = the C++ CPU kernel where it runs (CPU device, AVX-512 BF16), else torch."""
    if name == "auto":
        name = "cpu" if torch.device(device).type == "cpu" and cpu_available() else "torch"
    if name not in backends:
        raise ValueError(f"unknown {what} backend {name!r}; choose one of: auto, {', '.join(backends)}")
    if name == "cpu" and torch.device(device).type != "cpu":
        raise ValueError(f"the 'cpu' {what} backend runs on CPU tensors; the device is {device}")
    if name == "cpu" and not cpu_available():
        raise ValueError(f"the 'cpu' {what} backend needs an x86 CPU with AVX-512 BF16, a C++ compiler and ninja")
    return backends[name]


def _triton_on_cuda(what: str, name: str, device) -> str:
    """"auto" on a CUDA device is "triton" where triton is installed; "triton" where it cannot run is refused."""
    if name == "auto" and torch.device(device).type == "cuda" and triton_common.available(device):
        return "triton"
    if name == "triton" and not triton_common.available(device):
        raise ValueError(f"the 'triton' {what} backend needs the triton package and a CUDA device (or TRITON_INTERPRET=1 "
                         f"before loramux is imported); the device is {device}")
    return name


def select_backend(name: str = "auto", device: str | torch.device = "cpu") -> AddLoRA:
    """The add_lora op (see lora_torch.py) for `name` on `device`; "auto" on a CUDA device: the Triton kernels
    where triton is installed, else torch."""
    return _choose("LoRA", BACKENDS, lora_cpu.available, _triton_on_cuda("LoRA", name, device), device)


ATTENTION_BACKENDS = {"torch": decode_attention_torch, "cpu": attention_cpu.decode_attention_cpu,
                      "triton": attention_triton.decode_attention_triton}
# chosen with the attention backend
KV_STORE_BACKENDS = {"torch": store_kv_torch, "cpu": attention_cpu.store_kv_cpu, "triton": attention_triton.store_kv_triton}
# pointwise backends are modules with rms_norm, silu_and_mul, rotary and argmax (see pointwise_torch.py)
POINTWISE_BACKENDS = {"torch": pointwise_torch, "cpu": pointwise_cpu, "triton": pointwise_triton}


def select_attention_backend(name: str = "auto", device: str | torch.device = "cpu"):
    """The paged decode-attention op (see attention_torch.py) for `name` on `device` ("auto" on CUDA: Triton's)."""
    name = _triton_on_cuda("attention", name, device)
    return _choose("attention", ATTENTION_BACKENDS, attention_cpu.available, name, device)


def select_kv_store_backend(name: str = "auto", device: str | torch.device = "cpu"):
    """The KV-cache store op (see attention_torch.py) for attention backend `name` on `device`."""
    name = _triton_on_cuda("attention", name, device)
    return _choose("attention", KV_STORE_BACKENDS, attention_cpu.available, name, device)


def select_attention_ops(name: str = "auto", device: str | torch.device = "cpu", batch_invariant: bool = False):
    """The attention backend as bind_ops binds it: decode_attention and store_kv (batch_invariant: the decode op
    that reduces each sequence alone, and torch's store)."""
    if batch_invariant:
        return SimpleNamespace(decode_attention=decode_attention_by_length, store_kv=store_kv_torch)
    return SimpleNamespace(decode_attention=select_attention_backend(name, device),
                           store_kv=select_kv_store_backend(name, device))


def bind_ops(model: torch.nn.Module, backends: dict[str, object]) -> None:
    """Give every module of `model` its ops from the backends chosen once at start: a module declares
    `<kind>_ops = {attribute: op name}` (RMSNorm's pointwise_ops, QuantizedLinear's quant_ops, Attention's
    attention_ops, ...) and gets getattr(backends[kind], op name) as that attribute. (The LoRA op is a LoRA
    layer's constructor argument instead: which op it is decides how the layer is built, see LoRALinear.)"""
    for module in model.modules():
        for kind, backend in backends.items():
            for attr, name in getattr(module, f"{kind}_ops", {}).items():
                setattr(module, attr, getattr(backend, name))


# weight-only quantized matmul backends: modules with quantized_linear(x, weight, bias) (see quant_torch.py)
QUANT_BACKENDS = {"torch": quant_torch, "cpu": quant_cpu}


def select_quant_backend(name: str = "auto", device: str | torch.device = "cpu"):
    """The quantized-matmul backend (a module with quantized_linear; see quant_torch.py). Its C++ kernel needs
    AVX2 only, so "auto" takes it on more CPUs than the other kernels."""
    return _choose("quantized matmul", QUANT_BACKENDS, quant_cpu.available, name, device)


def select_pointwise_backend(name: str = "auto", device: str | torch.device = "cpu"):
    """The pointwise ops (a module with rms_norm, silu_and_mul, rotary, argmax; see pointwise_torch.py); "auto" on
    a CUDA device: the Triton kernels where triton is installed."""
    name = _triton_on_cuda("pointwise", name, device)
    return _choose("pointwise", POINTWISE_BACKENDS, pointwise_cpu.available, name, device)


# mixture-of-experts backends: modules with fused_experts(x, gate_up, down, topk_ids, topk_weights, lora)
# (see moe_torch.py)
MOE_BACKENDS = {"torch": moe_torch, "cpu": moe_cpu, "triton": moe_triton}


def select_moe_backend(name: str = "auto", device: str | torch.device = "cpu"):
    """The fused-experts backend (a module with fused_experts; see moe_torch.py); "auto" on a CUDA device: the
    expert LoRA in Triton where triton is installed."""
    name = _triton_on_cuda("fused experts", name, device)
    return _choose("fused experts", MOE_BACKENDS, moe_cpu.available, name, device)


__all__ = ["ATTENTION_BACKENDS", "BACKENDS", "GRAPH_SAFE", "KV_STORE_BACKENDS", "MOE_BACKENDS", "ORDER_FREE",
           "POINTWISE_BACKENDS", "QUANT_BACKENDS", "LoRAMapping", "RowSlots", "UniformSlot", "bind_ops",
           "captures_in_graphs", "fuses_with_quantized",
           "select_attention_backend", "select_attention_ops", "select_backend", "select_kv_store_backend",
           "select_moe_backend", "select_pointwise_backend", "select_quant_backend", "wants_grouped_tokens"]
