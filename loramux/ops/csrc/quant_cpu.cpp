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
// values gguf-py's dequantize gives; nf4 / fp4: w = code[q] * absmax, as bitsandbytes dequantizes); x is
// widened to fp32 and the sums are fp32, so the result is the reference's (dequantize to fp32, then matmul) up
// to the order of the sums.
// Few rows (decode, M <= kFusedRows): each weight row is decoded once and dotted with every row of x while
// its 32 weights sit in registers: the weights stream from memory once per call, the cost at batch 1.
// Up to kOuterRows: 32 rows of W decoded once, turned k-major, and multiplied by x as outer products (outer).
// More rows (prefill): panels of W are decoded into a buffer and multiplied by torch's GEMM (oneDNN).
// bf16 x, where the CPU has the instructions: one row of x against q4_k / q6_k sums bf16 x times the blocks'
// integers by vdpbf16ps (bf16_single); 2-32 rows run on AMX tiles, the weights decoded to bf16 (amx); without
// AMX, on cores whose vdpbf16ps runs at the FMA rate (AMD Zen 4/5), 5-512 rows by outer products of pairs of
// bf16 weights (outer on bf16 x: k_pairs, outer_tile_bf16).
// Written as plain loops over 32 lanes that the compiler vectorizes (-march=native: AVX2 or AVX-512).
// The formats' decoders are in quant_formats.h, the fused LoRA call in quant_lora.h, the AMX path in
// quant_amx.h; this file holds the matmul strategies and the entry points.
#include "torch_api.h"
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
#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512F__)
#include "amx.h"  // outside the anonymous namespace: it includes system headers
#endif

namespace {

constexpr int64_t kFusedRows = 8;   // up to this many x rows: the fused decode-and-dot path
constexpr int64_t kOuterRows = 512;  // past kFusedRows up to this many (fp32 x, or bf16 x off AMX): outer products
constexpr int64_t kAmxRows = 32;    // bf16 x on AMX, 2 up to this many rows (two B tiles of 16 rows of x)
constexpr int64_t kAmxWideRows = 96;  // bf16 x on AMX, more than kAmxRows rows: W decoded once per 32 rows
constexpr int64_t kPanelBytes = 4 << 20;  // GEMM path: W decoded this many bytes of rows at a time

// parallel_for's grain over n items: about four chunks a thread, so a slow chunk does not hold up the call
static inline int64_t grain_of(int64_t n) { return std::max<int64_t>(1, n / (4 * at::get_num_threads())); }

#include "quant_formats.h"  // the formats' decoders, Layout, Out

// ---- the fused path: rows [n0, n1) of W against M <= kFusedRows rows of x (fp32) -------------------------
// A thread reads its rows as one stream; the hardware prefetchers alone leave it latency-bound, so each row
// asks for the row kPrefetchBytes ahead, into L2 (16-64 KB ahead stream about as fast; into L1 is slower).
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
// path writes W out as a panel that oneDNN reorders at every call (a step at 9 rows cost twice one at 8).
// Here a thread takes 32 rows of W at a time, decodes them once (the fused path's
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

#include "quant_lora.h"  // one row of x and one adapter's LoRA in one call (fused_lora)

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

#include "quant_amx.h"  // bf16 x on AMX tiles (amx)

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
// vdpbf16ps rather than decoding the weights to fp32: q6_k on AMD's cores, where that streams faster; q4_k's
// fp32 decode is cheaper than three dot products per run there
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
  // outer on pairs from 5 rows: the fused path runs 5-8 rows as 8, twice the work of outer's pairs there; at
  // 2-4 rows the panel's decode and transposes cost more than the fused dots save
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
