// AVX-512 helpers shared by the CPU kernels (fp32 and bf16 = raw uint16 storage, fp32 math).
// Part of every kernel's build hash (ops/cpu_extension.py), so a change here rebuilds them.
#pragma once
#include <immintrin.h>
#include <cstdint>
#include <type_traits>

using bf16raw = uint16_t;

static inline __mmask16 mask16(int64_t n) { return n >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << n) - 1u); }
static inline __mmask32 mask32(int64_t n) { return n >= 32 ? (__mmask32)0xFFFFFFFFu : (__mmask32)((1u << n) - 1u); }

// 16 lanes (masked) widened to fp32, and stored back (bf16: round-to-nearest-even)
static inline __m512 load16(const float* p, __mmask16 m) { return _mm512_maskz_loadu_ps(m, p); }
static inline __m512 load16(const bf16raw* p, __mmask16 m) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m, p)), 16));
}
static inline void store16(float* p, __m512 v, __mmask16 m) { _mm512_mask_storeu_ps(p, m, v); }
static inline void store16(bf16raw* p, __m512 v, __mmask16 m) {
  _mm256_mask_storeu_epi16(p, m, (__m256i)_mm512_cvtneps_pbh(v));
}
// v rounded to the storage type's precision and widened again (identity for fp32): where a reference
// computes in that dtype step by step, the kernel rounds at the same steps
static inline __m512 round_as(__m512 v, const float*) { return v; }
static inline __m512 round_as(__m512 v, const bf16raw*) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(v)), 16));
}

// exp(x), Cephes expf polynomial, ~1-2 ulp; exp(-inf) = 0, large x -> inf.
static inline __m512 exp512(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-104.0f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.9875691500E-4f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507E-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073E-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894E-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459E-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201E-1f));
  p = _mm512_fmadd_ps(_mm512_mul_ps(p, r), r, _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
  return _mm512_scalef_ps(p, n);
}

// out[n] = silu(gate) * up for rows n0..n1-1 of x (row n: gate x[n*xs : +d], then up), HF's rounding
// (silu rounded to T before the product): the SiLU-and-mul op's and the MoE experts' between their GEMMs.
template <typename T>
static inline void silu_and_mul_rows(const T* x, int64_t xs, T* out, int64_t n0, int64_t n1, int64_t d) {
  const __m512 one = _mm512_set1_ps(1.0f);
  for (int64_t n = n0; n < n1; ++n) {
    const T* gate = x + n * xs;
    const T* up = gate + d;
    for (int64_t i = 0; i < d; i += 16) {
      const __mmask16 m = mask16(d - i);
      const __m512 g = load16(gate + i, m);
      const __m512 silu = round_as(_mm512_div_ps(g, _mm512_add_ps(one, exp512(_mm512_sub_ps(_mm512_setzero_ps(), g)))), gate);
      store16(out + n * d + i, _mm512_mul_ps(silu, load16(up + i, m)), m);
    }
  }
}

// An I x J tile of dot products along a shared axis of length n, both kernels' inner loop (attention
// scores: query heads x keys; LoRA shrink: tokens x rank rows):
//   acc[i][j] += a[i][d : d+W] * b[j][d : d+W]   lane-wise for d = 0, W, 2W, ... < n; fp32: FMA, W = 16;
//   bf16: vdpbf16ps over pairs, W = 32. Full steps load unmasked; the tail's lanes past n load as zero.
//   The J b-rows of a step stay in registers while the I a-rows stream through.
template <bool kTail>
static inline __m512 load_lanes(const float* p, __mmask16 m) { return kTail ? _mm512_maskz_loadu_ps(m, p) : _mm512_loadu_ps(p); }
template <bool kTail>
static inline __m512bh load_lanes(const bf16raw* p, __mmask32 m) {
  return (__m512bh)(kTail ? _mm512_maskz_loadu_epi16(m, p) : _mm512_loadu_si512((const void*)p));
}
static inline __m512 dot_acc(__m512 acc, __m512 a, __m512 b) { return _mm512_fmadd_ps(a, b, acc); }
static inline __m512 dot_acc(__m512 acc, __m512bh a, __m512bh b) { return _mm512_dpbf16_ps(acc, a, b); }

template <bool kTail, typename T, typename M, int I, int J>
static inline void dot_tile_step(const T* const* a, const T* const* b, int64_t d, M m, __m512 (&acc)[I][J]) {
  decltype(load_lanes<kTail>(b[0], m)) bv[J];
  for (int j = 0; j < J; ++j) bv[j] = load_lanes<kTail>(b[j] + d, m);
  for (int i = 0; i < I; ++i) {
    const auto av = load_lanes<kTail>(a[i] + d, m);
    for (int j = 0; j < J; ++j) acc[i][j] = dot_acc(acc[i][j], av, bv[j]);
  }
}

template <typename T, int I, int J>
static inline void dot_tile(const T* const* a, const T* const* b, int64_t n, __m512 (&acc)[I][J]) {
  constexpr bool kF32 = std::is_same<T, float>::value;
  using Mask = std::conditional_t<kF32, __mmask16, __mmask32>;
  constexpr int64_t W = kF32 ? 16 : 32;
  int64_t d = 0;
  for (; d + W <= n; d += W) dot_tile_step<false>(a, b, d, (Mask)~0u, acc);
  if (d < n) dot_tile_step<true>(a, b, d, (Mask)(kF32 ? mask16(n - d) : mask32(n - d)), acc);
}

// The same tile with fp32 a-rows against bf16 b-rows widened exactly (a LoRA's bf16 A under fp32 activations),
// 16 lanes a step, the tail masked: acc[i][j] += a[i][d : d+16] * b[j][d : d+16]
template <int I, int J>
static inline void dot_tile(const float* const* a, const bf16raw* const* b, int64_t n, __m512 (&acc)[I][J]) {
  for (int64_t d = 0; d < n; d += 16) {
    const __mmask16 m = mask16(n - d);
    __m512 bv[J];
    for (int j = 0; j < J; ++j) bv[j] = load16(b[j] + d, m);
    for (int i = 0; i < I; ++i) {
      const __m512 av = load16(a[i] + d, m);
      for (int j = 0; j < J; ++j) acc[i][j] = _mm512_fmadd_ps(av, bv[j], acc[i][j]);
    }
  }
}

// One row of a LoRA's expand, both LoRA kernels' batch-1 case: y[0:16) += sum_r h[r] * bt[r * ld + 0:16) over
// lanes m (bt: rank-major B at the block, fp32 or bf16 widened; y fp32, or bf16 rounded once). The rank sum runs
// in four partial sums (r mod 4): independent FMA chains instead of one rank-long chain of FMA latencies.
template <typename W, typename Y>
static inline void expand_row16(const W* bt, int64_t ld, int64_t rank, const float* h, Y* y, __mmask16 m) {
  __m512 acc[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps()};
  for (int64_t r = 0; r < rank; ++r) acc[r % 4] = _mm512_fmadd_ps(_mm512_set1_ps(h[r]), load16(bt + r * ld, m), acc[r % 4]);
  const __m512 sum = _mm512_add_ps(_mm512_add_ps(acc[0], acc[1]), _mm512_add_ps(acc[2], acc[3]));
  store16(y, _mm512_add_ps(load16(y, m), sum), m);
}

// r[n][k] -> r[k][n] for 16 x 16 dwords: at lane distances 8, 4, 2, 1, rows i and i + d swap the off-diagonal
// d x d blocks of each 2d x 2d block (lane j of row i takes row i + d's lane j - d where j & d, and so on)
template <int D>
struct SwapIndex {  // lane j: j & D ? 16 + j - D (row i + D's lane j - D) : j
  alignas(64) int32_t v[16] = {};
  constexpr SwapIndex() { for (int j = 0; j < 16; ++j) v[j] = (j & D) ? 16 + j - D : j; }
};
template <int D>
static inline void swap_blocks(__m512i (&r)[16]) {
  static constexpr SwapIndex<D> lo{};
  const __m512i il = _mm512_load_si512(lo.v);
  const __m512i ih = _mm512_add_epi32(il, _mm512_set1_epi32(D));  // lane j: j & D ? 16 + j : j + D
  for (int i = 0; i < 16; ++i) {
    if (i & D) continue;
    const __m512i a = r[i], b = r[i + D];
    r[i] = _mm512_permutex2var_epi32(a, il, b);
    r[i + D] = _mm512_permutex2var_epi32(a, ih, b);
  }
}
static inline void transpose16(__m512i (&r)[16]) {
  swap_blocks<8>(r);
  swap_blocks<4>(r);
  swap_blocks<2>(r);
  swap_blocks<1>(r);
}
