"""The fast CPU path: an AVX-512 (+ AVX512_BF16) C++ kernel for add_lora, built once on first use.

Tokens are grouped by slot inside the kernel (a counting sort), so any token order works; the
shrink is tiled over tokens x rank rows and the expand over 16-row output blocks, skipping the zero
blocks of a packed layer's block-diagonal B (Punica's SGMV idea, for CPUs). Same contract as
lora_torch.py. The build (~30 s, needs a C++ compiler and ninja) is cached under the user's cache
dir, keyed by the source and torch version; where it cannot run, `available()` is False and the
torch reference is used instead.
"""
from __future__ import annotations

import functools
import hashlib
import logging
import os

import torch

from loramux.ops.mapping import LoRAMapping

logger = logging.getLogger(__name__)
_SOURCE = os.path.join(os.path.dirname(__file__), "csrc", "lora_cpu.cpp")
_REQUIRED_CPU_FLAGS = ("avx512f", "avx512bw", "avx512_bf16")


def _cpu_flags() -> set[str]:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


@functools.cache
def _extension():
    """The compiled module, or None where this machine cannot build or run it."""
    missing = [flag for flag in _REQUIRED_CPU_FLAGS if flag not in _cpu_flags()]
    if missing:
        logger.info("LoRA CPU kernel off: this CPU lacks %s", ", ".join(missing))
        return None
    from torch.utils.cpp_extension import load

    with open(_SOURCE, "rb") as f:
        digest = hashlib.sha256(f.read() + torch.__version__.encode()).hexdigest()[:12]
    root = os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache")
    build_dir = os.path.join(root, "loramux", "torch_extensions", f"lora_cpu_{digest}")
    os.makedirs(build_dir, exist_ok=True)
    try:
        return load(name=f"loramux_lora_cpu_{digest}", sources=[_SOURCE], build_directory=build_dir,
                    extra_cflags=["-O3", "-march=native", "-fopenmp"], extra_ldflags=["-fopenmp"])
    except Exception as e:  # no compiler, no ninja, ...: the torch path still works
        logger.warning("LoRA CPU kernel could not be built (%s); using the torch path", e)
        return None


def available() -> bool:
    return _extension() is not None


def add_lora_cpu(y, x, lora_a, lora_b, mapping: LoRAMapping, output_slices: tuple[int, ...] = ()) -> None:
    _extension().add_lora(y, x, lora_a, lora_b, mapping.token_slots, list(output_slices))
