"""Tile sizes and work splits of the Triton kernels, per GPU: safe defaults, overridden by a table measured on
that GPU (benchmarks/tune_triton.py writes ops/tuned/<gpu>.json; vLLM keeps its tuned kernel configs the same
way). Everything here is a function of host-known shapes only (token count, widths, batch size, SM count),
never of tensor values, so a CUDA graph captured with one choice replays with the same one.

Why splits: at batch 1 a layer's LoRA shrink is one program per slice, and decode attention one per kv head:
3 to 8 programs on a GPU of ~130 SMs, each walking the whole reduction alone. Splitting the reduction (the
shrink's inputs, attention's positions) over more programs, with partial results summed in a fixed order
afterwards (no atomics: the same bits every run), fills the GPU where the batch does not.
"""
from __future__ import annotations

import dataclasses
import functools
import json
from dataclasses import dataclass
from pathlib import Path

import torch

TUNED_DIR = Path(__file__).parent / "tuned"
MAX_SPLITS = 16  # partials a reduction is split into, at most (the summing side unrolls over them)


@dataclass(frozen=True)
class LoRATiles:
    """The LoRA shrink/expand kernels' tiles for a token count: block_m tokens a program, block_n output columns
    an expand program, block_k inputs a shrink step; split_min_k: the fewest inputs a split-K piece may hold."""
    block_m: int = 16
    block_n: int = 64
    block_k: int = 64
    num_warps: int = 4
    split_min_k: int = 256


@dataclass(frozen=True)
class AttentionTiles:
    """Decode attention's tiles: block_n positions a step; split_min_len: the fewest positions of the longest
    possible context a split-KV piece may hold."""
    block_n: int = 64
    num_warps: int = 4
    split_min_len: int = 256


def gpu_name(device: torch.device | str) -> str:
    """The device's name as a file name ("NVIDIA H100 80GB HBM3" -> "nvidia_h100_80gb_hbm3"); "" off CUDA."""
    device = torch.device(device)
    if device.type != "cuda":
        return ""
    return "".join(c if c.isalnum() else "_" for c in torch.cuda.get_device_name(device).lower())


@functools.lru_cache(maxsize=16)
def multiprocessors(device: str) -> int:
    """SMs of a CUDA device; 1 elsewhere (Triton's interpreter: no split is worth its reduction there)."""
    d = torch.device(device)
    return torch.cuda.get_device_properties(d).multi_processor_count if d.type == "cuda" else 1


@functools.lru_cache(maxsize=16)
def tuned_table(name: str) -> dict:
    """{kernel: {max_tokens or batch (as a string): {field: value}}} measured on GPU `name`; {} if none."""
    path = TUNED_DIR / f"{name}.json"
    return json.loads(path.read_text()) if name and path.is_file() else {}


def _pick(table: dict, size: int) -> dict:
    """The entry for `size` of {bound: fields}: the smallest bound >= size, else the largest bound."""
    if not table:
        return {}
    bounds = sorted(int(b) for b in table)
    return table[str(next((b for b in bounds if b >= size), bounds[-1]))]


def lora_tiles(device: torch.device | str, num_tokens: int) -> LoRATiles:
    return dataclasses.replace(LoRATiles(), **_pick(tuned_table(gpu_name(device)).get("lora", {}), num_tokens))


def attention_tiles(device: torch.device | str, batch: int) -> AttentionTiles:
    return dataclasses.replace(AttentionTiles(), **_pick(tuned_table(gpu_name(device)).get("attention", {}), batch))


def splits(programs: int, sms: int, length: int, min_piece: int) -> int:
    """How many pieces to cut a reduction of `length` into, for a grid of `programs` programs on `sms` SMs: enough
    to give every SM a program, never a piece under min_piece, at most MAX_SPLITS; 1 where the grid fills the GPU."""
    if programs >= sms:
        return 1
    return max(1, min(-(-sms // max(1, programs)), length // max(1, min_piece), MAX_SPLITS))
