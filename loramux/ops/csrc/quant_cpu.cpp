// Weight-only quantized linear layers on CPU: y = x @ W^T (+ bias), W stored as raw blocks (the formats of
// ops/quant_torch.py: GGUF q8_0, q4_0, q4_1, q4_k, q5_k, q6_k as gguf-py/llama.cpp lay them out; i8c; i4g<G>;
// bitsandbytes' nf4 / fp4 as nf4g<G> / fp4g<G>).
//
//   qlinear(x [M, K] f32|bf16, data [N, row_bytes] u8, fmt, K, bias [N] | None) -> y [M, N] (x's dtype)
//   qlinear_lora(x [1, K] f32|bf16, data, fmt, K, bias, lora_a, lora_b, slot_ranks, slot, out_slices) -> y [1, N]:
//     qlinear plus one adapter slot's LoRA (LoRALinear's buffers), one call for a batch-1 decode (fused_lora)
//   dequantize(data, fmt, K, dtype) -> W [N, K] (f32 | bf16)
//
// Every block decodes in runs of 32 weights (w = a * q + b, fp32 a and b per group of 16 or 32: the same
// values gguf-py's dequantize gives; nf4 / fp4: w = code[q] * absmax, as bitsandbytes dequantizes); x is widened to fp32 and the sums are fp32, so the result is the
// reference's (dequantize to fp32, then matmul) up to the order of the sums.
// Few rows (decode, M <= kFusedRows): each weight row is decoded once and dotted with every row of x while
// its 32 weights sit in registers: the weights stream from memory once per call, the cost at batch 1.
// Up to kOuterRows: 32 rows of W decoded once, turned k-major, and multiplied by x as outer products (outer).
// More rows (prefill): panels of W are decoded into a buffer and multiplied by torch's GEMM (oneDNN).
// bf16 x, where the CPU has the instructions: one row of x against q4_k / q6_k sums bf16 x times the blocks'
// integers by vdpbf16ps (bf16_single); 2-32 rows run on AMX tiles, the weights decoded to bf16 (amx); without
// AMX, on cores whose vdpbf16ps runs at the FMA rate (AMD Zen 4/5), 5-512 rows by outer products of pairs of
// bf16 weights (outer on bf16 x: k_pairs, outer_tile_bf16).
// Written as plain loops over 32 lanes that the compiler vectorizes (-march=native: AVX2 or AVX-512).
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <immintrin.h>
#include <omp.h>
#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#ifdef __AVX512F__
#include "simd.h"  // transpose16
#endif

namespace {

constexpr int64_t kFusedRows = 8;   // up to this many x rows: the fused decode-and-dot path
constexpr int64_t kOuterRows = 512;  // past kFusedRows up to this many (fp32 x, or bf16 x off AMX): outer products
constexpr int64_t kAmxRows = 32;    // bf16 x on AMX, 2 up to this many rows (two B tiles of 16 rows of x)
constexpr int64_t kAmxWideRows = 96;  // bf16 x on AMX, more than kAmxRows rows: W decoded once per 32 rows
constexpr int64_t kPanelBytes = 4 << 20;  // GEMM path: W decoded this many bytes of rows at a time

// parallel_for's grain over n items: about four chunks a thread, so a slow chunk does not hold up the call
static inline int64_t grain_of(int64_t n) { return std::max<int64_t>(1, n / (4 * at::get_num_threads())); }

static inline float f16(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
#ifdef __F16C__
  return _cvtsh_ss(h);  // one instruction (c10::Half's portable conversion is a few dozen)
#else
  return static_cast<float>(c10::Half(h, c10::Half::from_bits()));
#endif
}
static inline float f32(const uint8_t* p) {
  float v;
  std::memcpy(&v, p, 4);
  return v;
}

// ---- decoders: run r (32 weights) of the block at p -> out[32] ---------------------------------------
// 16 bytes of nibbles -> 32 weights a * q (+ b): low nibbles are elements 0-15, high nibbles 16-31.
static inline void nibbles32(const uint8_t* q, float a, float b, int offset, float* out) {
  for (int i = 0; i < 16; ++i) out[i] = a * static_cast<float>((q[i] & 0xF) + offset) + b;
  for (int i = 0; i < 16; ++i) out[i + 16] = a * static_cast<float>((q[i] >> 4) + offset) + b;
}

struct Q8_0 {
  static constexpr int64_t kElems = 32, kBytes = 34;
  static inline void decode(const uint8_t* p, int, float* out) {
    const float d = f16(p);
    const int8_t* q = reinterpret_cast<const int8_t*>(p + 2);
    for (int i = 0; i < 32; ++i) out[i] = static_cast<float>(q[i]) * d;
  }
};

struct Q4_0 {
  static constexpr int64_t kElems = 32, kBytes = 18;
  static inline void decode(const uint8_t* p, int, float* out) {
    nibbles32(p + 2, f16(p), -0.0f, -8, out);  // d * (q - 8) (+ -0: exact, keeps a zero's sign as gguf-py)
  }
};

struct Q4_1 {
  static constexpr int64_t kElems = 32, kBytes = 20;
  static inline void decode(const uint8_t* p, int, float* out) {
    nibbles32(p + 4, f16(p), f16(p + 2), 0, out);
  }
};

// q4_k / q5_k: sub-block j (of 8) has a 6-bit scale and min packed in 12 bytes
static inline void scale_min_k4(int j, const uint8_t* s, int* sc, int* mn) {
  if (j < 4) {
    *sc = s[j] & 63;
    *mn = s[j + 4] & 63;
  } else {
    *sc = (s[j + 4] & 0xF) | ((s[j - 4] >> 6) << 4);
    *mn = (s[j + 4] >> 4) | ((s[j] >> 6) << 4);
  }
}

struct Q4_K {
  static constexpr int64_t kElems = 256, kBytes = 144;
  static inline void decode(const uint8_t* p, int r, float* out) {
    int sc, mn;
    scale_min_k4(r, p + 4, &sc, &mn);
    const float d = f16(p) * static_cast<float>(sc), dm = f16(p + 2) * static_cast<float>(mn);
    const uint8_t* q = p + 16 + (r / 2) * 32;  // runs 2i and 2i+1 share 32 bytes (low, then high nibbles)
    const int shift = (r % 2) * 4;
    for (int i = 0; i < 32; ++i) out[i] = d * static_cast<float>((q[i] >> shift) & 0xF) - dm;
  }
};

struct Q5_K {
  static constexpr int64_t kElems = 256, kBytes = 176;
  static inline void decode(const uint8_t* p, int r, float* out) {
    int sc, mn;
    scale_min_k4(r, p + 4, &sc, &mn);
    const float d = f16(p) * static_cast<float>(sc), dm = f16(p + 2) * static_cast<float>(mn);
    const uint8_t* qh = p + 16;
    const uint8_t* q = p + 48 + (r / 2) * 32;
    const int shift = (r % 2) * 4;
    for (int i = 0; i < 32; ++i) {
      const int v = ((q[i] >> shift) & 0xF) | (((qh[i] >> r) & 1) << 4);
      out[i] = d * static_cast<float>(v) - dm;
    }
  }
};

struct Q6_K {
  static constexpr int64_t kElems = 256, kBytes = 210;
  static inline void decode(const uint8_t* p, int r, float* out) {
    // half h = r / 4 (128 weights): run j = r % 4 takes ql[l + 32 * (j % 2)] nibble (j / 2) and qh bits 2j
    const int h = r / 4, j = r % 4;
    const uint8_t* ql = p + h * 64 + (j % 2) * 32;
    const uint8_t* qh = p + 128 + h * 32;
    const int8_t* scales = reinterpret_cast<const int8_t*>(p + 192) + h * 8;
    const float d = f16(p + 208);
    const int shift = (j / 2) * 4;
    const float d0 = d * static_cast<float>(scales[2 * j]), d1 = d * static_cast<float>(scales[2 * j + 1]);
    for (int i = 0; i < 32; ++i) {
      const int v = (((ql[i] >> shift) & 0xF) | (((qh[i] >> (2 * j)) & 3) << 4)) - 32;
      out[i] = (i < 16 ? d0 : d1) * static_cast<float>(v);
    }
  }
};

struct I8C {  // a block is the whole row: fp32 scale, then K int8
  static constexpr int64_t kElems = 0, kBytes = 0;  // per tensor (see run_format)
  static inline void decode(const uint8_t* p, int r, float* out) {
    const float s = f32(p);
    const int8_t* q = reinterpret_cast<const int8_t*>(p + 4) + r * 32;
    for (int i = 0; i < 32; ++i) out[i] = static_cast<float>(q[i]) * s;
  }
};

struct I4G {  // fp32 a, fp32 b, then G/2 bytes: runs of 32 as q4_0
  static constexpr int64_t kElems = 0, kBytes = 0;
  static inline void decode(const uint8_t* p, int r, float* out) {
    nibbles32(p + 8 + r * 16, f32(p), f32(p + 4), 0, out);
  }
};

// bitsandbytes' 4-bit code books (bitsandbytes.functional.get_4bit_type), in float32.
alignas(64) constexpr float kNF4[16] = {
    -1.0f, -0.6961928009986877f, -0.5250730514526367f, -0.39491748809814453f, -0.28444138169288635f,
    -0.18477343022823334f, -0.09105003625154495f, 0.0f, 0.07958029955625534f, 0.16093020141124725f,
    0.24611230194568634f, 0.33791524171829224f, 0.44070982933044434f, 0.5626170039176941f, 0.7229568362236023f, 1.0f};
alignas(64) constexpr float kFP4[16] = {
    0.0f, 0.0052083334885537624f, 0.6666666865348816f, 1.0f, 0.3333333432674408f, 0.5f, 0.1666666716337204f, 0.25f,
    0.0f, -0.0052083334885537624f, -0.6666666865348816f, -1.0f, -0.3333333432674408f, -0.5f, -0.1666666716337204f,
    -0.25f};

template <const float* Code>
struct Lut4G {  // fp32 absmax, then G/2 bytes: runs of 32 as q4_0
  static constexpr int64_t kElems = 0, kBytes = 0;
  static inline void decode(const uint8_t* p, int r, float* out) {
    const float s = f32(p);
    const uint8_t* q = p + 4 + r * 16;
    for (int i = 0; i < 16; ++i) out[i] = Code[q[i] & 0xF] * s;
    for (int i = 0; i < 16; ++i) out[i + 16] = Code[q[i] >> 4] * s;
  }
};
using NF4G = Lut4G<kNF4>;
using FP4G = Lut4G<kFP4>;

#ifdef __AVX512F__
// AVX-512 decoders: run r of a block -> weights 0-15 (lo) and 16-31 (hi) in registers, the same values as the
// plain decoders above (the same multiplies and adds, each rounded once).
struct W32 {
  __m512 lo, hi;
};
static inline __m512i u8x16i(const uint8_t* p) { return _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)p)); }
static inline __m512 i8x16(const uint8_t* p) { return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)p))); }
static inline __m512 f16x16(const uint8_t* p) {  // the fp16 at p, broadcast
#ifdef __AVX512FP16__
  __m512 r;  // one instruction, the broadcast folded into the load (the shuffle port stays free for the lookups)
  asm("vcvtph2psx %1%{1to16%}, %0" : "=v"(r) : "m"(*reinterpret_cast<const uint16_t*>(p)));
  return r;
#else
  uint16_t h;  // vpbroadcastw + vcvtph2ps
  std::memcpy(&h, p, 2);
  return _mm512_cvtph_ps(_mm256_set1_epi16(static_cast<short>(h)));
#endif
}
static inline W32 decode_v(Q8_0, const uint8_t* p, int) {
  const __m512 d = f16x16(p);
  return {_mm512_mul_ps(i8x16(p + 2), d), _mm512_mul_ps(i8x16(p + 18), d)};
}
// 4-bit formats by table lookup: table[j] = the weight of nibble value j (computed as the plain decoder
// computes a * j + b, so the values are the same), vpermps picks by each lane's low 4 bits.
static inline __m512 iota16() { return _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15); }
static inline W32 lut32(const uint8_t* q, __m512 table) {  // 16 bytes: low nibbles 0-15, high 16-31
  const __m512i v = u8x16i(q);
  return {_mm512_permutexvar_ps(v, table), _mm512_permutexvar_ps(_mm512_srli_epi32(v, 4), table)};
}
static inline W32 decode_v(Q4_0, const uint8_t* p, int) {
  const __m512 q = _mm512_sub_ps(iota16(), _mm512_set1_ps(8.0f));  // exact: q - 8 as gguf-py, then * d
  return lut32(p + 2, _mm512_mul_ps(f16x16(p), q));
}
static inline W32 decode_v(Q4_1, const uint8_t* p, int) {
  return lut32(p + 4, _mm512_add_ps(_mm512_mul_ps(f16x16(p), iota16()), f16x16(p + 2)));
}
// K-quants: a block's scales (d * sc, dmin * mn per run; q6_k: d * scale per 16 weights) are worked out once
// per block of 256 (BlockScales), the runs then broadcast them.
struct BlockScales {
  float d[16], m[8];
};
static inline BlockScales k4_scales(const uint8_t* p) {
  // the 8 six-bit scales and mins unpacked with 32-bit masks (as llama.cpp does; scale_min_k4 one by one
  // took a third of the decode time), then widened and multiplied 8 at a time
  uint32_t u[4];
  std::memcpy(u, p + 4, 12);
  constexpr uint32_t k6 = 0x3f3f3f3f, k4 = 0x0f0f0f0f, k2 = 0x03030303;
  u[3] = ((u[2] >> 4) & k4) | (((u[1] >> 6) & k2) << 4);  // mins 4-7
  const uint32_t mins = u[1] & k6;                          // mins 0-3
  u[1] = (u[2] & k4) | (((u[0] >> 6) & k2) << 4);           // scales 4-7
  u[2] = mins;
  u[0] &= k6;                                               // scales 0-3
  const __m128i bytes = _mm_loadu_si128((const __m128i*)u);  // scales 0-7, then mins 0-7
  const __m256 sc = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(bytes));
  const __m256 mn = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(bytes, 8)));
  BlockScales s;
  _mm256_storeu_ps(s.d, _mm256_mul_ps(_mm256_set1_ps(f16(p)), sc));
  _mm256_storeu_ps(s.m, _mm256_mul_ps(_mm256_set1_ps(f16(p + 2)), mn));
  return s;
}
static inline W32 decode_v(Q4_K, const BlockScales& s, const uint8_t* p, int r) {
  const uint8_t* q = p + 16 + (r / 2) * 32;  // 32 bytes: this run's nibble of each
  const int shift = (r % 2) * 4;
  const __m512 table = _mm512_sub_ps(_mm512_mul_ps(_mm512_set1_ps(s.d[r]), iota16()), _mm512_set1_ps(s.m[r]));
  return {_mm512_permutexvar_ps(_mm512_srli_epi32(u8x16i(q), shift), table),
          _mm512_permutexvar_ps(_mm512_srli_epi32(u8x16i(q + 16), shift), table)};
}
// 32 bytes widened to 32 16-bit lanes; 16-bit lanes -> two fp32 halves
static inline __m512i u8x32w(const uint8_t* p) { return _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i*)p)); }
static inline W32 scaled(__m512i q16, __m512 d_lo, __m512 d_hi, __m512 m) {
  const __m512 lo = _mm512_cvtepi32_ps(_mm512_cvtepi16_epi32(_mm512_castsi512_si256(q16)));
  const __m512 hi = _mm512_cvtepi32_ps(_mm512_cvtepi16_epi32(_mm512_extracti64x4_epi64(q16, 1)));
  return {_mm512_sub_ps(_mm512_mul_ps(d_lo, lo), m), _mm512_sub_ps(_mm512_mul_ps(d_hi, hi), m)};
}
static inline W32 decode_v(Q5_K, const BlockScales& s, const uint8_t* p, int r) {
  const int shift = (r % 2) * 4;
  const __m512i low = _mm512_and_si512(_mm512_srli_epi16(u8x32w(p + 48 + (r / 2) * 32), shift), _mm512_set1_epi16(0xF));
  const __m512i high = _mm512_slli_epi16(_mm512_and_si512(_mm512_srli_epi16(u8x32w(p + 16), r), _mm512_set1_epi16(1)), 4);
  const __m512 d = _mm512_set1_ps(s.d[r]);
  return scaled(_mm512_or_si512(low, high), d, d, _mm512_set1_ps(s.m[r]));
}
static inline BlockScales q6_scales(const uint8_t* p) {
  BlockScales s;
  _mm512_storeu_ps(s.d, _mm512_mul_ps(_mm512_set1_ps(f16(p + 208)), i8x16(p + 192)));
  return s;
}
static inline W32 decode_v(Q6_K, const BlockScales& s, const uint8_t* p, int r) {
  // half h = r / 4 (128 weights): run j = r % 4 takes ql[l + 32 * (j % 2)] nibble (j / 2) and qh bits 2j
  const int h = r / 4, j = r % 4;
  const __m512i low = _mm512_and_si512(_mm512_srli_epi16(u8x32w(p + h * 64 + (j % 2) * 32), (j / 2) * 4),
                                       _mm512_set1_epi16(0xF));
  const __m512i high = _mm512_slli_epi16(_mm512_and_si512(_mm512_srli_epi16(u8x32w(p + 128 + h * 32), 2 * j),
                                                          _mm512_set1_epi16(3)), 4);
  const __m512i q = _mm512_sub_epi16(_mm512_or_si512(low, high), _mm512_set1_epi16(32));
  const int g = h * 8 + 2 * j;  // its two groups of 16
  return scaled(q, _mm512_set1_ps(s.d[g]), _mm512_set1_ps(s.d[g + 1]), _mm512_setzero_ps());  // (- +0: exact)
}
static inline W32 decode_v(I8C, const uint8_t* p, int r) {
  const __m512 s = _mm512_set1_ps(f32(p));
  const uint8_t* q = p + 4 + r * 32;
  return {_mm512_mul_ps(i8x16(q), s), _mm512_mul_ps(i8x16(q + 16), s)};
}
static inline W32 decode_v(I4G, const uint8_t* p, int r) {
  return lut32(p + 8 + r * 16, _mm512_add_ps(_mm512_mul_ps(_mm512_set1_ps(f32(p)), iota16()), _mm512_set1_ps(f32(p + 4))));
}
template <const float* Code>
static inline W32 decode_v(Lut4G<Code>, const uint8_t* p, int r) {  // the table: code * absmax, as decode's
  return lut32(p + 4 + r * 16, _mm512_mul_ps(_mm512_load_ps(Code), _mm512_set1_ps(f32(p))));
}
// What a block's runs share, worked out once per block (none for most formats).
template <typename Dec>
struct BlockState {
  static int make(const uint8_t*) { return 0; }
};
template <> struct BlockState<Q4_K> { static BlockScales make(const uint8_t* p) { return k4_scales(p); } };
template <> struct BlockState<Q5_K> { static BlockScales make(const uint8_t* p) { return k4_scales(p); } };
template <> struct BlockState<Q6_K> { static BlockScales make(const uint8_t* p) { return q6_scales(p); } };
template <typename Dec>
static inline W32 decode_v(Dec dec, int, const uint8_t* p, int r) { return decode_v(dec, p, r); }
#endif

// The shape of one format's rows: block_elems weights in block_bytes, runs of 32 inside.
struct Layout {
  int64_t elems, bytes, row_bytes;
};

// Where a kernel's fp32 sums go: y [M, N] (row stride ld) in x's dtype, plus the bias [N] (fp32) if any,
// rounded once (as the reference's fp32 result + bias, then .to(dtype)). Written by the kernel itself: a
// separate fp32 result and two conversions cost ~2.5 us a call, ~120 calls a decode step.
struct Out {
  float* f = nullptr;           // fp32 y, or
  c10::BFloat16* b = nullptr;   // bf16 y
  const float* bias = nullptr;
  int64_t ld = 0;
  inline void put(int64_t m, int64_t n, float v) const {
    if (bias) v += bias[n];
    if (f) f[m * ld + n] = v;
    else b[m * ld + n] = c10::BFloat16(v);
  }
};

// ---- the fused path: rows [n0, n1) of W against M <= kFusedRows rows of x (fp32) -------------------------
// A thread reads its rows as one stream; the hardware prefetchers alone leave it latency-bound (~4 GB/s a
// thread, measured), so each row asks for the row kPrefetchBytes ahead, into L2. Measured over 40 cold
// [8192 x 2048] matrices at batch 1 (GB/s, 2 threads): 4 KB ahead into L1 gave q4_k 10.4, q4_1 11.6, q8_0 15.5;
// 32 KB into L2 gives 14.6, 15.7, 21.0 (16-64 KB about the same; into L1, 13.5 for q4_k).
constexpr int64_t kPrefetchBytes = 32 << 10;
static inline void prefetch_ahead(const uint8_t* row, int64_t row_bytes, const uint8_t* end) {
  const uint8_t* ahead = row + std::max<int64_t>(row_bytes, kPrefetchBytes / row_bytes * row_bytes);
  for (int64_t off = 0; off < row_bytes && ahead + off < end; off += 64) _mm_prefetch((const char*)(ahead + off), _MM_HINT_T1);
}

#ifdef __AVX512F__
// acc[m][0..1] += w * x[m] for one run of 32 weights (lo/hi halves); kAcc = 4: runs alternate between two
// accumulator pairs (shorter FMA chains) where registers allow (few rows)
template <int64_t MT, int64_t kAcc, int kParity>
static inline void fma_run(const W32& w, const float* x, int64_t M, int64_t K, int64_t k, __m512 (&acc)[MT][kAcc]) {
  constexpr int a = kAcc == 4 ? 2 * kParity : 0;
  for (int64_t m = 0; m < MT && m < M; ++m) {
    const float* xr = x + m * K + k;
    acc[m][a] = _mm512_fmadd_ps(w.lo, _mm512_loadu_ps(xr), acc[m][a]);
    acc[m][a + 1] = _mm512_fmadd_ps(w.hi, _mm512_loadu_ps(xr + 16), acc[m][a + 1]);
  }
}

template <typename Dec, int64_t MT, int64_t kAcc, typename State, int... R>
static inline void block_runs(const State& state, const uint8_t* block, const float* x, int64_t M, int64_t K, int64_t k,
                              __m512 (&acc)[MT][kAcc], std::integer_sequence<int, R...>) {
  (fma_run<MT, kAcc, R % 2>(decode_v(Dec{}, state, block, R), x, M, K, k + 32 * R, acc), ...);
}

struct NoHook {
  inline void operator()() const {}
};

// on_row(): called once a row, after the row's prefetch (the LoRA path asks for its adapter's lines there)
template <typename Dec, int64_t MT, typename OnRow = NoHook>
static void fused_rows(const float* x, int64_t M, int64_t K, const uint8_t* w, const Layout& L, int64_t n0,
                       int64_t n1, const Out& y, const OnRow& on_row = {}) {
  constexpr int64_t kAcc = MT <= 4 ? 4 : 2;  // 8 rows x 4 accumulators would not fit in 32 registers
  for (int64_t n = n0; n < n1; ++n) {
    __m512 acc[MT][kAcc];
    for (int64_t m = 0; m < MT; ++m)
      for (int64_t a = 0; a < kAcc; ++a) acc[m][a] = _mm512_setzero_ps();
    const uint8_t* row = w + n * L.row_bytes;
    prefetch_ahead(row, L.row_bytes, w + n1 * L.row_bytes);
    on_row();
    for (int64_t b = 0, k = 0; k < K; ++b) {
      const uint8_t* block = row + b * L.bytes;
      const auto state = BlockState<Dec>::make(block);
      if constexpr (Dec::kElems > 0) {
        // a known number of runs, unrolled: each run's offsets and shifts are constants, and runs that share
        // bytes (a K-quant's runs 2i and 2i+1) load them once
        block_runs<Dec, MT, kAcc>(state, block, x, M, K, k, acc, std::make_integer_sequence<int, Dec::kElems / 32>{});
        k += Dec::kElems;
      } else {
        int64_t r = 0;
        for (; r + 1 < L.elems / 32; r += 2, k += 64) {
          fma_run<MT, kAcc, 0>(decode_v(Dec{}, state, block, static_cast<int>(r)), x, M, K, k, acc);
          fma_run<MT, kAcc, 1>(decode_v(Dec{}, state, block, static_cast<int>(r + 1)), x, M, K, k + 32, acc);
        }
        if (r < L.elems / 32) {
          fma_run<MT, kAcc, 0>(decode_v(Dec{}, state, block, static_cast<int>(r)), x, M, K, k, acc);
          k += 32;
        }
      }
    }
    for (int64_t m = 0; m < M; ++m) {
      __m512 sum = _mm512_add_ps(acc[m][0], acc[m][1]);
      if constexpr (kAcc == 4) sum = _mm512_add_ps(sum, _mm512_add_ps(acc[m][2], acc[m][3]));
      y.put(m, n, _mm512_reduce_add_ps(sum));
    }
  }
}
#else
template <typename Dec, int64_t MT>
static void fused_rows(const float* x, int64_t M, int64_t K, const uint8_t* w, const Layout& L, int64_t n0,
                       int64_t n1, const Out& y) {
  alignas(64) float wv[32];
  const int64_t runs = L.elems / 32;
  for (int64_t n = n0; n < n1; ++n) {
    alignas(64) float acc[MT][32] = {};
    const uint8_t* row = w + n * L.row_bytes;
    for (int64_t b = 0, k = 0; k < K; ++b) {
      const uint8_t* block = row + b * L.bytes;
      for (int64_t r = 0; r < runs; ++r, k += 32) {
        Dec::decode(block, static_cast<int>(r), wv);
        for (int64_t m = 0; m < MT && m < M; ++m) {
          const float* xr = x + m * K + k;
          for (int i = 0; i < 32; ++i) acc[m][i] = std::fma(wv[i], xr[i], acc[m][i]);
        }
      }
    }
    for (int64_t m = 0; m < M; ++m) {
      float s = 0.f;
      for (int i = 0; i < 32; ++i) s += acc[m][i];
      y.put(m, n, s);
    }
  }
}
#endif

// Rows [n0, n1) decoded into out [n1 - n0, K] (f32 or bf16).
#ifdef __AVX512F__
static inline void store_run(float* o, const W32& v) {
  _mm512_storeu_ps(o, v.lo);
  _mm512_storeu_ps(o + 16, v.hi);
}
static inline void store_run(c10::BFloat16* o, const W32& v) {  // round to nearest even, as torch's .to(bfloat16)
  _mm256_storeu_si256((__m256i*)o, (__m256i)_mm512_cvtneps_pbh(v.lo));
  _mm256_storeu_si256((__m256i*)(o + 16), (__m256i)_mm512_cvtneps_pbh(v.hi));
}
template <typename Dec, typename T, int... R>
static inline void store_block(const uint8_t* block, T* o, std::integer_sequence<int, R...>) {
  const auto state = BlockState<Dec>::make(block);
  (store_run(o + 32 * R, decode_v(Dec{}, state, block, R)), ...);
}
// One block of one row of W decoded into o [L.elems]
template <typename Dec, typename T>
static inline void decode_block(const uint8_t* block, const Layout& L, T* o) {
  if constexpr (Dec::kElems > 0) {
    store_block<Dec>(block, o, std::make_integer_sequence<int, Dec::kElems / 32>{});
  } else {
    const auto state = BlockState<Dec>::make(block);
    for (int64_t r = 0; r < L.elems / 32; ++r) store_run(o + 32 * r, decode_v(Dec{}, state, block, static_cast<int>(r)));
  }
}
template <typename Dec, typename T>
static void decode_rows(const uint8_t* w, const Layout& L, int64_t K, int64_t n0, int64_t n1, T* out) {
  for (int64_t n = n0; n < n1; ++n) {
    const uint8_t* row = w + n * L.row_bytes;
    prefetch_ahead(row, L.row_bytes, w + n1 * L.row_bytes);
    for (int64_t b = 0; b < K / L.elems; ++b) decode_block<Dec>(row + b * L.bytes, L, out + (n - n0) * K + b * L.elems);
  }
}
#else
template <typename Dec, typename T>
static void decode_rows(const uint8_t* w, const Layout& L, int64_t K, int64_t n0, int64_t n1, T* out) {
  alignas(64) float wv[32];
  const int64_t runs = L.elems / 32;
  for (int64_t n = n0; n < n1; ++n) {
    const uint8_t* row = w + n * L.row_bytes;
    T* o = out + (n - n0) * K;
    for (int64_t b = 0, k = 0; k < K; ++b)
      for (int64_t r = 0; r < runs; ++r, k += 32) {
        Dec::decode(row + b * L.bytes, static_cast<int>(r), wv);
        for (int i = 0; i < 32; ++i) o[k + i] = static_cast<T>(wv[i]);
      }
  }
}
#endif

#ifdef __AVX512F__
// ---- kFusedRows < M <= kOuterRows rows of x in fp32 (fp32 activations, or bf16 ones without AMX) -----------
// The fused path decodes every weight again per 8 rows of x and pays a horizontal sum per output; the GEMM
// path writes W out as a panel that oneDNN reorders at every call (SmolLM2's Q4_1 decode step: 25 ms at
// batch 8, 60 ms at 9). Here a thread takes 32 rows of W at a time, decodes them once (the fused path's
// values) into a k-major panel [K][32] (k_major), and multiplies it by x's rows kOuterTile at a time as outer
// products: acc[m] (32 outputs in two vectors) += W^T[k] * x[m][k], x broadcast. K a multiple of 32.
constexpr int kOuterTile = 12;  // 24 accumulators + 2 weight vectors + a broadcast: within 32 registers

// Rows [n0, n0 + n) of W (n <= 32) -> panel [K][32] fp32 (k-major; 0 past n): each block of 16 rows is
// decoded into an L1 scratch [16][L.elems] and turned by 16 x 16 transposes
template <typename Dec>
static void k_major(const uint8_t* w, const Layout& L, int64_t K, int64_t n0, int n, float* panel, float* scratch) {
  for (int h = 0; h < 2; ++h) {
    const int rows = std::max(0, std::min(16, n - 16 * h));
    for (int64_t b = 0; b < K / L.elems; ++b) {
      for (int j = 0; j < rows; ++j) {
        const uint8_t* row = w + (n0 + 16 * h + j) * L.row_bytes;
        decode_block<Dec>(row + b * L.bytes, L, scratch + j * L.elems);
      }
      for (int64_t c = 0; c < L.elems; c += 16) {
        __m512i r[16];
        for (int j = 0; j < 16; ++j) r[j] = j < rows ? _mm512_loadu_si512(scratch + j * L.elems + c) : _mm512_setzero_si512();
        transpose16(r);  // r[i]: input b * L.elems + c + i of the 16 rows
        for (int i = 0; i < 16; ++i) _mm512_storeu_si512(panel + (b * L.elems + c + i) * 32 + 16 * h, r[i]);
      }
    }
  }
}

// y row m, outputs [n0, n0 + 16) under mask (+ bias), in y's dtype (bf16 rounded to nearest even, as torch's)
static inline void put_row16(const Out& y, int64_t m, int64_t n0, __mmask16 mask, __m512 v) {
  if (y.bias) v = _mm512_add_ps(v, _mm512_maskz_loadu_ps(mask, y.bias + n0));
  if (y.f) {
    _mm512_mask_storeu_ps(y.f + m * y.ld + n0, mask, v);
    return;
  }
#ifdef __AVX512BF16__
  _mm256_mask_storeu_epi16(y.b + m * y.ld + n0, mask, (__m256i)_mm512_cvtneps_pbh(v));
#else
  alignas(64) float o[16];
  _mm512_store_ps(o, v);
  for (int i = 0; i < 16; ++i)
    if (mask >> i & 1) y.b[m * y.ld + n0 + i] = c10::BFloat16(o[i]);
#endif
}

// y rows [m0, m0 + MT), outputs [n0, n0 + n <= 32) from an outer-product tile's sums (two vectors a row)
template <int MT>
static inline void put_tile(const Out& y, int64_t m0, int64_t n0, int n, const __m512 (&acc)[MT][2]) {
  for (int m = 0; m < MT; ++m) {
    put_row16(y, m0 + m, n0, mask16(n), acc[m][0]);
    if (n > 16) put_row16(y, m0 + m, n0 + 16, mask16(n - 16), acc[m][1]);
  }
}

// y rows [m0, m0 + MT), outputs [n0, n0 + n) = x rows . the k-major panel of those n rows of W; asks for
// pf_lines cache lines from pf into L2 on the way (the next rows of W: cold, the loop stalled on them)
template <int MT>
static void outer_tile(const float* x, int64_t K, const float* panel, int64_t m0, int64_t n0, int n, const Out& y,
                       const uint8_t* pf, int64_t pf_lines) {
  __m512 acc[MT][2];
  for (int m = 0; m < MT; ++m) acc[m][0] = acc[m][1] = _mm512_setzero_ps();
  const float* xr = x + m0 * K;
  int64_t pf_acc = 0;
  for (int64_t k = 0; k < K; ++k) {  // each output's sum in k's order, as a GEMM's inner kernel runs it
    for (pf_acc += pf_lines; pf_acc >= K; pf_acc -= K, pf += 64) _mm_prefetch((const char*)pf, _MM_HINT_T1);
    const __m512 w0 = _mm512_loadu_ps(panel + 32 * k), w1 = _mm512_loadu_ps(panel + 32 * k + 16);
    for (int m = 0; m < MT; ++m) {
      const __m512 xb = _mm512_set1_ps(xr[m * K + k]);
      acc[m][0] = _mm512_fmadd_ps(w0, xb, acc[m][0]);
      acc[m][1] = _mm512_fmadd_ps(w1, xb, acc[m][1]);
    }
  }
  put_tile(y, m0, n0, n, acc);
}

template <int... T>
static void outer_rows(int mt, const float* x, int64_t K, const float* panel, int64_t m0, int64_t n0, int n,
                       const Out& y, const uint8_t* pf, int64_t pf_lines, std::integer_sequence<int, T...>) {
  ((mt == T + 1 ? outer_tile<T + 1>(x, K, panel, m0, n0, n, y, pf, pf_lines) : void()), ...);  // mt in 1..kOuterTile
}

#endif

template <typename Dec>
static void fused(const float* x, int64_t M, const uint8_t* w, const Layout& L, int64_t N, int64_t K, const Out& y) {
  at::parallel_for(0, N, grain_of(N), [&](int64_t n0, int64_t n1) {
    if (M == 1) fused_rows<Dec, 1>(x, M, K, w, L, n0, n1, y);
    else if (M <= 2) fused_rows<Dec, 2>(x, M, K, w, L, n0, n1, y);
    else if (M <= 4) fused_rows<Dec, 4>(x, M, K, w, L, n0, n1, y);
    else fused_rows<Dec, kFusedRows>(x, M, K, w, L, n0, n1, y);
  });
}

#if defined(__AVX512BF16__) && defined(__AVX512BW__)
// ---- one row of bf16 x (decode at batch 1), K-quants: sums of x * q by vdpbf16ps -------------------------
// A K-quant weight is a * q + b: a per run of 32 (q4_k, with b) or per 16 (q6_k, b = 0), q a small integer
// that bf16 holds exactly. So x . w = sum over runs of a * (x . q) + b * sum(x), and bf16 x times bf16 q is
// exact in fp32: the same sums as the reference up to their order and where a and b are applied, with no
// widening to fp32 lanes (the fp32 path's cost). The integers become bf16 by one vpermw from 16-bit lanes.
static inline __m512i bf16_ints(float first) {  // 32 bf16: first, first + 1, ..., first + 31
  const __m512 lo = _mm512_add_ps(iota16(), _mm512_set1_ps(first));
  return (__m512i)_mm512_cvtne2ps_pbh(_mm512_add_ps(lo, _mm512_set1_ps(16.0f)), lo);
}
// four accumulators: a run's FMA waits on the one four runs back, not on the last (latency, not ports, bound it)
static inline float sum4(const __m512 (&acc)[4]) {
  return _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(acc[0], acc[1]), _mm512_add_ps(acc[2], acc[3])));
}
// 16 lanes of x[2l] q[2l] + x[2l+1] q[2l+1], x as P bf16 parts P * K apart (fp32 x: three parts whose sum is x
// exactly, dot_x_of; each product exact in fp32)
template <int P>
static inline __m512 dot_pairs(__m512i q_bf16, const uint16_t* x, int64_t K) {
  __m512 s[P];
  for (int p = 0; p < P; ++p)  // independent sums: no chain of P dependent dot products
    s[p] = _mm512_dpbf16_ps(_mm512_setzero_ps(), (__m512bh)q_bf16, (__m512bh)_mm512_loadu_si512(x + p * K));
  if constexpr (P == 3) return _mm512_add_ps(s[0], _mm512_add_ps(s[1], s[2]));
  return s[0];
}

// q4_k: 32 bytes hold runs 2i (low nibbles) and 2i+1 (high); vpermw reads an index's low 5 bits, so a table of
// j % 16 looks the low nibble up straight from the byte
template <int P, int... I>
static inline void q4_k_runs(const BlockScales& s, const uint8_t* p, const uint16_t* x, int64_t K, __m512i table,
                             __m512 (&acc)[4], std::integer_sequence<int, I...>) {
  auto pair = [&](int i) {
    const __m512i v = u8x32w(p + 16 + 32 * i);
    const __m512i lo = _mm512_permutexvar_epi16(v, table), hi = _mm512_permutexvar_epi16(_mm512_srli_epi16(v, 4), table);
    acc[2 * i % 4] = _mm512_fmadd_ps(dot_pairs<P>(lo, x + 64 * i, K), _mm512_set1_ps(s.d[2 * i]), acc[2 * i % 4]);
    acc[2 * i % 4 + 1] =
        _mm512_fmadd_ps(dot_pairs<P>(hi, x + 64 * i + 32, K), _mm512_set1_ps(s.d[2 * i + 1]), acc[2 * i % 4 + 1]);
  };
  (pair(I), ...);
}
template <int P>
static float q4_k_row(const uint8_t* row, int64_t blocks, const uint16_t* x, const float* xsum) {
  const __m512i table = (__m512i)_mm512_cvtne2ps_pbh(iota16(), iota16());  // bf16(j % 16), j < 32
  __m512 acc[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps()};
  __m256 mins = _mm256_setzero_ps();  // sum of dmin * mn * sum(x) per run
  for (int64_t b = 0; b < blocks; ++b) {
    const uint8_t* p = row + b * Q4_K::kBytes;
    const BlockScales s = k4_scales(p);
    mins = _mm256_fmadd_ps(_mm256_loadu_ps(s.m), _mm256_loadu_ps(xsum + 8 * b), mins);
    q4_k_runs<P>(s, p, x + 256 * b, 256 * blocks, table, acc, std::make_integer_sequence<int, 4>{});
  }
  const __m256 m2 = _mm256_add_ps(mins, _mm256_permute2f128_ps(mins, mins, 1));
  alignas(32) float m[8];
  _mm256_store_ps(m, m2);
  return sum4(acc) - ((m[0] + m[1]) + (m[2] + m[3]));
}

// q6_k: run r = 4h + j has 4 low bits from ql (nibble j / 2 of 32 bytes) and 2 high bits from qh (bits 2j);
// a 64-entry table (vpermt2w) maps q to bf16(q - 32). Its 16 sums are pairs of groups g, g + 1 (lanes 0-7, 8-15).
template <int P, int... R>
static inline void q6_k_runs(const uint8_t* p, __m512 d, const uint16_t* x, int64_t K, __m512i t_lo, __m512i t_hi,
                             __m512 (&acc)[4], std::integer_sequence<int, R...>) {
  auto run = [&](auto rc) {
    constexpr int r = decltype(rc)::value, h = r / 4, j = r % 4, g = h * 8 + 2 * j;
    const __m512i low = _mm512_srli_epi16(u8x32w(p + h * 64 + (j % 2) * 32), (j / 2) * 4);
    const __m512i qh = u8x32w(p + 128 + h * 32);
    const __m512i high = _mm512_and_si512(j < 2 ? _mm512_slli_epi16(qh, 4 - 2 * j) : _mm512_srli_epi16(qh, 2 * j - 4),
                                          _mm512_set1_epi16(0x30));
    const __m512i q = _mm512_ternarylogic_epi32(low, _mm512_set1_epi16(0xF), high, 0xEA);  // (low & 0xF) | high
    const __m512 scale = _mm512_permutexvar_ps(
        _mm512_setr_epi32(g, g, g, g, g, g, g, g, g + 1, g + 1, g + 1, g + 1, g + 1, g + 1, g + 1, g + 1), d);
    const __m512 sum = dot_pairs<P>(_mm512_permutex2var_epi16(t_lo, q, t_hi), x + 32 * r, K);
    acc[r % 4] = _mm512_fmadd_ps(sum, scale, acc[r % 4]);
  };
  (run(std::integral_constant<int, R>{}), ...);
}
template <int P>
static float q6_k_row(const uint8_t* row, int64_t blocks, const uint16_t* x) {
  const __m512i t_lo = bf16_ints(-32.0f), t_hi = bf16_ints(0.0f);  // q = 0..31 -> -32..-1, 32..63 -> 0..31
  __m512 acc[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps()};
  for (int64_t b = 0; b < blocks; ++b) {
    const uint8_t* p = row + b * Q6_K::kBytes;
    const __m512 d = _mm512_loadu_ps(q6_scales(p).d);
    q6_k_runs<P>(p, d, x + 256 * b, 256 * blocks, t_lo, t_hi, acc, std::make_integer_sequence<int, 8>{});
  }
  return sum4(acc);
}

// The formats bf16_single takes
template <typename Dec>
constexpr bool kBf16Dot = std::is_same<Dec, Q4_K>::value || std::is_same<Dec, Q6_K>::value;

// x [1, K] for the dot products: P bf16 parts, P * K apart (bf16 x: itself, P = 1; fp32 x: hi, mid, lo, each the
// bf16 rounding of what the parts before it leave, P = 3: their sum is x exactly, 8 + 8 + 8 significant bits),
// and sum(x) per run of 32 (q4_k's b term)
struct DotX {
  const uint16_t* x;
  int parts;
  std::vector<float> xsum;
};

template <typename Dec>
static DotX dot_x_of(const at::Tensor& xc, int64_t K, std::vector<uint16_t>& buf) {
  std::vector<float> xsum(std::is_same<Dec, Q4_K>::value ? K / 32 : 0);
  if (xc.scalar_type() == at::kBFloat16) {
    const uint16_t* xb = reinterpret_cast<const uint16_t*>(xc.data_ptr());
    for (int64_t r = 0; r < static_cast<int64_t>(xsum.size()); ++r)
      for (int i = 0; i < 32; ++i) xsum[r] += static_cast<float>(c10::BFloat16(xb[32 * r + i], c10::BFloat16::from_bits()));
    return {xb, 1, std::move(xsum)};
  }
  const float* xf = xc.data_ptr<float>();
  buf.resize(static_cast<size_t>(3 * K));
  for (int64_t k = 0; k < K; k += 16) {
    __m512 rest = _mm512_loadu_ps(xf + k);
    for (int p = 0; p < 3; ++p) {
      const __m256i part = (__m256i)_mm512_cvtneps_pbh(rest);
      _mm256_storeu_si256((__m256i*)(buf.data() + p * K + k), part);
      rest = _mm512_sub_ps(rest, _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(part), 16)));
    }
  }
  for (int64_t r = 0; r < static_cast<int64_t>(xsum.size()); ++r)
    for (int i = 0; i < 32; ++i) xsum[r] += xf[32 * r + i];
  return {buf.data(), 3, std::move(xsum)};
}

// One row of x against rows of W in q4_k or q6_k: y.put(0, n, row n . x) for n in [n0, n1), calling on_row() once
// a row (after its prefetch)
template <typename Dec, int P, typename OnRow = NoHook>
static void dot_rows(const DotX& x, const uint8_t* w, const Layout& L, int64_t K, int64_t n0, int64_t n1, const Out& y,
                     const OnRow& on_row = {}) {
  for (int64_t n = n0; n < n1; ++n) {
    const uint8_t* row = w + n * L.row_bytes;
    prefetch_ahead(row, L.row_bytes, w + n1 * L.row_bytes);
    on_row();
    y.put(0, n, std::is_same<Dec, Q4_K>::value ? q4_k_row<P>(row, K / 256, x.x, x.xsum.data())
                                               : q6_k_row<P>(row, K / 256, x.x));
  }
}
template <typename Dec, typename OnRow = NoHook>
static void bf16_rows(const DotX& x, const uint8_t* w, const Layout& L, int64_t K, int64_t n0, int64_t n1, const Out& y,
                      const OnRow& on_row = {}) {
  if (x.parts == 1) dot_rows<Dec, 1>(x, w, L, K, n0, n1, y, on_row);
  else dot_rows<Dec, 3>(x, w, L, K, n0, n1, y, on_row);
}

// y [N] = W x for x [1, K] (contiguous; bf16, or fp32 as three bf16 parts), W in q4_k or q6_k
template <typename Dec>
static void bf16_single(const at::Tensor& x, const uint8_t* w, const Layout& L, int64_t N, int64_t K, const Out& y) {
  static thread_local std::vector<uint16_t> buf;
  const DotX xd = dot_x_of<Dec>(x, K, buf);
  at::parallel_for(0, N, grain_of(N), [&](int64_t n0, int64_t n1) { bf16_rows<Dec>(xd, w, L, K, n0, n1, y); });
}
#endif

#if defined(__AVX512F__) && defined(__AVX512BW__)
// ---- one row of x and one adapter's LoRA (batch-1 decode): y = W x (+ bias) + B_k (A_k x) per slice k -----------
// At batch 1 an adapter's arithmetic is tiny; what it cost was a second call per projection (pybind, the GIL, a
// fork/join and two barriers, ~120 times a step). Here one call and one OpenMP region run both. Each thread: its
// rows of h = A x (shared), a flag saying so; its rows of W (the base's own row loop: fused_rows, or bf16_rows for
// bf16 x on K-quants), asking on the way for its outputs' columns of B, into L2; then, once every thread's flag is
// up (long since, as a rule: the base's rows came in between, so this is a read, not a barrier's wait), its
// outputs += B h. Sums in fp32 on exact widenings, rounded where add_lora rounds: bf16 activations round h to bf16
// and y once, after adding. (What is left of an adapter's cost is reading its bytes: SmolLM2's base matmuls at
// batch 1 run near DRAM's rate, so the adapter's 9.75 MB (bf16) cost about what they take to stream; asking for A
// during the rows too, and shrinking after them, was no faster.)
template <typename Wt>
struct SlotLoRA {
  const Wt* a;   // the slot's A [S * RK, K]: slice k's rank rows start at row k * RK
  const Wt* bt;  // the slot's B, rank-major: rank row r of output o at bt[r * N + o]
  int64_t RK, rank;
  const std::vector<int64_t>* slices;  // output sizes, summing to N
  int64_t rows() const { return static_cast<int64_t>(slices->size()) * rank; }  // of h: slice k's at k * rank
  const Wt* a_row(int64_t j, int64_t K) const { return a + (j / rank * RK + j % rank) * K; }
};

// One thread's shrink is done (one cache line each: the flags are written by different cores)
struct alignas(64) DoneFlag {
  std::atomic<int> set{0};
};

template <typename Wt>
static inline float dot_x(const Wt* a, const float* x, int64_t K) {  // K a multiple of 32
  __m512 s0 = _mm512_setzero_ps(), s1 = _mm512_setzero_ps();
  for (int64_t k = 0; k < K; k += 32) {
    s0 = _mm512_fmadd_ps(load16(a + k, 0xFFFF), _mm512_loadu_ps(x + k), s0);
    s1 = _mm512_fmadd_ps(load16(a + k + 16, 0xFFFF), _mm512_loadu_ps(x + k + 16), s1);
  }
  return _mm512_reduce_add_ps(_mm512_add_ps(s0, s1));
}

// y[o0, o1) += sum_r h[r] bt[r * ld + o] (Y: fp32, or bf16 rounded once): four partial rank sums (independent
// FMA chains), added to y at the end as add_lora adds its sums
template <typename Wt, typename Y>
static inline void expand_outputs(const Wt* bt, int64_t ld, int64_t rank, const float* h, Y* y, int64_t o0, int64_t o1) {
  for (int64_t o = o0; o < o1; o += 16) {
    const __mmask16 m = mask16(o1 - o);
    __m512 acc[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps()};
    for (int64_t r = 0; r < rank; ++r)
      acc[r % 4] = _mm512_fmadd_ps(_mm512_set1_ps(h[r]), load16(bt + r * ld + o, m), acc[r % 4]);
    const __m512 sum = _mm512_add_ps(_mm512_add_ps(acc[0], acc[1]), _mm512_add_ps(acc[2], acc[3]));
    store16(y + o, _mm512_add_ps(load16(y + o, m), sum), m);
  }
}

// One thread (t of nt): rows [j0, j1) of h (shared, [S * rank]), then rows [n0, n1) of W (rows(n0, n1, hook)
// writes them into y) and of the LoRA's outputs. x: fp32 (bf16 activations widened)
template <typename Wt, typename Rows>
static void lora_rows(const float* x, int64_t N, int64_t K, const Out& y, const SlotLoRA<Wt>& lo, const Rows& rows,
                      float* h, DoneFlag* done, int t, int nt) {
  const int64_t j0 = lo.rows() * t / nt, j1 = lo.rows() * (t + 1) / nt;
  const int64_t n0 = N * t / nt / 16 * 16, n1 = t + 1 == nt ? N : N * (t + 1) / nt / 16 * 16;
  for (int64_t j = j0; j < j1; ++j) {
    const float v = dot_x(lo.a_row(j, K), x, K);
    h[j] = y.f ? v : static_cast<float>(c10::BFloat16(v));  // bf16: rounded, as a bf16 reference rounds A's output
  }
  done[t].set.store(1, std::memory_order_release);
  // B's rank rows over [n0, n1): a line of them every `every` rows of W, all asked for by 3/4 of the rows
  const int64_t span = (n1 - n0) * static_cast<int64_t>(sizeof(Wt)), lines = (span + 63) / 64;
  const int64_t every = std::max<int64_t>(1, 3 * (n1 - n0) / (4 * std::max<int64_t>(1, lines * lo.rank)));
  const char* b0 = reinterpret_cast<const char*>(lo.bt + n0);
  int64_t line = 0, countdown = every;
  rows(n0, n1, [&] {
    if (--countdown || line >= lines * lo.rank) return;
    countdown = every;
    _mm_prefetch(b0 + line / lines * N * static_cast<int64_t>(sizeof(Wt)) + line % lines * 64, _MM_HINT_T1);
    ++line;
  });
  for (int u = 0; u < nt; ++u)
    for (int spin = 0; !done[u].set.load(std::memory_order_acquire); ++spin)
      if (spin < 4096) _mm_pause();
      else std::this_thread::yield();  // (more threads than cores: let the one it waits for run)
  for (int64_t k = 0, sb = 0; k < static_cast<int64_t>(lo.slices->size()); sb += (*lo.slices)[k++]) {
    const int64_t o0 = std::max(n0, sb), o1 = std::min(n1, sb + (*lo.slices)[k]);
    if (o0 >= o1) continue;
    if (y.f) expand_outputs(lo.bt, N, lo.rank, h + k * lo.rank, y.f, o0, o1);
    else expand_outputs(lo.bt, N, lo.rank, h + k * lo.rank, reinterpret_cast<bf16raw*>(y.b), o0, o1);
  }
}

template <typename Wt, typename Rows>
static void fused_lora(const float* x, int64_t N, int64_t K, const Out& y, const SlotLoRA<Wt>& lo, const Rows& rows) {
  const int nth = static_cast<int>(std::min<int64_t>(at::get_num_threads(), std::max<int64_t>(1, N / 16)));
  static thread_local std::vector<float> h;
  static thread_local std::vector<DoneFlag> done;
  h.resize(static_cast<size_t>(lo.rows()));
  if (static_cast<int>(done.size()) < nth) done = std::vector<DoneFlag>(nth);
  for (int t = 0; t < nth; ++t) done[t].set.store(0, std::memory_order_relaxed);
  float* hp = h.data();
  DoneFlag* dp = done.data();
#pragma omp parallel num_threads(nth)
  lora_rows<Wt>(x, N, K, y, lo, rows, hp, dp, omp_get_thread_num(), omp_get_num_threads());
}
#endif

#if defined(__AVX512BF16__) && defined(__AVX512BW__)
// ---- bf16 x past one row where AMX does not take it, on CPUs whose vdpbf16ps runs at the FMA rate ------------
// outer()'s scheme with the weights rounded to bf16 (as the AMX path and a bf16 model have them): the panel holds
// pairs of k per row, so one vdpbf16ps adds two k's of 16 outputs, twice an fp32 FMA's work. Where vdpbf16ps
// issues at half the FMA rate (Intel cores with AMX hidden), this would be no faster than the fp32 path.

// Rows [n0, n0 + n) of W (n <= 32) -> panel [K/2][32] dwords: dword (k2, j) = bf16 pair (W[j][2 k2], W[j][2 k2 + 1])
// (0 past n); each block of 16 rows decoded into the L1 scratch [16][L.elems], rounded by 32 k's, transposed
template <typename Dec>
static void k_pairs(const uint8_t* w, const Layout& L, int64_t K, int64_t n0, int n, uint32_t* panel, float* scratch) {
  for (int h = 0; h < 2; ++h) {
    const int rows = std::max(0, std::min(16, n - 16 * h));
    for (int64_t b = 0; b < K / L.elems; ++b) {
      for (int j = 0; j < rows; ++j)
        decode_block<Dec>(w + (n0 + 16 * h + j) * L.row_bytes + b * L.bytes, L, scratch + j * L.elems);
      for (int64_t c = 0; c < L.elems; c += 32) {
        __m512i r[16];  // r[j]: row j's 16 pairs of inputs b * L.elems + c ... + 31
        for (int j = 0; j < 16; ++j) {
          const float* src = scratch + j * L.elems + c;
          r[j] = j < rows ? (__m512i)_mm512_cvtne2ps_pbh(_mm512_loadu_ps(src + 16), _mm512_loadu_ps(src))
                          : _mm512_setzero_si512();
        }
        transpose16(r);  // r[i]: pair i of the 16 rows
        for (int i = 0; i < 16; ++i) _mm512_storeu_si512(panel + ((b * L.elems + c) / 2 + i) * 32 + 16 * h, r[i]);
      }
    }
  }
}

// y rows [m0, m0 + MT), outputs [n0, n0 + n) = bf16 x rows . the pair panel; prefetches as outer_tile
template <int MT>
static void outer_tile_bf16(const uint16_t* x, int64_t K, const uint32_t* panel, int64_t m0, int64_t n0, int n,
                            const Out& y, const uint8_t* pf, int64_t pf_lines) {
  __m512 acc[MT][2];
  for (int m = 0; m < MT; ++m) acc[m][0] = acc[m][1] = _mm512_setzero_ps();
  const uint16_t* xr = x + m0 * K;
  int64_t pf_acc = 0;
  for (int64_t k2 = 0; k2 < K / 2; ++k2) {
    for (pf_acc += 2 * pf_lines; pf_acc >= K; pf_acc -= K, pf += 64) _mm_prefetch((const char*)pf, _MM_HINT_T1);
    const __m512bh w0 = (__m512bh)_mm512_loadu_si512(panel + 32 * k2), w1 = (__m512bh)_mm512_loadu_si512(panel + 32 * k2 + 16);
    for (int m = 0; m < MT; ++m) {
      int32_t pair;
      std::memcpy(&pair, xr + m * K + 2 * k2, 4);
      const __m512bh xb = (__m512bh)_mm512_set1_epi32(pair);
      acc[m][0] = _mm512_dpbf16_ps(acc[m][0], w0, xb);
      acc[m][1] = _mm512_dpbf16_ps(acc[m][1], w1, xb);
    }
  }
  put_tile(y, m0, n0, n, acc);
}

template <int... T>
static void outer_rows_bf16(int mt, const uint16_t* x, int64_t K, const uint32_t* panel, int64_t m0, int64_t n0, int n,
                            const Out& y, const uint8_t* pf, int64_t pf_lines, std::integer_sequence<int, T...>) {
  ((mt == T + 1 ? outer_tile_bf16<T + 1>(x, K, panel, m0, n0, n, y, pf, pf_lines) : void()), ...);
}

#endif

#ifdef __AVX512F__
// A thread takes 32 rows of W at a time: their panel, then x kOuterTile rows at a time. X = float: fp32 x against
// the exact weights (k_major, outer_tile); X = uint16_t: bf16 x against pairs of bf16-rounded weights (k_pairs,
// outer_tile_bf16; built with AVX512_BF16 only). Both panels take 128 bytes per input.
template <typename Dec, typename X>
static void outer(const X* x, int64_t M, const uint8_t* w, const Layout& L, int64_t N, int64_t K, const Out& y) {
  constexpr bool kPairs = std::is_same<X, uint16_t>::value;
  using P = std::conditional_t<kPairs, uint32_t, float>;
  const int64_t groups = (N + 31) / 32;
  at::parallel_for(0, groups, grain_of(groups), [&](int64_t a, int64_t b) {
    static thread_local std::vector<float> scratch;
    static thread_local std::vector<P> panel;
    scratch.resize(static_cast<size_t>(16 * L.elems));
    panel.resize(static_cast<size_t>((kPairs ? 16 : 32) * K));
    for (int64_t g = a; g < b; ++g) {
      const int64_t n0 = 32 * g;
      const int n = static_cast<int>(std::min<int64_t>(32, N - n0));
      // the first tile asks for the next group's rows into L2, spread over its k loop
      const int64_t lines = n0 + 32 < N ? (std::min<int64_t>(32, N - n0 - 32) * L.row_bytes + 63) / 64 : 0;
      const uint8_t* next = w + (n0 + 32) * L.row_bytes;
      constexpr auto tiles = std::make_integer_sequence<int, kOuterTile>{};
      if constexpr (kPairs) {
#if defined(__AVX512BF16__) && defined(__AVX512BW__)
        k_pairs<Dec>(w, L, K, n0, n, panel.data(), scratch.data());
        for (int64_t m0 = 0; m0 < M; m0 += kOuterTile)
          outer_rows_bf16(static_cast<int>(std::min<int64_t>(kOuterTile, M - m0)), x, K, panel.data(), m0, n0, n, y,
                          next, m0 == 0 ? lines : 0, tiles);
#endif
      } else {
        k_major<Dec>(w, L, K, n0, n, panel.data(), scratch.data());
        for (int64_t m0 = 0; m0 < M; m0 += kOuterTile)
          outer_rows(static_cast<int>(std::min<int64_t>(kOuterTile, M - m0)), x, K, panel.data(), m0, n0, n, y,
                     next, m0 == 0 ? lines : 0, tiles);
      }
    }
  });
}
#endif

template <typename Dec>
static void decode_all(const uint8_t* w, const Layout& L, int64_t K, int64_t n0, int64_t n1, at::Tensor& out) {
  at::parallel_for(n0, n1, grain_of(n1 - n0), [&](int64_t a, int64_t b) {
    if (out.scalar_type() == at::kFloat) decode_rows<Dec, float>(w, L, K, a, b, out.data_ptr<float>() + (a - n0) * K);
    else decode_rows<Dec, c10::BFloat16>(w, L, K, a, b, out.data_ptr<c10::BFloat16>() + (a - n0) * K);
  });
}

// Calls f.template operator()<Dec>(layout) for the format's decoder.
template <typename F>
static void with_format(const std::string& fmt, int64_t K, F&& f) {
  auto fixed = [&](auto dec) {
    using Dec = decltype(dec);
    f(dec, Layout{Dec::kElems, Dec::kBytes, K / Dec::kElems * Dec::kBytes});
  };
  if (fmt == "q8_0") fixed(Q8_0{});
  else if (fmt == "q4_0") fixed(Q4_0{});
  else if (fmt == "q4_1") fixed(Q4_1{});
  else if (fmt == "q4_k") fixed(Q4_K{});
  else if (fmt == "q5_k") fixed(Q5_K{});
  else if (fmt == "q6_k") fixed(Q6_K{});
  else if (fmt == "i8c") f(I8C{}, Layout{K, 4 + K, 4 + K});
  else if (fmt.rfind("i4g", 0) == 0) {
    const int64_t g = std::stoll(fmt.substr(3));
    f(I4G{}, Layout{g, 8 + g / 2, K / g * (8 + g / 2)});
  } else if (fmt.rfind("nf4g", 0) == 0 || fmt.rfind("fp4g", 0) == 0) {
    const int64_t g = std::stoll(fmt.substr(4));
    const Layout L{g, 4 + g / 2, K / g * (4 + g / 2)};
    if (fmt[0] == 'n') f(NF4G{}, L);
    else f(FP4G{}, L);
  } else {
    TORCH_CHECK(false, "unknown quantized format ", fmt);
  }
}

static void check_args(const at::Tensor& data, const std::string& fmt, int64_t K) {
  TORCH_CHECK(data.device().is_cpu() && data.scalar_type() == at::kByte && data.dim() == 2 && data.is_contiguous(),
              "data must be a contiguous 2-D uint8 CPU tensor");
  TORCH_CHECK(K % 32 == 0, "the input size must be a multiple of 32, got ", K);
  with_format(fmt, K, [&](auto, const Layout& L) {
    TORCH_CHECK(K % L.elems == 0 && data.size(1) == L.row_bytes, fmt, " rows of ", K, " weights take ", L.row_bytes,
                " bytes; data has ", data.size(1));
  });
}

at::Tensor dequantize(const at::Tensor& data, const std::string& fmt, int64_t K, at::ScalarType dtype) {
  check_args(data, fmt, K);
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kBFloat16, "dequantize to float32 or bfloat16");
  at::Tensor out = at::empty({data.size(0), K}, at::TensorOptions().dtype(dtype));
  with_format(fmt, K, [&](auto dec, const Layout& L) {
    decode_all<decltype(dec)>(data.data_ptr<uint8_t>(), L, K, 0, data.size(0), out);
  });
  return out;
}

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512F__)
// ---- AMX (bf16 activations, 2..kAmxRows rows of x): y^T = W x^T by tiles --------------------------------
// The weights are the A operand (16 rows of W x 32 inputs: a decoded run of each row, rounded to bf16 as a
// bf16 model's weights are, is one row of A: no transposition), x^T the B operand (x packed once per call in
// AMX's pair-interleaved layout), and C holds 16 outputs x 16 rows of x in fp32. The decode is the fused
// path's, so the weights still stream once; the multiply no longer grows with the rows of x.
#include "amx.h"

// q4_k runs 2p and 2p+1 of one row, as bf16, into a[2p][i] and a[2p+1][i]: they share 32 bytes (low and
// high nibbles) and one 32-entry table (bf16(d * j - m) of each run, rounded as the fp32 decode is), looked up
// by vpermw: decode_v's values rounded to bf16, without widening to fp32 lanes
static inline void q4_k_bf16_pair(const BlockScales& s, const uint8_t* p, int pair, uint16_t (*a)[16][32], int i) {
  const __m512 lo = _mm512_sub_ps(_mm512_mul_ps(_mm512_set1_ps(s.d[2 * pair]), iota16()), _mm512_set1_ps(s.m[2 * pair]));
  const __m512 hi = _mm512_sub_ps(_mm512_mul_ps(_mm512_set1_ps(s.d[2 * pair + 1]), iota16()), _mm512_set1_ps(s.m[2 * pair + 1]));
  const __m512i table = (__m512i)_mm512_cvtne2ps_pbh(hi, lo);  // 0-15: run 2p, 16-31: run 2p+1
  const __m512i v = u8x32w(p + 16 + 32 * pair);
  const __m512i low = _mm512_and_si512(v, _mm512_set1_epi16(0xF));
  const __m512i high = _mm512_or_si512(_mm512_srli_epi16(v, 4), _mm512_set1_epi16(0x10));
  _mm512_storeu_si512(a[2 * pair][i], _mm512_permutexvar_epi16(low, table));
  _mm512_storeu_si512(a[2 * pair + 1][i], _mm512_permutexvar_epi16(high, table));
}

// C[h][t] += A[h] B[t0 + t] over n runs: tiles 0-3 hold C (W rows 16h.., x rows 16(t0 + t)..), 4-5 the decoded
// A of the two halves, 6-7 x's B tiles. Each B tile loaded serves both halves (x's packed tiles, 128 KB at K =
// 2048, come from L2: loading them once per 16 rows of W cost as much as the multiplies).
static inline void amx_multiply(uint16_t (*const a[2])[16][32], bool two, const uint32_t* xb, int64_t tiles,
                                int64_t chunk, int r0, int n, int64_t t0 = 0) {
  for (int r = r0; r < r0 + n; ++r) {
    _tile_loadd(4, a[0][r], 64);
    if (two) _tile_loadd(5, a[1][r], 64);
    _tile_loadd(6, xb + ((chunk + r) * tiles + t0) * 256, 64);
    _tile_dpbf16ps(0, 4, 6);
    if (two) _tile_dpbf16ps(2, 5, 6);
    if (t0 + 1 < tiles) {
      _tile_loadd(7, xb + ((chunk + r) * tiles + t0 + 1) * 256, 64);
      _tile_dpbf16ps(1, 4, 7);
      if (two) _tile_dpbf16ps(3, 5, 7);
    }
  }
}

// One block of each of the pass's rows (row 16h + i's at blocks[h][i]), from run r0: its runs decoded to bf16
// a chunk at a time (q4_k: the two runs that share bytes) for all rows, each chunk multiplied before the next
// is decoded, so the vector decode of one overlaps the tile multiplies of the last.
template <typename Dec, int... C>
static inline void amx_block(const uint8_t* const (*blocks)[16], const int* rows, int r0, uint16_t (*const a[2])[16][32],
                             const uint32_t* xb, int64_t tiles, int64_t chunk, std::integer_sequence<int, C...>) {
  constexpr int kChunk = std::is_same<Dec, Q4_K>::value ? 2 : 1;
  using State = decltype(BlockState<Dec>::make(nullptr));
  State st[2][16];
  for (int h = 0; h < 2; ++h)
    for (int i = 0; i < rows[h]; ++i) st[h][i] = BlockState<Dec>::make(blocks[h][i]);
  auto step = [&](auto cc) {
    constexpr int c = decltype(cc)::value;
    for (int h = 0; h < 2; ++h)
      for (int i = 0; i < rows[h]; ++i) {
        if constexpr (kChunk == 2) {
          q4_k_bf16_pair(st[h][i], blocks[h][i], c, a[h], i);
        } else {
          const W32 w = decode_v(Dec{}, st[h][i], blocks[h][i], r0 + c);
          _mm512_storeu_si512(a[h][c][i], (__m512i)_mm512_cvtne2ps_pbh(w.hi, w.lo));
        }
      }
    if (xb) amx_multiply(a, rows[1] > 0, xb, tiles, chunk, c * kChunk, kChunk);  // null: decode only
  };
  (step(std::integral_constant<int, C>{}), ...);
}

// C tile (h, t) -> y rows 16t.., outputs g + 16h..: column m of C is row m of y's 16 outputs, gathered in
// L1, then one store (storing each value down y's columns, a row stride apart, took a fifth of the call)
static inline void amx_store(int h, int64_t t, int rows, int64_t M, int64_t g, const Out& y) {
  alignas(64) float c[16][16];
  switch (2 * h + t) {
    case 0: _tile_stored(0, c, 64); break;
    case 1: _tile_stored(1, c, 64); break;
    case 2: _tile_stored(2, c, 64); break;
    default: _tile_stored(3, c, 64); break;
  }
  for (int64_t m = 16 * t; m < std::min(M, 16 * t + 16); ++m) {
    alignas(64) float col[16];
    for (int i = 0; i < 16; ++i) col[i] = c[i][m - 16 * t];
    put_row16(y, m, g + 16 * h, mask16(rows), _mm512_load_ps(col));
  }
}

// Bytes [lo, hi) of rows [r0, r1) of W into L2. 32 interleaved row streams are more than the hardware
// prefetchers follow, so each step asks for its slice of the next 32 rows (batch 8 of the 1.7B Q4_K_M: 41.7
// -> 45.7 tok/s for the next 16 rows at once; a slice per step, in pace with the decode, since 32 rows at once
// overran the queue of misses in flight).
static inline void prefetch_slice(const uint8_t* w, int64_t row_bytes, int64_t r0, int64_t r1, int64_t lo, int64_t hi) {
  for (int64_t row = r0; row < r1; ++row)
    for (int64_t off = lo & ~int64_t{63}; off < hi; off += 64) _mm_prefetch((const char*)(w + row * row_bytes + off), _MM_HINT_T1);
}

template <typename Dec>
constexpr int kAmxRuns = Dec::kElems > 0 ? static_cast<int>(Dec::kElems / 32) : 1;  // runs decoded per step

// The rows of W in each half (16, 16 or fewer) of the pass at row g of [n0, n1)
static inline void pass_rows(int64_t g, int64_t n1, int (&rows)[2]) {
  rows[0] = static_cast<int>(std::min<int64_t>(16, n1 - g));
  rows[1] = static_cast<int>(std::clamp<int64_t>(n1 - g - 16, 0, 16));
}

// Inputs [k, k + 32 kAmxRuns) of the pass's rows at g, decoded into a (each run at a[h][run - k / 32]) and, where xb
// is given, multiplied into the C tiles; the next pass's rows asked for a slice at a time
template <typename Dec>
static inline void amx_step(const uint8_t* w, const Layout& L, int64_t K, int64_t g, int64_t n1, const int (&rows)[2],
                            int64_t k, uint16_t (*const a[2])[16][32], const uint32_t* xb, int64_t tiles) {
  constexpr int kChunks = std::is_same<Dec, Q4_K>::value ? kAmxRuns<Dec> / 2 : kAmxRuns<Dec>;
  prefetch_slice(w, L.row_bytes, g + 32, std::min(g + 64, n1), L.row_bytes * k / K,
                 L.row_bytes * (k + 32 * kAmxRuns<Dec>) / K);
  const uint8_t* blocks[2][16];
  for (int h = 0; h < 2; ++h)
    for (int i = 0; i < rows[h]; ++i) blocks[h][i] = w + (g + 16 * h + i) * L.row_bytes + k / L.elems * L.bytes;
  amx_block<Dec>(blocks, rows, static_cast<int>(k % L.elems / 32), a, xb, tiles, k / 32,
                 std::make_integer_sequence<int, kChunks>{});
}

// rows [n0, n1) of W, 32 at a time (two halves of 16)
template <typename Dec>
static void amx_rows(const uint32_t* xb, int64_t M, int64_t K, const uint8_t* w, const Layout& L, int64_t n0,
                     int64_t n1, const Out& y) {
  const int64_t tiles = (M + 15) / 16;
  const TileConfig cfg = square_tiles();
  _tile_loadconfig(&cfg);
  alignas(64) static thread_local uint16_t buf[2][kAmxRuns<Dec>][16][32];  // [half][run][row of W][input]
  uint16_t (*const a[2])[16][32] = {buf[0], buf[1]};
  for (int64_t g = n0; g < n1; g += 32) {
    int rows[2];
    pass_rows(g, n1, rows);
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    for (int64_t k = 0; k < K; k += 32 * kAmxRuns<Dec>) amx_step<Dec>(w, L, K, g, n1, rows, k, a, xb, tiles);
    for (int h = 0; h < 2; ++h)
      for (int64_t t = 0; t < tiles && rows[h] > 0; ++t) amx_store(h, t, rows[h], M, g, y);
  }
  _tile_release();
}

// More than kAmxRows rows of x (prefill): rows [n0, n1) of W, 32 at a time, each block of 32 rows decoded whole
// into bf16 tiles once (as amx_rows decodes it, the next rows prefetched alike), then multiplied by x 32 rows
// at a time, C in tiles over all of K. The decode no longer overlaps the tiles, but serves every row of x.
template <typename Dec>
static void amx_wide_rows(const uint32_t* xb, int64_t M, int64_t K, const uint8_t* w, const Layout& L, int64_t n0,
                          int64_t n1, const Out& y) {
  const int64_t tiles = (M + 15) / 16, runs = K / 32;
  const TileConfig cfg = square_tiles();
  _tile_loadconfig(&cfg);
  static thread_local std::vector<uint16_t> buf;  // [half][run][row of W][input]
  buf.resize(static_cast<size_t>(2 * runs * 512));
  uint16_t (*const whole[2])[16][32] = {reinterpret_cast<uint16_t (*)[16][32]>(buf.data()),
                                        reinterpret_cast<uint16_t (*)[16][32]>(buf.data() + runs * 512)};
  for (int64_t g = n0; g < n1; g += 32) {
    int rows[2];
    pass_rows(g, n1, rows);
    for (int64_t k = 0; k < K; k += 32 * kAmxRuns<Dec>) {
      uint16_t (*const a[2])[16][32] = {whole[0] + k / 32, whole[1] + k / 32};
      amx_step<Dec>(w, L, K, g, n1, rows, k, a, nullptr, 0);
    }
    for (int64_t t0 = 0; t0 < tiles; t0 += 2) {
      _tile_zero(0);
      _tile_zero(1);
      _tile_zero(2);
      _tile_zero(3);
      amx_multiply(whole, rows[1] > 0, xb, tiles, 0, 0, static_cast<int>(runs), t0);
      Out part = y;  // x rows 16 t0.. of y
      if (part.f) part.f += 16 * t0 * y.ld; else part.b += 16 * t0 * y.ld;
      const int64_t m = std::min<int64_t>(32, M - 16 * t0);
      for (int h = 0; h < 2; ++h)
        for (int64_t t = 0; t < (m + 15) / 16 && rows[h] > 0; ++t) amx_store(h, t, rows[h], m, g, part);
    }
  }
  _tile_release();
}

template <typename Dec>
static void amx(const at::Tensor& x, const uint8_t* w, const Layout& L, int64_t N, int64_t K, const Out& y) {
  const int64_t M = x.size(0);
  const std::vector<uint32_t> xb = pack_x(reinterpret_cast<const uint16_t*>(x.data_ptr<c10::BFloat16>()), M, K, (M + 15) / 16);
  const int64_t groups = (N + 31) / 32;
  at::parallel_for(0, groups, grain_of(groups), [&](int64_t a, int64_t b) {
    if (M <= kAmxRows) amx_rows<Dec>(xb.data(), M, K, w, L, 32 * a, std::min(N, 32 * b), y);
    else amx_wide_rows<Dec>(xb.data(), M, K, w, L, 32 * a, std::min(N, 32 * b), y);
  });
}
#endif

// x [M, K] as contiguous fp32 for the fused path: x's own data when it is that already, else a copy in buf
static const float* x_as_f32(const at::Tensor& x, std::vector<float>& buf) {
  if (x.scalar_type() == at::kFloat && x.is_contiguous()) return x.data_ptr<float>();
  const at::Tensor xc = x.contiguous();
  buf.resize(static_cast<size_t>(xc.numel()));
  if (xc.scalar_type() == at::kFloat) {
    std::memcpy(buf.data(), xc.data_ptr<float>(), buf.size() * sizeof(float));
  } else {
    const c10::BFloat16* xb = xc.data_ptr<c10::BFloat16>();
    for (size_t i = 0; i < buf.size(); ++i) buf[i] = static_cast<float>(xb[i]);
  }
  return buf.data();
}

static Out out_for(at::Tensor& y, const at::Tensor& bias_f) {
  Out out;
  out.ld = y.size(1);
  if (y.scalar_type() == at::kFloat) out.f = y.data_ptr<float>();
  else out.b = y.data_ptr<c10::BFloat16>();
  if (bias_f.defined()) out.bias = bias_f.data_ptr<float>();
  return out;
}

// Whether bf16 x runs on AMX tiles here (up to kAmxWideRows rows; past them oneDNN's GEMM, on AMX too)
static bool bf16_on_amx() {
#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512F__)
  return amx_usable();
#else
  return false;
#endif
}

// Whether bf16 x past one row (off AMX) takes outer's pairs (k_pairs): vdpbf16ps at the FMA rate, i.e. twice its work. AMD's
// cores with AVX512_BF16 (Zen 4, Zen 5) issue it so; Intel's without AMX exposed ran it at half the rate (see
// docs/performance.md), where the fp32 outer products on exact weights are as fast
static bool bf16_dot_fast() {
#if defined(__AVX512BF16__) && defined(__AVX512BW__)
  static const bool fast = __builtin_cpu_is("amd");
  return fast && !bf16_on_amx();
#else
  return false;
#endif
}

// Whether one fp32 row of x against Dec (a kBf16Dot format) runs as three exact bf16 parts (dot_x_of) by
// vdpbf16ps rather than decoding the weights to fp32: q6_k on AMD's cores (Zen 5, 12 cold [8192 x 2048] matrices,
// 2 threads: 29 -> 34-41 GB/s); q4_k's fp32 decode is cheaper than three dot products per run there (28 vs 24 GB/s)
template <typename Dec>
static bool f32_by_parts() {
  return std::is_same<Dec, Q6_K>::value && bf16_dot_fast();
}

// The kernels that decode W once per call, into y: decode sizes (M <= kFusedRows), AMX for bf16 x up to
// kAmxWideRows, outer products up to kOuterRows where AMX does not take x; false where none applies (then the
// GEMM path: bf16 prefill past kAmxWideRows on AMX, and past kOuterRows).
static bool decode_sizes(const at::Tensor& x, const at::Tensor& data, const std::string& fmt, int64_t K, const Out& y) {
  const int64_t M = x.size(0), N = data.size(0);
  const uint8_t* w = data.data_ptr<uint8_t>();
  const bool bf16 = x.scalar_type() == at::kBFloat16;
#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512F__)
  if (bf16 && M >= 2 && M <= kAmxWideRows && amx_usable()) {
    const at::Tensor xb = x.contiguous();
    with_format(fmt, K, [&](auto dec, const Layout& L) { amx<decltype(dec)>(xb, w, L, N, K, y); });
    return true;
  }
#endif
#ifdef __AVX512F__
  const bool by_outer = M > kFusedRows && M <= kOuterRows && !(bf16 && bf16_on_amx());
#else
  const bool by_outer = false;
#endif
  // outer on pairs from 5 rows: the fused path runs 5-8 rows as 8 (Zen 5, [8192 x 2048] q4_k at 8 rows: 1.8 -> 0.9 ms;
  // at 2-4 rows the panel's decode and transposes cost more than the fused dots save)
  const bool by_pairs = bf16 && M > 4 && M <= kOuterRows && bf16_dot_fast();
  if (M > kFusedRows && !by_outer) return false;
  with_format(fmt, K, [&](auto dec, const Layout& L) {
    using Dec = decltype(dec);
#if defined(__AVX512BF16__) && defined(__AVX512BW__)
    if constexpr (kBf16Dot<Dec>) {
      if (M == 1 && (bf16 || f32_by_parts<Dec>())) return bf16_single<Dec>(x.contiguous(), w, L, N, K, y);
    }
#endif
#if defined(__AVX512BF16__) && defined(__AVX512BW__)
    if (by_pairs) {
      const at::Tensor xb = x.contiguous();
      return outer<Dec>(reinterpret_cast<const uint16_t*>(xb.data_ptr()), M, w, L, N, K, y);
    }
#endif
    static thread_local std::vector<float> buf;
    const float* xf = x_as_f32(x, buf);
#ifdef __AVX512F__
    if (by_outer) return outer<Dec>(xf, M, w, L, N, K, y);
#endif
    fused<Dec>(xf, M, w, L, N, K, y);
  });
  return true;
}

at::Tensor qlinear(const at::Tensor& x, const at::Tensor& data, const std::string& fmt, int64_t K,
                   const c10::optional<at::Tensor>& bias) {
  check_args(data, fmt, K);
  TORCH_CHECK(x.dim() == 2 && x.size(1) == K && x.device().is_cpu(), "x must be [M, ", K, "] on the CPU");
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16, "x must be float32 or bfloat16");
  const int64_t M = x.size(0), N = data.size(0);
  at::Tensor y = at::empty({M, N}, x.options());
  if (M <= std::max({kFusedRows, kOuterRows, kAmxRows, kAmxWideRows})) {
    const at::Tensor bias_f = bias.has_value() ? bias->to(at::kFloat).contiguous() : at::Tensor();
    if (decode_sizes(x, data, fmt, K, out_for(y, bias_f))) return y;
  }
  // Panels of W in x's dtype through torch's GEMM (bf16: the weights rounded to bf16, as a bf16 model's are).
  const int64_t rows = std::max<int64_t>(1, kPanelBytes / (K * x.element_size()));
  at::Tensor panel = at::empty({std::min(rows, N), K}, x.options());
  with_format(fmt, K, [&](auto dec, const Layout& L) {
    for (int64_t n0 = 0; n0 < N; n0 += rows) {
      const int64_t n1 = std::min(N, n0 + rows);
      at::Tensor p = panel.narrow(0, 0, n1 - n0);
      decode_all<decltype(dec)>(data.data_ptr<uint8_t>(), L, K, n0, n1, p);
      y.narrow(1, n0, n1 - n0).copy_(at::linear(x, p));
    }
  });
  if (bias.has_value()) y.add_(bias->to(x.scalar_type()));
  return y;
}

#if defined(__AVX512F__) && defined(__AVX512BW__)
// qlinear_lora's arguments checked (see there); returns the slot's rank
static int64_t lora_rank_of(const at::Tensor& x, int64_t K, int64_t N, const at::Tensor& lora_a, const at::Tensor& lora_b,
                            const at::Tensor& slot_ranks, int64_t slot, const std::vector<int64_t>& out_slices) {
  const int64_t S = static_cast<int64_t>(out_slices.size());
  TORCH_CHECK(x.dim() == 2 && x.size(0) == 1 && x.size(1) == K && x.device().is_cpu() &&
              (x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16),
              "qlinear_lora: x must be one fp32 or bf16 row [1, ", K, "] on the CPU");
  TORCH_CHECK(lora_a.dim() == 3 && lora_b.dim() == 3 && lora_a.is_contiguous() && lora_a.size(2) == K && S > 0 &&
              lora_a.size(1) % S == 0 && lora_b.size(0) == lora_a.size(0) && lora_b.size(1) == N &&
              lora_b.size(2) == lora_a.size(1) / S, "qlinear_lora: lora_a must be [L, S * RK, K], lora_b [L, N, RK]");
  const int64_t L = lora_a.size(0), RK = lora_b.size(2);
  TORCH_CHECK(lora_b.stride(0) == N * RK && lora_b.stride(1) == 1 && (RK == 1 || lora_b.stride(2) == N),
              "qlinear_lora: lora_b must be rank-major (lora_b.transpose(1, 2) contiguous)");
  const auto wt = lora_a.scalar_type();
  TORCH_CHECK(wt == lora_b.scalar_type() && (wt == at::kBFloat16 || (wt == at::kFloat && x.scalar_type() == at::kFloat)),
              "qlinear_lora: lora_a and lora_b both bf16, or both fp32 under fp32 x");
  TORCH_CHECK(slot_ranks.scalar_type() == at::kLong && slot_ranks.dim() == 1 && slot_ranks.size(0) == L &&
              slot_ranks.is_contiguous() && slot >= 0 && slot < L, "qlinear_lora: slot_ranks [L] int64, slot in [0, L)");
  const int64_t rank = slot_ranks.data_ptr<int64_t>()[slot];
  TORCH_CHECK(rank >= 0 && rank <= RK, "qlinear_lora: the slot's rank ", rank, " is not in [0, ", RK, "]");
  int64_t total = 0;
  for (int64_t size : out_slices) total += size;
  TORCH_CHECK(total == N, "qlinear_lora: out_slices must sum to ", N);
  return rank;
}

template <typename Wt>
static SlotLoRA<Wt> slot_lora(const at::Tensor& lora_a, const at::Tensor& lora_b, int64_t slot, int64_t rank,
                              const std::vector<int64_t>& slices) {
  const int64_t N = lora_b.size(1), RK = lora_b.size(2);
  return {reinterpret_cast<const Wt*>(lora_a.data_ptr()) + slot * lora_a.size(1) * lora_a.size(2),
          reinterpret_cast<const Wt*>(lora_b.data_ptr()) + slot * N * RK, RK, rank, &slices};
}
#endif

// y [1, N] = x W^T (+ bias) + the LoRA of adapter slot `slot` (see fused_lora): x one fp32 or bf16 row; lora_a
// [L, S * RK, K] and lora_b [L, N, RK] rank-major (LoRALinear's slot buffers), both bf16, or both fp32 under fp32 x;
// slot_ranks [L] int64 (the slot's real rank: A rows k * RK + [0, rank), B rank rows [0, rank)); out_slices: S output
// sizes summing to N. The base rows are qlinear's for one row (bf16 x on K-quants: bf16_rows; else fused_rows).
at::Tensor qlinear_lora(const at::Tensor& x, const at::Tensor& data, const std::string& fmt, int64_t K,
                        const c10::optional<at::Tensor>& bias, const at::Tensor& lora_a, const at::Tensor& lora_b,
                        const at::Tensor& slot_ranks, int64_t slot, const std::vector<int64_t>& out_slices) {
#if defined(__AVX512F__) && defined(__AVX512BW__)
  check_args(data, fmt, K);
  const int64_t N = data.size(0), rank = lora_rank_of(x, K, N, lora_a, lora_b, slot_ranks, slot, out_slices);
  if (rank == 0) return qlinear(x, data, fmt, K, bias);
  at::Tensor y = at::empty({1, N}, x.options());
  const at::Tensor bias_f = bias.has_value() ? bias->to(at::kFloat).contiguous() : at::Tensor(), xc = x.contiguous();
  const Out out = out_for(y, bias_f);
  static thread_local std::vector<float> buf;
  const float* xf = x_as_f32(xc, buf);
  with_format(fmt, K, [&](auto dec, const Layout& Lw) {
    using Dec = decltype(dec);
    const uint8_t* w = data.data_ptr<uint8_t>();
    auto run = [&](const auto& rows) {
      if (lora_a.scalar_type() == at::kFloat) fused_lora(xf, N, K, out, slot_lora<float>(lora_a, lora_b, slot, rank, out_slices), rows);
      else fused_lora(xf, N, K, out, slot_lora<bf16raw>(lora_a, lora_b, slot, rank, out_slices), rows);
    };
#if defined(__AVX512BF16__)
    if constexpr (kBf16Dot<Dec>) {
      if (xc.scalar_type() == at::kBFloat16 || f32_by_parts<Dec>()) {
        static thread_local std::vector<uint16_t> parts;
        const DotX xd = dot_x_of<Dec>(xc, K, parts);
        return run([&](int64_t n0, int64_t n1, const auto& hook) { bf16_rows<Dec>(xd, w, Lw, K, n0, n1, out, hook); });
      }
    }
#endif
    run([&](int64_t n0, int64_t n1, const auto& hook) { fused_rows<Dec, 1>(xf, 1, K, w, Lw, n0, n1, out, hook); });
  });
  return y;
#else
  TORCH_CHECK(false, "qlinear_lora needs AVX-512 (see has_lora)");
#endif
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("qlinear", &qlinear, "x @ W^T (+ bias), W quantized (fmt)", py::arg("x"), py::arg("data"), py::arg("fmt"),
        py::arg("in_features"), py::arg("bias"), py::call_guard<py::gil_scoped_release>());
  m.def("bf16_rows_round_weights", [] { return bf16_on_amx() || bf16_dot_fast(); },
        "whether bf16 x of 9-512 rows (on AMD from 5) multiplies the weights rounded to bf16 (AMX, or vdpbf16ps outer "
        "products) rather than the exact weights (fp32 outer products)");
  m.def("qlinear_lora", &qlinear_lora, "x @ W^T (+ bias) + one adapter slot's LoRA, for one row of x", py::arg("x"),
        py::arg("data"), py::arg("fmt"), py::arg("in_features"), py::arg("bias"), py::arg("lora_a"), py::arg("lora_b"),
        py::arg("slot_ranks"), py::arg("slot"), py::arg("out_slices"), py::call_guard<py::gil_scoped_release>());
  m.def("has_lora", [] {
#if defined(__AVX512F__) && defined(__AVX512BW__)
    return true;
#else
    return false;
#endif
  }, "whether qlinear_lora is built (AVX-512)");
  m.def("dequantize", &dequantize, "W [N, K] decoded", py::arg("data"), py::arg("fmt"), py::arg("in_features"),
        py::arg("dtype"), py::call_guard<py::gil_scoped_release>());
}
