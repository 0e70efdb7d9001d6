"""What the Triton kernels share: the import of triton (absent on CPU-only installs), whether its interpreter
runs them (TRITON_INTERPRET=1, set before this module is imported: CPU tensors, how CI checks them without a
GPU), and two device functions. The lora, attention and MoE Triton modules build on this one."""
from __future__ import annotations

import os

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # the CPU paths never need it
    triton = None

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"


def available(device: str | torch.device = "cuda") -> bool:
    """Triton importable and able to run on `device` (a CUDA device, or any device under the interpreter)."""
    if triton is None:
        return False
    return INTERPRET or (torch.device(device).type == "cuda" and torch.cuda.is_available())


if triton is not None:

    @triton.jit
    def dot(p, q, acc, IEEE: tl.constexpr):
        """acc + p @ q, in fp32 at full precision (the reference's, not TF32) where IEEE, else on the inputs'
        dtype (bf16 / fp16 tensor cores, fp32 sums)."""
        if IEEE:
            return tl.dot(p.to(tl.float32), q.to(tl.float32), acc, input_precision="ieee")
        return tl.dot(p, q, acc)

    @triton.jit
    def rounded(v, dtype: tl.constexpr, EMULATE: tl.constexpr):
        """fp32 v in `dtype`, rounded to nearest even; EMULATE: bf16 by integer ops (the interpreter's
        conversion truncates, triton 3.9; a GPU's rounds)."""
        if EMULATE and dtype == tl.bfloat16:
            bits = v.to(tl.uint32, bitcast=True)
            bits = bits + 0x7FFF + ((bits >> 16) & 1)
            return (bits >> 16).to(tl.uint16).to(tl.bfloat16, bitcast=True)
        return v.to(dtype)
