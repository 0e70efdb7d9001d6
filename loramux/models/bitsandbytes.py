"""bitsandbytes 4-bit checkpoints (QLoRA's base models: HF `quantization_config.quant_method` "bitsandbytes"
with `load_in_4bit`), read without bitsandbytes: each quantized module becomes an nf4g<G> / fp4g<G> weight
(ops/quant_torch.py) with the same values, w = code[q] * absmax, as bitsandbytes dequantizes it.

Layout (as transformers saves a model loaded with BitsAndBytesConfig(load_in_4bit=True)), per module:
  <module>.weight                 the codes of W [N, K] flattened, two per byte, the first in the high nibble
                                  (stored as bnb_4bit_quant_storage: uint8, or any dtype's bytes)
  .weight.absmax                  fp32 [N * K / blocksize]; with double quantization (nested) uint8 codes of it
  .weight.nested_absmax, .weight.nested_quant_map
                                  double quantization: absmax = nested_quant_map[code] * nested_absmax[i /
                                  nested_blocksize] + nested_offset
  .weight.quant_map               the 16-value code book (NF4 or FP4)
  .weight.quant_state.bitsandbytes__<nf4|fp4>
                                  JSON as bytes: shape, blocksize, quant_type, nested_blocksize, nested_offset
The absmax of double quantization is expanded to fp32 at load (4 bytes per block of 64 weights beside 32 bytes
of codes); the weights stay 4-bit. A module whose blocks straddle rows (K not a multiple of the blocksize) or
whose blocksize is no multiple of 32 has no kernel here, and experts of an MoE model are stacked in float:
those are dequantized, with a warning. 8-bit (LLM.int8()) checkpoints are refused by name.
"""
from __future__ import annotations

import json
import logging

import torch

from loramux.ops.quant_torch import LUT4_CODES, QuantFormat, QuantizedWeight, pack_lut4

logger = logging.getLogger(__name__)
_STATE = ".weight.quant_state.bitsandbytes__"


def check_quantization_config(config: dict) -> None:
    """ValueError naming what of a bitsandbytes config is not supported."""
    if config.get("load_in_8bit") or config.get("_load_in_8bit"):
        raise ValueError("bitsandbytes 8-bit (LLM.int8()) checkpoints are not supported; 4-bit ones (load_in_4bit, "
                         "nf4 or fp4) are, or a plain checkpoint")
    if not (config.get("load_in_4bit") or config.get("_load_in_4bit")):
        raise ValueError("a bitsandbytes quantization_config that sets neither load_in_4bit nor load_in_8bit")
    kind = config.get("bnb_4bit_quant_type", "fp4")
    if kind not in LUT4_CODES:
        raise ValueError(f"bitsandbytes 4-bit type {kind!r} is not supported; nf4 and fp4 are")


def read_quantized(state: dict[str, torch.Tensor], config: dict, keep: bool) -> dict[str, QuantizedWeight]:
    """Moves every quantized module out of `state`: into the returned {HF weight name: QuantizedWeight} when
    `keep` (and a kernel runs it), else back into `state` as a float32 weight (`<module>.weight`)."""
    check_quantization_config(config)
    kept = {}
    for key in sorted(k for k in state if _STATE in k):
        prefix = key[: key.index(_STATE)]
        q, absmax, kind, blocksize = _unpack(state, prefix, key)
        n, k = q.shape
        if keep and ".experts." not in prefix:  # (experts: stacked in float, see the module doc)
            if _has_kernel(f"{kind}g{blocksize}", k):
                kept[f"{prefix}.weight"] = pack_lut4(q, absmax.reshape(n, k // blocksize), kind)
                continue
            logger.warning("%s: bitsandbytes blocks of %d over rows of %d inputs have no 4-bit kernel here; "
                           "dequantized", prefix, blocksize, k)
        codes = LUT4_CODES[kind][q.reshape(-1)]
        state[f"{prefix}.weight"] = (codes.reshape(-1, blocksize) * absmax.reshape(-1, 1)).reshape(n, k)
    return kept


def _has_kernel(fmt: str, in_features: int) -> bool:
    """Whether rows of `in_features` weights in `fmt` are a format of ours (QuantFormat's rules: blocks inside
    rows, a multiple of 32 up to 4096)."""
    try:
        QuantFormat.parse(fmt, in_features).row_bytes(in_features)
    except ValueError:
        return False
    return True


def _unpack(state: dict[str, torch.Tensor], prefix: str, key: str) -> tuple[torch.Tensor, torch.Tensor, str, int]:
    """(codes [N, K] int64, absmax fp32 [N * K / blocksize], quant type, blocksize) of one module; its tensors
    leave `state`."""
    meta = json.loads(bytes(state.pop(key).to(torch.uint8).tolist()).decode("utf-8"))
    kind, blocksize = meta["quant_type"], int(meta["blocksize"])
    n, k = (int(d) for d in meta["shape"])
    packed = state.pop(f"{prefix}.weight").contiguous().view(torch.uint8).reshape(-1).to(torch.int64)
    codes = torch.stack([packed >> 4, packed & 0xF], dim=1).reshape(-1)[: n * k].reshape(n, k)
    code_book = state.pop(f"{prefix}.weight.quant_map").float()
    if kind not in LUT4_CODES or not torch.equal(code_book, LUT4_CODES[kind]):
        raise ValueError(f"{prefix}: a bitsandbytes code book other than its own nf4 / fp4 is not supported")
    absmax = state.pop(f"{prefix}.weight.absmax")
    if f"{prefix}.weight.nested_absmax" in state:
        nested = state.pop(f"{prefix}.weight.nested_absmax").float()
        nested_map = state.pop(f"{prefix}.weight.nested_quant_map").float()
        step = int(meta["nested_blocksize"])
        blocks = torch.arange(absmax.numel()) // step
        absmax = nested_map[absmax.reshape(-1).to(torch.int64)] * nested[blocks] + float(meta["nested_offset"])
    return codes, absmax.float().reshape(-1), kind, blocksize
