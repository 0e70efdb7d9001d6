"""GPTQ and AWQ int4 checkpoints (HF `quantization_config.quant_method` "gptq" / "awq"), read without their
CUDA packages: each quantized module's qweight / qzeros / scales become an i4g weight (ops/quant_torch.py)
with the same values, w = s * (q - z) = s * q + (-s * z), exact in float32 (s is fp16, z < 16).

Layouts (as AutoGPTQ / GPTQModel and AutoAWQ write them; K inputs, N outputs, G inputs per group):
  GPTQ  qweight int32 [K / 8, N], 8 inputs per word (input 8i + j at bits 4j); qzeros int32 [K / G, N / 8],
        8 outputs per word; scales fp16 [K / G, N]; g_idx int32 [K] (the group of each input). The "gptq"
        checkpoint format stores zeros minus one, "gptq_v2" as they are.
  AWQ   (version "gemm") qweight int32 [K, N / 8] and qzeros int32 [K / G, N / 8], 8 outputs per word in the
        order 0, 2, 4, 6, 1, 3, 5, 7 (output 8c + t at bits 4 * [0, 4, 1, 5, 2, 6, 3, 7][t]); scales fp16 [K / G, N].
Act-order GPTQ (desc_act, a g_idx that is not input // G) has no i4g form: dequantized, with a warning.
"""
from __future__ import annotations

import logging

import torch

from loramux.ops.quant_torch import QuantizedWeight, pack_i4g

logger = logging.getLogger(__name__)
METHODS = ("gptq", "awq")
_AWQ_SHIFT = torch.tensor([0, 4, 1, 5, 2, 6, 3, 7]) * 4  # bit offset of output 8c + t in word c


def check_quantization_config(config: dict) -> tuple[str, int]:
    """(method, group size) of a supported config; ValueError naming what is not supported."""
    method = config.get("quant_method")
    if method not in METHODS:
        raise ValueError(f"checkpoints quantized with {method!r} are not supported (quantization_config."
                         f"quant_method); supported: gptq and awq with 4 bits, bitsandbytes 4-bit, or a plain "
                         "checkpoint")
    bits = config.get("bits", config.get("w_bit"))
    if bits != 4:
        raise ValueError(f"{method} checkpoints with {bits} bits are not supported; 4-bit ones are")
    if method == "awq" and str(config.get("version", "gemm")).lower() != "gemm":
        raise ValueError(f"AWQ version {config.get('version')!r} is not supported; version 'gemm' is")
    if method == "awq" and config.get("zero_point") is False:
        raise ValueError("AWQ checkpoints without zero points are not supported")
    group = config.get("group_size", config.get("q_group_size", 128))
    return method, int(group)


def read_quantized(state: dict[str, torch.Tensor], config: dict, keep: bool) -> dict[str, QuantizedWeight]:
    """Moves every quantized module out of `state`: into the returned {HF weight name: QuantizedWeight} when
    `keep`, else back into `state` as a float32 weight (`<module>.weight`)."""
    method, group = check_quantization_config(config)
    kept = {}
    for prefix in sorted(name[: -len(".qweight")] for name in state if name.endswith(".qweight")):
        parts = {key: state.pop(f"{prefix}.{key}") for key in ("qweight", "qzeros", "scales", "g_idx")
                 if f"{prefix}.{key}" in state}
        q, zeros, scales, g_idx = _unpack(method, parts, config, group)  # q [N, K], zeros/scales [N, groups]
        k = q.shape[1]
        in_order = torch.equal(g_idx, torch.arange(k) // (k // zeros.shape[1]))
        target = next((g for g in (128, 64, 32) if (k // zeros.shape[1]) % g == 0 and k % g == 0), None)
        if keep and in_order and target is not None:
            kept[f"{prefix}.weight"] = _as_i4g(q, zeros, scales, target)
            continue
        if keep:
            logger.warning("%s: %s weights with act-order (desc_act) or a group size that is no multiple of 32 have "
                           "no int4 kernel here; dequantized", prefix, method)
        s, z = scales[:, g_idx], zeros[:, g_idx].float()
        state[f"{prefix}.weight"] = s * (q.float() - z)
    return kept


def _unpack(method: str, parts: dict, config: dict, group: int):
    """(q [N, K], zeros [N, groups], scales float32 [N, groups], g_idx [K]) of one module."""
    qweight, qzeros, scales = parts["qweight"], parts["qzeros"], parts["scales"].float()
    if method == "gptq":
        q = _words(qweight, torch.arange(8) * 4, dim=0).t()  # [K, N] -> [N, K]
        zeros = _words(qzeros, torch.arange(8) * 4, dim=1)  # [groups, N]
        if config.get("checkpoint_format", "gptq") != "gptq_v2":
            zeros = (zeros + 1) & 0xF  # the v1 format stores zero - 1
        k = q.shape[1]
        g_idx = parts.get("g_idx", torch.arange(k) // (k if group == -1 else group)).long()
    else:
        q = _words(qweight, _AWQ_SHIFT, dim=1).t()
        zeros = _words(qzeros, _AWQ_SHIFT, dim=1)
        k = q.shape[1]
        g_idx = torch.arange(k) // (k if group == -1 else group)
    return q, zeros.t().contiguous(), scales.t().contiguous(), g_idx


def _words(packed: torch.Tensor, shifts: torch.Tensor, dim: int) -> torch.Tensor:
    """int32 words of 8 nibbles -> the nibbles, spread along `dim` (word i, nibble j -> index 8i + j)."""
    nibbles = (packed.to(torch.int64).unsqueeze(dim + 1) >> shifts.view([-1 if d == dim + 1 else 1 for d in range(packed.dim() + 1)])) & 0xF
    shape = list(packed.shape)
    shape[dim] *= 8
    return nibbles.reshape(shape)


def _as_i4g(q: torch.Tensor, zeros: torch.Tensor, scales: torch.Tensor, target: int) -> QuantizedWeight:
    """w = s * q - s * z per group, in i4g groups of `target` inputs (a larger group's scale is repeated)."""
    repeat = q.shape[1] // zeros.shape[1] // target
    a = scales.repeat_interleave(repeat, dim=1)
    b = -(scales * zeros.float()).repeat_interleave(repeat, dim=1)
    return pack_i4g(q, a, b)
