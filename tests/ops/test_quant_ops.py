"""Quantized weights: the torch decoders equal gguf-py's dequantize bit for bit (every GGUF format loramux
keeps), loramux's own formats round-trip, and every quantized-matmul backend equals the reference
(dequantize to fp32, then matmul) for decode and prefill sizes, fp32 and bf16, with and without bias."""
import numpy as np
import pytest
import torch

from conftest import backend_params
from support.gguf_files import random_blocks
from loramux.ops import QUANT_BACKENDS, LoRAMapping, lora_cpu, quant_cpu
from loramux.ops.cpu_extension import _cpu_flags, load_extension
from loramux.ops.quant_torch import (GGUF_FORMATS, LUT4_CODES, QuantFormat, QuantizedWeight, dequantize, pack_i4g, quantize,
                                     quantized_linear, quantized_linear_lora, stack_rows)

OWN_FORMATS = ("i8c", "i4g32", "i4g64", "i4g128", "nf4g64", "fp4g32")  # nf4 / fp4: bitsandbytes' 4-bit


def gguf_weight(fmt: str, n: int, k: int, seed: int = 0) -> QuantizedWeight:
    """A random weight in a GGUF format: q8_0 / q4_0 / q4_1 quantized by gguf-py, K-quants random blocks."""
    import gguf

    kind = getattr(gguf.GGMLQuantizationType, fmt.upper())
    if fmt.endswith("_k"):
        raw = random_blocks(kind, n, k, seed)
    else:
        raw = gguf.quants.quantize(np.random.default_rng(seed).normal(0, 0.05, (n, k)).astype(np.float32), kind)
    return QuantizedWeight(fmt, torch.from_numpy(np.ascontiguousarray(raw)), n, k)


def any_weight(fmt: str, n: int, k: int, seed: int = 0) -> QuantizedWeight:
    if fmt in GGUF_FORMATS:
        return gguf_weight(fmt, n, k, seed)
    return quantize(torch.randn(n, k, generator=torch.Generator().manual_seed(seed)) * 0.05, fmt)


@pytest.mark.parametrize("fmt", GGUF_FORMATS)
def test_decoders_equal_gguf_py_bit_for_bit(fmt):
    import gguf

    weight = gguf_weight(fmt, 6, 512, seed=3)
    expected = gguf.quants.dequantize(weight.data.numpy(), getattr(gguf.GGMLQuantizationType, fmt.upper()))
    assert torch.equal(dequantize(weight), torch.from_numpy(expected).float())


@pytest.mark.parametrize("fmt", OWN_FORMATS)
def test_own_formats_round_to_nearest_within_half_a_step(fmt):
    w = torch.randn(8, 256) * 0.1
    q = quantize(w, fmt)
    assert q.data.shape == (8, QuantFormat.parse(fmt, 256).row_bytes(256))
    error = (dequantize(q) - w).abs()
    if fmt == "i8c":
        assert (error <= w.abs().amax(1, keepdim=True) / 127 / 2 + 1e-7).all()
    elif fmt[:3] in LUT4_CODES:  # the nearest of the 16 codes: no code of the block is nearer to w / absmax
        g, codes = int(fmt[4:]), LUT4_CODES[fmt[:3]]
        absmax = w.reshape(8, -1, g).abs().amax(-1, keepdim=True)
        best = ((w.reshape(8, -1, g) / absmax).unsqueeze(-1) - codes).abs().amin(-1) * absmax
        assert (error.reshape(8, -1, g) <= best + 1e-6).all()
    else:
        g = int(fmt[3:])
        groups = w.reshape(8, -1, g)
        step = (groups.amax(-1) - groups.amin(-1)) / 15
        assert (error.reshape(8, -1, g) <= step.unsqueeze(-1) / 2 + 1e-6).all()
    assert torch.equal(dequantize(quantize(torch.zeros(4, 256), fmt)), torch.zeros(4, 256))  # no 0/0


@pytest.mark.parametrize("kind", ["nf4", "fp4"])
@pytest.mark.parametrize("blocksize", [64, 128])
def test_nf4_and_fp4_equal_bitsandbytes_codes_and_dequantization(kind, blocksize):
    """bitsandbytes' own quantize_4bit / dequantize_4bit (its CPU backend) as the oracle: our quantizer picks
    its codes (a zero's two codes in fp4, +0 and -0, aside) and our decoder gives its weights bit for bit."""
    functional = pytest.importorskip("bitsandbytes.functional")
    w = torch.randn(24, 256, generator=torch.Generator().manual_seed(blocksize))
    packed, state = functional.quantize_4bit(w, blocksize=blocksize, quant_type=kind)
    ours = quantize(w, f"{kind}g{blocksize}")
    flat = packed.reshape(-1).int()
    theirs = torch.stack([flat >> 4, flat & 0xF], dim=1).reshape(24, 256)  # high nibble first
    codes = LUT4_CODES[kind]
    mine = dequantize(QuantizedWeight(ours.fmt, ours.data, 24, 256))
    assert torch.equal(codes[theirs] != 0, mine != 0) and torch.equal(mine, functional.dequantize_4bit(packed, state))
    assert torch.equal(codes, torch.as_tensor(state.code).float())


def test_pack_i4g_and_stack_rows():
    q = torch.randint(0, 16, (3, 64))
    a, b = torch.rand(3, 2), torch.randn(3, 2)
    weight = pack_i4g(q, a, b)
    assert weight.fmt == "i4g32"
    assert torch.equal(dequantize(weight), a.repeat_interleave(32, 1) * q.float() + b.repeat_interleave(32, 1))
    both = stack_rows([weight, weight])
    assert torch.equal(dequantize(both), torch.cat([dequantize(weight)] * 2))
    with pytest.raises(ValueError, match="one format"):
        stack_rows([weight, quantize(torch.randn(2, 64), "i8c")])


def test_bad_shapes_and_formats_are_refused():
    with pytest.raises(ValueError, match="unknown quantized format"):
        QuantFormat.parse("q3_k", 256)
    with pytest.raises(ValueError, match="multiple of 256"):
        QuantizedWeight("q4_k", torch.zeros(2, 144, dtype=torch.uint8), 2, 128)
    with pytest.raises(ValueError, match="needs uint8 data of shape"):
        QuantizedWeight("q8_0", torch.zeros(2, 33, dtype=torch.uint8), 2, 32)


@pytest.mark.parametrize("backend", backend_params(QUANT_BACKENDS, quant_cpu.available))
@pytest.mark.parametrize("fmt", GGUF_FORMATS + OWN_FORMATS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_backends_equal_the_reference(backend, fmt, dtype):
    op = QUANT_BACKENDS[backend].quantized_linear
    weight = any_weight(fmt, 40, 512, seed=1)
    bias = torch.randn(40).to(dtype)
    for rows in (1, 2, 3, 5, 8, 9, 33):  # decode sizes (the fused path) and prefill sizes (panels + GEMM)
        x = torch.randn(rows, 512).to(dtype)
        expected = quantized_linear(x, weight, bias).float()
        out = op(x, weight, bias if rows % 2 else None)
        if not rows % 2:
            expected = quantized_linear(x, weight).float()
        assert out.dtype == dtype and out.shape == (rows, 40)
        tol = 1e-5 if dtype == torch.float32 else 2e-2  # bf16: the result rounded (prefill: the weights too)
        assert ((out.float() - expected).abs().max() / expected.abs().max()).item() < tol, rows


def slot_buffers(slices, in_features, lora_dtype, ranks=(16, 5, 0), max_rank=16, seed=0):
    """LoRALinear's buffers for three slots of the given real ranks: A [3, S * max_rank, in], B [3, out, max_rank]
    rank-major, zero past each slot's rank (as write_slot leaves them)."""
    g = torch.Generator().manual_seed(seed)
    out, num = sum(slices), len(slices)
    a = torch.zeros(3, num * max_rank, in_features)
    b = torch.zeros(3, max_rank, out)
    for slot, r in enumerate(ranks):
        for k in range(num):
            a[slot, k * max_rank:k * max_rank + r] = torch.randn(r, in_features, generator=g) * 0.1
        b[slot, :r] = torch.randn(r, out, generator=g) * 0.1
    return a.to(lora_dtype), b.to(lora_dtype).transpose(1, 2), torch.tensor(ranks)


@pytest.mark.parametrize("backend", backend_params(QUANT_BACKENDS, quant_cpu.available))
@pytest.mark.parametrize("fmt", GGUF_FORMATS + OWN_FORMATS)
@pytest.mark.parametrize("lora_dtype", [torch.float32, torch.bfloat16])
def test_quantized_linear_lora_is_the_base_plus_each_slices_lora(backend, fmt, lora_dtype):
    """quantized_linear_lora (a LoRA layer's one-token pass over a quantized base: one C++ call for one row of fp32
    or bf16 x) equals the quantized matmul plus B_k (A_k x) for each output slice k, written out here, for every
    slot (rank 16, a rank below the buffers', none), with and without bias; more rows take the two calls."""
    op = QUANT_BACKENDS[backend].quantized_linear_lora
    assert backend != "cpu" or quant_cpu._has_lora() or not lora_cpu.available()  # (the one call runs where it can)
    for slices in ((40, 24, 24), (40,), (1000,)):  # q|k|v-like slices off 16-output boundaries; a wide split
        weight = any_weight(fmt, sum(slices), 512, seed=len(slices))
        a, b, ranks = slot_buffers(slices, 512, lora_dtype)
        bias = torch.randn(sum(slices))
        for rows, dtype, slot in ((1, torch.float32, 0), (1, torch.float32, 1), (1, torch.float32, 2),
                                  (3, torch.float32, 1), (1, torch.bfloat16, 0), (1, torch.bfloat16, 1),
                                  (3, torch.bfloat16, 0)):
            x = torch.randn(rows, 512).to(dtype)
            expected = quantized_linear(x, weight, bias if slot else None).float()
            o = 0
            for k, size in enumerate(slices):
                r = int(ranks[slot])
                h = x.float() @ a[slot, 16 * k:16 * k + r].float().t()
                expected[:, o:o + size] += h @ b[slot, o:o + size, :r].float().t()
                o += size
            out = op(x, weight, bias if slot else None, a, b, ranks, slot, slices)
            assert out.dtype == dtype and out.shape == (rows, sum(slices))
            tol = 1e-5 if dtype == torch.float32 else 2e-2
            assert ((out.float() - expected).abs().max() / expected.abs().max()).item() < tol, (slices, rows, slot)


@pytest.mark.skipif(not (quant_cpu.available() and lora_cpu.available()), reason="needs the C++ kernels (AVX-512 BF16)")
@pytest.mark.parametrize("threads", [1, 3, 7])
def test_quantized_linear_lora_splits_over_any_thread_count(threads):
    """The one call's threads split W's rows on 16-output boundaries and h's rows evenly, and wait on each
    other's flags: any thread count (more than cores too), outputs fewer than 16, odd slices, rank-1 buffers."""
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for slices, max_rank, ranks in (((8,), 16, (16, 5, 0)), ((17,), 1, (1, 1, 0)), ((7, 9, 1), 8, (3, 2, 0)),
                                        ((64, 1, 63), 16, (16, 1, 0)), ((300, 100, 100), 16, (16, 5, 0))):
            weight = any_weight("q4_k", sum(slices), 256, seed=3)
            for lora_dtype, dtype in ((torch.float32, torch.float32), (torch.bfloat16, torch.float32),
                                      (torch.bfloat16, torch.bfloat16)):
                a, b, ranks_t = slot_buffers(slices, 256, lora_dtype, ranks, max_rank)
                x = torch.randn(1, 256).to(dtype)
                for slot in range(3):
                    out = quant_cpu.quantized_linear_lora(x, weight, None, a, b, ranks_t, slot, slices).float()
                    expected = quantized_linear_lora(x.float(), weight, None, a.float(), b.float(), ranks_t, slot, slices)
                    tol = 1e-5 if dtype == torch.float32 else 2e-2
                    assert ((out - expected).abs().max() / expected.abs().max()).item() < tol, (slices, slot, dtype)
    finally:
        torch.set_num_threads(old)


@pytest.mark.skipif(not (quant_cpu.available() and lora_cpu.available()), reason="needs the C++ kernels (AVX-512 BF16)")
@pytest.mark.parametrize("fmt", GGUF_FORMATS + OWN_FORMATS)
def test_one_bf16_row_with_lora_rounds_where_the_two_calls_round(fmt):
    """bf16 activations: the fused call gives what the base matmul and add_lora give as two calls (the same bf16
    roundings: the base's output, A x, and y after adding), up to one bf16 step where the sums' order tips one."""
    slices = (40, 24, 24)
    weight = any_weight(fmt, sum(slices), 512, seed=5)
    a, b, ranks = slot_buffers(slices, 512, torch.bfloat16)
    x = torch.randn(1, 512).bfloat16()
    for slot in (0, 1):
        fused = quant_cpu.quantized_linear_lora(x, weight, None, a, b, ranks, slot, slices).float()
        apart = quant_cpu.quantized_linear(x, weight)
        lora_cpu.add_lora_cpu(apart, x, a, b, LoRAMapping.from_slots([slot]), slices, ranks)
        apart = apart.float()
        assert ((fused - apart).abs() <= apart.abs() * 2**-7 + 1e-3).all(), slot
        assert (fused == apart).float().mean().item() > 0.9, slot


@pytest.mark.skipif(not quant_cpu.available(), reason="needs the C++ quantized-matmul kernel (x86, AVX2)")
@pytest.mark.parametrize("fmt", ["q4_k", "q6_k"])
def test_one_fp32_row_keeps_every_bit_of_x(fmt):
    """One fp32 row on a K-quant (on AMD's cores q6_k takes x as three bf16 parts, by vdpbf16ps): x's low bits
    count, as in the fp32 reference. 1 + 2^-9 + 2^-18 + 2^-23 needs all three parts: two would lose 2^-18 of it
    (checked: 4e-6 off then)."""
    weight = any_weight(fmt, 64, 512, seed=4)
    x = torch.full((1, 512), 1 + 2**-9 + 2**-18 + 2**-23) * torch.tensor([1.0, -1.0]).repeat(256)
    expected = x.double() @ dequantize(weight).double().t()  # (exact: the fp32 weights times x in float64)
    out = quant_cpu.quantized_linear(x, weight).double()
    assert ((out - expected).abs().max() / expected.abs().max()).item() < 1e-6


@pytest.mark.skipif(not quant_cpu.available(), reason="needs the C++ quantized-matmul kernel (x86, AVX2)")
@pytest.mark.parametrize("fmt", GGUF_FORMATS + OWN_FORMATS)
def test_cpu_dequantize_equals_the_torch_decoders(fmt):
    weight = any_weight(fmt, 17, 768 if fmt.endswith("_k") or fmt[:3] in ("i4g", "nf4", "fp4") else 224, seed=2)
    assert torch.equal(quant_cpu.dequantize(weight), dequantize(weight))
    assert torch.equal(quant_cpu.dequantize(weight, torch.bfloat16), dequantize(weight).bfloat16())


@pytest.mark.skipif(not quant_cpu.available(), reason="needs the C++ quantized-matmul kernel (x86, AVX2)")
def test_cpu_kernel_uses_every_thread_split_and_leading_dims():
    weight = any_weight("q4_1", 1000, 128)
    x = torch.randn(2, 3, 128)
    torch.testing.assert_close(quant_cpu.quantized_linear(x, weight), quantized_linear(x, weight), rtol=1e-5, atol=1e-5)
    odd = any_weight("i8c", 3, 96)  # K not a multiple of 64 or 128, three rows for two threads
    torch.testing.assert_close(quant_cpu.quantized_linear(x[0, :, :96], odd), quantized_linear(x[0, :, :96], odd))


def assert_rounded_once(out: torch.Tensor, expected: torch.Tensor, case=None) -> None:
    """out (a bf16 result, as fp32) is expected (fp32) rounded to bf16: one bf16 step off at most, where the
    order of the sums tips a rounding, and bit-equal almost everywhere."""
    assert ((out - expected).abs() <= expected.abs() * 2**-7 + 1e-6 * expected.abs().max()).all(), case
    assert (out == expected.bfloat16().float()).float().mean().item() > 0.97, case


@pytest.mark.skipif(not quant_cpu.available(), reason="needs the C++ quantized-matmul kernel (x86, AVX2)")
@pytest.mark.parametrize("fmt", GGUF_FORMATS + OWN_FORMATS)
def test_one_bf16_row_is_the_fp32_reference_rounded_once(fmt):
    """Batch-1 decode in bf16 (for K-quants, sums of bf16 x times bf16 q by vdpbf16ps with the scales applied
    per run): the fp32 reference of the same bf16 x, rounded to bf16 -- off by one bf16 step at most, where
    the order of the sums tips a rounding."""
    weight = any_weight(fmt, 300, 2048, seed=3)
    x = torch.randn(1, 2048, generator=torch.Generator().manual_seed(4)).bfloat16()
    expected = torch.nn.functional.linear(x.float(), dequantize(weight))
    assert_rounded_once(quant_cpu.quantized_linear(x, weight).float(), expected)


@pytest.mark.skipif(not quant_cpu.available() or "amx_bf16" not in _cpu_flags(),
                    reason="needs the C++ quantized-matmul kernel on a CPU with AMX")
@pytest.mark.parametrize("fmt", GGUF_FORMATS + OWN_FORMATS)
def test_few_bf16_rows_use_the_weights_rounded_to_bf16(fmt):
    """2-96 rows of bf16 x (AMX where the CPU has it, 32 rows of W a pass, the last pass partial; past 32 rows
    each block of W decoded whole, then multiplied by x 32 rows at a time, the last 16 or fewer alone): x times
    the weights rounded to bf16, summed in fp32, the result rounded once."""
    weight = any_weight(fmt, 300, 1024, seed=5)
    rounded = dequantize(weight).bfloat16().float()
    for rows in (2, 17, 32, 33, 64, 96):
        x = torch.randn(rows, 1024, generator=torch.Generator().manual_seed(rows)).bfloat16()
        expected = torch.nn.functional.linear(x.float(), rounded)
        assert_rounded_once(quant_cpu.quantized_linear(x, weight).float(), expected, rows)


@pytest.mark.skipif(not quant_cpu.available() or "avx512f" not in _cpu_flags(),
                    reason="needs the C++ quantized-matmul kernel on a CPU with AVX-512")
@pytest.mark.parametrize("fmt", GGUF_FORMATS + OWN_FORMATS)
def test_rows_past_the_fused_path_are_the_reference(fmt):
    """9-512 rows of fp32 x (and of bf16 x where AMX does not take them): 32 rows of W decoded once into a
    k-major panel, multiplied by x 12 rows at a time (the last group of W and the last tile of x partial);
    the fp32 reference up to the order of the sums. 513 rows: panels through oneDNN."""
    weight = any_weight(fmt, 300, 1024, seed=6)
    dense = dequantize(weight)
    bias = torch.randn(300)
    for rows in (9, 12, 13, 25, 100, 512, 513):
        x = torch.randn(rows, 1024, generator=torch.Generator().manual_seed(rows))
        expected = torch.nn.functional.linear(x, dense, bias)
        out = quant_cpu.quantized_linear(x, weight, bias)
        assert ((out - expected).abs().max() / expected.abs().max()).item() < 1e-5, rows
        if "amx_bf16" not in _cpu_flags() and rows <= 512:  # bf16 x: the weights exact (fp32 outer products) or,
            xb = x.bfloat16()                               # where vdpbf16ps runs at the FMA rate, rounded to bf16
            rounded = load_extension("quant_cpu").bf16_rows_round_weights()
            assert_rounded_once(quant_cpu.quantized_linear(xb, weight).float(),
                                torch.nn.functional.linear(xb.float(), dense.bfloat16().float() if rounded else dense), rows)


@pytest.mark.skipif(not quant_cpu.available() or "avx512_bf16" not in _cpu_flags() or "amx_bf16" in _cpu_flags()
                    or not load_extension("quant_cpu").bf16_rows_round_weights(),
                    reason="needs a CPU whose vdpbf16ps runs at the FMA rate, without AMX (AMD Zen 4/5)")
@pytest.mark.parametrize("fmt", GGUF_FORMATS + OWN_FORMATS)
def test_bf16_rows_by_pairs_of_rounded_weights(fmt):
    """5-512 rows of bf16 x on such a CPU: 32 rows of W decoded, rounded to bf16 and laid out in pairs of
    inputs, one vdpbf16ps per pair and 16 outputs; x times the rounded weights, summed in fp32, rounded once
    (2-4 rows stay on the fused path: the exact weights)."""
    weight = any_weight(fmt, 300, 1024, seed=7)
    dense = dequantize(weight)
    for rows in (2, 4, 5, 8, 9, 12, 13, 33, 512):
        x = torch.randn(rows, 1024, generator=torch.Generator().manual_seed(rows)).bfloat16()
        weights = dense if rows <= 4 else dense.bfloat16().float()
        assert_rounded_once(quant_cpu.quantized_linear(x, weight).float(),
                            torch.nn.functional.linear(x.float(), weights), rows)
