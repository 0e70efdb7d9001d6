"""Weight-only quantized weights: their formats, the pure-torch reference (dequantize, then matmul) and the
quantizers that make the formats loramux writes itself.

A quantized weight W [N, K] (N outputs, K inputs) is stored as raw bytes, row by row: `data` [N, row_bytes]
uint8, each row K / block_elems blocks of block_bytes. Every format decodes a block as groups of 16 or 32
elements, w = a * q + b, with a small integer q and per-group fp32 a and b; rows are independent, so rows of
one format can be stacked (fused q|k|v) and permuted by copying bytes.

Formats (the GGUF ones byte for byte as llama.cpp / gguf-py define them, so a GGUF tensor is used as read;
the decoders below follow gguf-py's arithmetic, which the tests check bit for bit):
  q8_0   32 per block, 34 bytes: fp16 d, int8 q[32]                      w = q * d
  q4_0   32 per block, 18 bytes: fp16 d, 16 bytes of nibbles (low nibbles are elements 0-15, high 16-31)
                                                                          w = d * (q - 8)
  q4_1   32 per block, 20 bytes: fp16 d, fp16 m, nibbles as q4_0          w = d * q + m
  q4_k   256 per block, 144 bytes: fp16 d, fp16 dmin, 12 bytes of 6-bit sub-block scales and mins, 128
         bytes of nibbles (4 runs of 64: 32 low nibbles then the same bytes' 32 high nibbles)
                                                                          w = (d * sc) * q - (dmin * m)
  q5_k   256 per block, 176 bytes: as q4_k plus 32 bytes of fifth bits   w = (d * sc) * q - (dmin * m)
  q6_k   256 per block, 210 bytes: 128 bytes low 4 bits, 64 bytes high 2 bits, int8 scales[16], fp16 d
                                                                          w = (d * sc) * (q - 32)
  i8c    per-channel int8 (a block is a whole row): fp32 scale, int8 q[K]  w = q * scale
  i4g<G> group-wise int4, G in 32/64/128: fp32 a, fp32 b, then G/2 bytes of nibbles (q4_0's layout for
         each run of 32)                                                  w = a * q + b
  nf4g<G>, fp4g<G>  bitsandbytes' 4-bit NormalFloat / FP4 (QLoRA's formats), blocks of G (a multiple of 32,
         bitsandbytes' blocksize): fp32 absmax, then G/2 bytes of nibbles as i4g's
                                                                          w = CODES[q] * absmax
         (CODES: bitsandbytes' 16-value code book; a table lookup, not a * q + b: dequantize does the lookup)
"""
from __future__ import annotations

import re
from dataclasses import dataclass

import torch

GGUF_FORMATS = ("q8_0", "q4_0", "q4_1", "q4_k", "q5_k", "q6_k")
# bitsandbytes' 4-bit code books (bitsandbytes.functional.get_4bit_type), float32.
LUT4_CODES = {
    "nf4": torch.tensor([-1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453, -0.28444138169288635,
                         -0.18477343022823334, -0.09105003625154495, 0.0, 0.07958029955625534, 0.16093020141124725,
                         0.24611230194568634, 0.33791524171829224, 0.44070982933044434, 0.5626170039176941,
                         0.7229568362236023, 1.0]),
    "fp4": torch.tensor([0.0, 0.0052083334885537624, 0.6666666865348816, 1.0, 0.3333333432674408, 0.5,
                         0.1666666716337204, 0.25, 0.0, -0.0052083334885537624, -0.6666666865348816, -1.0,
                         -0.3333333432674408, -0.5, -0.1666666716337204, -0.25]),
}


@dataclass(frozen=True)
class QuantFormat:
    name: str
    block_elems: int  # weights per block along K (i8c: K itself)
    block_bytes: int

    @staticmethod
    def parse(name: str, in_features: int) -> QuantFormat:
        fixed = {"q8_0": (32, 34), "q4_0": (32, 18), "q4_1": (32, 20), "q4_k": (256, 144), "q5_k": (256, 176),
                 "q6_k": (256, 210)}
        if name in fixed:
            return QuantFormat(name, *fixed[name])
        if name == "i8c":
            return QuantFormat(name, in_features, 4 + in_features)
        group = re.fullmatch(r"i4g(32|64|128)", name)
        if group:
            g = int(group.group(1))
            return QuantFormat(name, g, 8 + g // 2)
        lut = re.fullmatch(r"(nf4|fp4)g(\d+)", name)
        if lut and int(lut.group(2)) % 32 == 0 and 32 <= int(lut.group(2)) <= 4096:
            g = int(lut.group(2))
            return QuantFormat(name, g, 4 + g // 2)
        raise ValueError(f"unknown quantized format {name!r}; known: {', '.join(GGUF_FORMATS)}, i8c, i4g32/64/128, "
                         "nf4g<G> and fp4g<G> (G a multiple of 32 up to 4096)")

    def row_bytes(self, in_features: int) -> int:
        if in_features % self.block_elems:
            raise ValueError(f"{self.name} needs the input size to be a multiple of {self.block_elems}, got "
                             f"{in_features}")
        return in_features // self.block_elems * self.block_bytes


@dataclass
class QuantizedWeight:
    """W [out_features, in_features] in `fmt`: data [out_features, row_bytes] uint8 (see the module doc)."""
    fmt: str
    data: torch.Tensor
    out_features: int
    in_features: int

    def __post_init__(self):
        fmt = QuantFormat.parse(self.fmt, self.in_features)
        expected = (self.out_features, fmt.row_bytes(self.in_features))
        if self.data.dtype != torch.uint8 or tuple(self.data.shape) != expected:
            raise ValueError(f"{self.fmt} weight [{self.out_features}, {self.in_features}] needs uint8 data of shape "
                             f"{list(expected)}, got {self.data.dtype} {list(self.data.shape)}")

    @property
    def format(self) -> QuantFormat:
        return QuantFormat.parse(self.fmt, self.in_features)

    @property
    def nbytes(self) -> int:
        return self.data.numel()


# ---- decoding: blocks [n, block_bytes] uint8 -> [n, block_elems] float32 ----------------------------------
def _f16(blocks: torch.Tensor, start: int) -> torch.Tensor:
    """The fp16 at byte `start` of each block, as float32 [n, 1]."""
    return blocks[:, start:start + 2].contiguous().view(torch.float16).float()


def _f32(blocks: torch.Tensor, start: int) -> torch.Tensor:
    return blocks[:, start:start + 4].contiguous().view(torch.float32)


def _nibbles(qs: torch.Tensor, run: int) -> torch.Tensor:
    """Bytes [n, k * run/2] holding runs of `run` elements (each run: run/2 low nibbles, then the same bytes'
    high nibbles) -> [n, k * run] int32 in element order."""
    n = qs.shape[0]
    q = qs.reshape(n, -1, 1, run // 2).to(torch.int32)
    return torch.cat([q & 0xF, q >> 4], dim=2).reshape(n, -1)


def _scale_min_k4(scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """q4_k / q5_k: 12 bytes -> 8 six-bit scales and 8 six-bit mins (int32 [n, 8] each)."""
    s = scales.to(torch.int32).reshape(-1, 3, 4)
    d, m, md = s[:, 0], s[:, 1], s[:, 2]
    sc = torch.cat([d & 0x3F, (md & 0x0F) | ((d >> 2) & 0x30)], dim=1)
    mn = torch.cat([m & 0x3F, (md >> 4) | ((m >> 2) & 0x30)], dim=1)
    return sc, mn


def _decode_q8_0(b):
    return b[:, 2:].contiguous().view(torch.int8).float() * _f16(b, 0)


def _decode_q4_0(b):
    return _f16(b, 0) * (_nibbles(b[:, 2:], 32) - 8).float()


def _decode_q4_1(b):
    return _f16(b, 0) * _nibbles(b[:, 4:], 32).float() + _f16(b, 2)


def _decode_k(b, q: torch.Tensor):
    """q4_k / q5_k: q [n, 256] in 8 sub-blocks of 32."""
    n = b.shape[0]
    sc, mn = _scale_min_k4(b[:, 4:16])
    d = (_f16(b, 0) * sc.float()).reshape(n, 8, 1)
    dm = (_f16(b, 2) * mn.float()).reshape(n, 8, 1)
    return (d * q.float().reshape(n, 8, 32) - dm).reshape(n, 256)


def _decode_q4_k(b):
    return _decode_k(b, _nibbles(b[:, 16:], 64))


def _decode_q5_k(b):
    n = b.shape[0]
    low = _nibbles(b[:, 48:], 64)
    high = (b[:, 16:48].to(torch.int32).reshape(n, 1, 32) >> torch.arange(8, dtype=torch.int32, device=b.device).reshape(1, 8, 1)) & 1
    return _decode_k(b, low | (high.reshape(n, 256) << 4))


def _decode_q6_k(b):
    n = b.shape[0]
    low = _nibbles(b[:, :128], 64).reshape(n, 2, 4, 32)  # per half: runs of 32 from ql[0:32], ql[32:64] (low, high)
    low = low[:, :, [0, 2, 1, 3]]  # element order: ql[l] & 0xF, ql[l+32] & 0xF, ql[l] >> 4, ql[l+32] >> 4
    qh = b[:, 128:192].to(torch.int32).reshape(n, 2, 1, 32) >> torch.tensor([0, 2, 4, 6], dtype=torch.int32, device=b.device).reshape(1, 1, 4, 1)
    q = (low | ((qh & 3) << 4)) - 32
    scales = b[:, 192:208].contiguous().view(torch.int8).float()
    d = (_f16(b, 208) * scales).reshape(n, 16, 1)
    return (d * q.reshape(n, 16, 16).float()).reshape(n, 256)


def _decode_i8c(b):
    return b[:, 4:].contiguous().view(torch.int8).float() * _f32(b, 0)


def _decode_i4g(b):
    return _f32(b, 0) * _nibbles(b[:, 8:], 32).float() + _f32(b, 4)


def _decode_lut4(b, codes: torch.Tensor):
    return codes.to(b.device)[_nibbles(b[:, 4:], 32)] * _f32(b, 0)


_DECODERS = {"q8_0": _decode_q8_0, "q4_0": _decode_q4_0, "q4_1": _decode_q4_1, "q4_k": _decode_q4_k,
             "q5_k": _decode_q5_k, "q6_k": _decode_q6_k, "i8c": _decode_i8c}


def dequantize(weight: QuantizedWeight) -> torch.Tensor:
    """W as float32 [out_features, in_features]."""
    fmt = weight.format
    blocks = weight.data.reshape(-1, fmt.block_bytes)
    if fmt.name[:3] in LUT4_CODES:
        return _decode_lut4(blocks, LUT4_CODES[fmt.name[:3]]).reshape(weight.out_features, weight.in_features)
    decode = _decode_i4g if fmt.name.startswith("i4g") else _DECODERS[fmt.name]
    return decode(blocks).reshape(weight.out_features, weight.in_features)


def quantized_linear(x: torch.Tensor, weight: QuantizedWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """The reference: x [M, K] @ dequantize(W)^T (+ bias) in float32, returned in x's dtype. Every backend of
    this op computes this (fp32 weights and accumulation), up to the order of the sums."""
    out = torch.nn.functional.linear(x.float(), dequantize(weight), None if bias is None else bias.float())
    return out.to(x.dtype)


def add_slot_lora(y: torch.Tensor, x: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor,
                  slot_ranks: torch.Tensor, slot: int, output_slices, add_lora=None) -> torch.Tensor:
    """y [M, N] += adapter slot `slot`'s LoRA of x [M, K] for every row (LoRALinear's buffers), by `add_lora` (an
    ops add_lora backend; None: ops.lora_torch's reference); returns y."""
    from loramux.ops.lora_torch import add_lora_segmented  # (lora_torch is the LoRA ops' home; no cycle at import)
    from loramux.ops.mapping import UniformSlot

    (add_lora or add_lora_segmented)(y, x, lora_a, lora_b, UniformSlot(slot).for_tokens(x.shape[0]), output_slices,
                                     slot_ranks)
    return y


def quantized_linear_lora(x: torch.Tensor, weight: QuantizedWeight, bias: torch.Tensor | None, lora_a: torch.Tensor,
                          lora_b: torch.Tensor, slot_ranks: torch.Tensor, slot: int, output_slices) -> torch.Tensor:
    """quantized_linear plus the LoRA of one adapter slot for every row of x [M, K]: lora_a [L, S * RK, K],
    lora_b [L, N, RK], slot_ranks [L] (LoRALinear's slot buffers), output_slices the S output sizes (see
    ops.lora_torch). A LoRA layer over a quantized base calls it for a one-token batch on one adapter: the C++
    backend runs both in one call (batch-1 decode)."""
    return add_slot_lora(quantized_linear(x, weight, bias), x, lora_a, lora_b, slot_ranks, slot, output_slices)


def embedding_rows(weight: QuantizedWeight, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Rows `ids` [n] of W, decoded ([n, in_features] in dtype): a quantized embedding's lookup."""
    rows = weight.data.index_select(0, ids.reshape(-1))
    picked = QuantizedWeight(weight.fmt, rows, rows.shape[0], weight.in_features)
    return dequantize(picked).to(dtype).reshape(*ids.shape, weight.in_features)


# ---- quantizing a plain weight (the formats loramux writes: i8c, i4g, nf4g / fp4g) ----------------------------
def quantize(w: torch.Tensor, fmt: str) -> QuantizedWeight:
    """Round-to-nearest weight-only quantization of w [N, K]: i8c symmetric per output channel; i4g<G>
    asymmetric per group of G inputs (min and max of the group map to 0 and 15); nf4g<G> / fp4g<G> as
    bitsandbytes quantizes (absmax per block of G, the nearest code of w / absmax)."""
    n, k = w.shape
    spec = QuantFormat.parse(fmt, k)
    spec.row_bytes(k)  # K a multiple of the group
    w = w.detach().float().cpu()
    if fmt[:3] in LUT4_CODES:
        return _quantize_lut4(w, fmt[:3], spec.block_elems)
    if fmt == "i8c":
        scale = w.abs().amax(dim=1, keepdim=True) / 127
        q = torch.where(scale > 0, torch.round(w / torch.where(scale > 0, scale, 1)), 0).clamp(-127, 127)
        data = torch.cat([scale.view(torch.uint8), q.to(torch.int8).view(torch.uint8)], dim=1)
        return QuantizedWeight(fmt, data.contiguous(), n, k)
    g = spec.block_elems
    groups = w.reshape(n * k // g, g)
    lo, hi = groups.amin(dim=1, keepdim=True), groups.amax(dim=1, keepdim=True)
    a = (hi - lo) / 15
    q = torch.where(a > 0, torch.round((groups - lo) / torch.where(a > 0, a, 1)), 0).clamp(0, 15)
    return pack_i4g(q.reshape(n, k), a.reshape(n, -1), lo.reshape(n, -1))


def pack_i4g(q: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> QuantizedWeight:
    """i4g<G> from q [N, K] (integers 0..15) and fp32 a, b [N, K / G] (w = a * q + b); G from the shapes."""
    return _pack_nibble_blocks("i4g", q, [a, b])


def _pack_nibble_blocks(prefix: str, q: torch.Tensor, heads: list[torch.Tensor]) -> QuantizedWeight:
    """`<prefix><G>` blocks: each block's fp32 heads [N, K / G] (G from their shape), then its G/2 bytes of
    nibbles from q [N, K] (0..15), each run of 32 as q4_0's (elements 0-15 the low nibbles)."""
    n, k = q.shape
    g = k // heads[0].shape[1]
    runs = q.to(torch.uint8).reshape(n * k // g, g // 32, 2, 16)
    packed = (runs[:, :, 0] | (runs[:, :, 1] << 4)).reshape(-1, g // 2)
    head_bytes = [t.float().reshape(-1, 1).contiguous().view(torch.uint8) for t in heads]
    blocks = torch.cat([*head_bytes, packed], dim=1)
    return QuantizedWeight(f"{prefix}{g}", blocks.reshape(n, -1).contiguous(), n, k)


def _quantize_lut4(w: torch.Tensor, kind: str, g: int) -> QuantizedWeight:
    n, k = w.shape
    blocks = w.reshape(-1, g)
    absmax = blocks.abs().amax(dim=1, keepdim=True)
    scaled = torch.where(absmax > 0, blocks / torch.where(absmax > 0, absmax, 1), 0)
    values, order = LUT4_CODES[kind].sort(stable=True)  # the nearest code: between two, the midpoint decides
    q = order[torch.bucketize(scaled, (values[1:] + values[:-1]) / 2)]
    return pack_lut4(q.reshape(n, k), absmax.reshape(n, -1), kind)


def pack_lut4(q: torch.Tensor, absmax: torch.Tensor, kind: str) -> QuantizedWeight:
    """nf4g<G> / fp4g<G> (kind "nf4" / "fp4") from codes q [N, K] (0..15) and fp32 absmax [N, K / G]."""
    return _pack_nibble_blocks(f"{kind}g", q, [absmax])


def stack_rows(weights: list[QuantizedWeight]) -> QuantizedWeight:
    """Several weights of one format and input size, their rows one after another (a fused q|k|v)."""
    fmt, k = weights[0].fmt, weights[0].in_features
    if any(w.fmt != fmt or w.in_features != k for w in weights):
        raise ValueError("only weights of one format and input size stack")
    data = torch.cat([w.data for w in weights])
    return QuantizedWeight(fmt, data, data.shape[0], k)
