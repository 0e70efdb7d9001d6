// Multi-LoRA "add_lora" CPU kernel (fp32 / bf16), AVX-512 (+AVX512_BF16), OpenMP.
//
//   add_lora(y, x, lora_a, lora_b, token_slots, out_slices=[], slot_ranks=None)
//     in-place, returns None
//     x [N,in], y [N,out] (row stride may differ from width; unit column stride)
//     lora_a [L,K*r,in], lora_b [L,out,r] contiguous, token_slots [N] int64 in [-1,L)
//     K = len(out_slices) (1 if empty); output rows of slice k use the shrunk rows [k*r, (k+1)*r):
//     y[t, rows_k] += lora_b[s, rows_k] @ (lora_a[s, k*r:(k+1)*r] @ x[t])   for s = token_slots[t] >= 0
//     slot_ranks: optional int64 [L], real rank r_s <= r of each slot (zero-padded adapters): only A rows
//     [k*r, k*r + r_s) and B columns [0, r_s) are read; slots of rank 0 are skipped.
//
// Algorithm
//   0. counting sort of token indices by slot -> groups (slot, list of tokens). Works for
//      sorted and unsorted slots; -1 tokens (and rank-0 slots) are dropped.
//   1. shrink: h[p, r] = A[s, r, :] . x[tok(p), :]   (fp32 scratch h [M, R])
//      tile = up to 4 tokens x 4 rank-rows, vectorized along `in`; only the slot's real rank rows
//      (bf16: vdpbf16ps, 32 bf16 pairs per instruction, fp32 accumulate)
//   2. expand, per 16-row block of `out` (within one slice) and group:
//      small groups (<= 6 tokens fp32, 1 token bf16): dot-product form, B rows as they lie
//      (contiguous in rank) times h, 16 row sums by a shuffle/add tree -- no transpose;
//      else the 16 x r_s block of B[s] (row-major [out,r]) is converted to fp32 and transposed in
//      registers into an L1 scratch bt[r][16]; then for tiles of up to 8 tokens:
//      acc[t] += bcast(h[t, r]) * bt[r]; y[t, o0:o0+16] += acc[t]  (bf16: RNE rounding)
//   Memory: decode reads every active slot's A and B from DRAM once per call; both passes walk them
//   slot by slot in address order and software-prefetch one work item ahead (measured: 8 adapters x
//   30 layers, 2 threads, fp32 8.8 -> 7.1 ms, bf16 6.1 -> 4.5 ms).
//   Threads: one OpenMP region (uses the libgomp already loaded by torch, same soname),
//   num_threads = at::get_num_threads(); shrink split over (group, rank-chunk) items,
//   expand split over output-row blocks (balanced regardless of group sizes).
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <omp.h>
#include <cstdint>
#include <vector>
#include <algorithm>
#include <type_traits>

namespace {

using bf16raw = uint16_t;

// ---------------------------------------------------------------- load / store helpers
static inline __m512 load16(const float* p, __mmask16 m) { return _mm512_maskz_loadu_ps(m, p); }
static inline __m512 load16(const bf16raw* p, __mmask16 m) {
  __m256i v = _mm256_maskz_loadu_epi16(m, p);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(v), 16));
}
static inline void store16(float* p, __m512 v, __mmask16 m) { _mm512_mask_storeu_ps(p, m, v); }
static inline void store16(bf16raw* p, __m512 v, __mmask16 m) {
  __m256bh b = _mm512_cvtneps_pbh(v);  // round-to-nearest-even
  _mm256_mask_storeu_epi16(p, m, (__m256i)b);
}
static inline __mmask16 mask16(int64_t n) { return n >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << n) - 1u); }
static inline __mmask32 mask32(int64_t n) { return n >= 32 ? (__mmask32)0xFFFFFFFFu : (__mmask32)((1u << n) - 1u); }

// ---------------------------------------------------------------- 16x16 fp32 transpose
static inline void transpose16(__m512 r[16]) {
  __m512 t[16];
  for (int i = 0; i < 8; ++i) {
    t[2 * i] = _mm512_unpacklo_ps(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm512_unpackhi_ps(r[2 * i], r[2 * i + 1]);
  }
  __m512 u[16];
  for (int i = 0; i < 4; ++i) {
    __m512d a = _mm512_castps_pd(t[4 * i]), b = _mm512_castps_pd(t[4 * i + 2]);
    __m512d c = _mm512_castps_pd(t[4 * i + 1]), d = _mm512_castps_pd(t[4 * i + 3]);
    u[4 * i + 0] = _mm512_castpd_ps(_mm512_unpacklo_pd(a, b));
    u[4 * i + 1] = _mm512_castpd_ps(_mm512_unpackhi_pd(a, b));
    u[4 * i + 2] = _mm512_castpd_ps(_mm512_unpacklo_pd(c, d));
    u[4 * i + 3] = _mm512_castpd_ps(_mm512_unpackhi_pd(c, d));
  }
  // u[4i+j] lane k = column 4k+j, rows 4i..4i+3
  for (int j = 0; j < 4; ++j) {
    __m512 v0 = _mm512_shuffle_f32x4(u[j], u[4 + j], 0x44);
    __m512 v1 = _mm512_shuffle_f32x4(u[j], u[4 + j], 0xEE);
    __m512 w0 = _mm512_shuffle_f32x4(u[8 + j], u[12 + j], 0x44);
    __m512 w1 = _mm512_shuffle_f32x4(u[8 + j], u[12 + j], 0xEE);
    r[0 + j] = _mm512_shuffle_f32x4(v0, w0, 0x88);
    r[4 + j] = _mm512_shuffle_f32x4(v0, w0, 0xDD);
    r[8 + j] = _mm512_shuffle_f32x4(v1, w1, 0x88);
    r[12 + j] = _mm512_shuffle_f32x4(v1, w1, 0xDD);
  }
}

// ---------------------------------------------------------------- shrink tiles
// h[t][j] = dot(A row (r0+j), x row t)   for TT tokens, RT rank rows
template <int TT, int RT>
static inline void shrink_tile(const float* const* xp, const float* ap, int64_t in, float* const* hp) {
  __m512 acc[TT][RT];
  for (int t = 0; t < TT; ++t)
    for (int j = 0; j < RT; ++j) acc[t][j] = _mm512_setzero_ps();
  int64_t k = 0;
  for (; k + 16 <= in; k += 16) {
    __m512 av[RT];
    for (int j = 0; j < RT; ++j) av[j] = _mm512_loadu_ps(ap + j * in + k);
    for (int t = 0; t < TT; ++t) {
      __m512 xv = _mm512_loadu_ps(xp[t] + k);
      for (int j = 0; j < RT; ++j) acc[t][j] = _mm512_fmadd_ps(xv, av[j], acc[t][j]);
    }
  }
  if (k < in) {
    __mmask16 m = mask16(in - k);
    __m512 av[RT];
    for (int j = 0; j < RT; ++j) av[j] = _mm512_maskz_loadu_ps(m, ap + j * in + k);
    for (int t = 0; t < TT; ++t) {
      __m512 xv = _mm512_maskz_loadu_ps(m, xp[t] + k);
      for (int j = 0; j < RT; ++j) acc[t][j] = _mm512_fmadd_ps(xv, av[j], acc[t][j]);
    }
  }
  for (int t = 0; t < TT; ++t)
    for (int j = 0; j < RT; ++j) hp[t][j] = _mm512_reduce_add_ps(acc[t][j]);
}

template <int TT, int RT>
static inline void shrink_tile(const bf16raw* const* xp, const bf16raw* ap, int64_t in, float* const* hp) {
  __m512 acc[TT][RT];
  for (int t = 0; t < TT; ++t)
    for (int j = 0; j < RT; ++j) acc[t][j] = _mm512_setzero_ps();
  int64_t k = 0;
  for (; k < in; k += 32) {
    __mmask32 m = mask32(in - k);
    __m512bh av[RT];
    for (int j = 0; j < RT; ++j) av[j] = (__m512bh)_mm512_maskz_loadu_epi16(m, ap + j * in + k);
    for (int t = 0; t < TT; ++t) {
      __m512bh xv = (__m512bh)_mm512_maskz_loadu_epi16(m, xp[t] + k);
      for (int j = 0; j < RT; ++j) acc[t][j] = _mm512_dpbf16_ps(acc[t][j], xv, av[j]);
    }
  }
  for (int t = 0; t < TT; ++t)
    for (int j = 0; j < RT; ++j) hp[t][j] = _mm512_reduce_add_ps(acc[t][j]);
}

template <typename T, int TT>
static inline void shrink_rt(int rt, const T* const* xp, const T* ap, int64_t in, float* const* hp) {
  switch (rt) {
    case 4: shrink_tile<TT, 4>(xp, ap, in, hp); break;
    case 3: shrink_tile<TT, 3>(xp, ap, in, hp); break;
    case 2: shrink_tile<TT, 2>(xp, ap, in, hp); break;
    default: shrink_tile<TT, 1>(xp, ap, in, hp); break;
  }
}
template <typename T>
static inline void shrink_dispatch(int tt, int rt, const T* const* xp, const T* ap, int64_t in, float* const* hp) {
  switch (tt) {
    case 4: shrink_rt<T, 4>(rt, xp, ap, in, hp); break;
    case 3: shrink_rt<T, 3>(rt, xp, ap, in, hp); break;
    case 2: shrink_rt<T, 2>(rt, xp, ap, in, hp); break;
    default: shrink_rt<T, 1>(rt, xp, ap, in, hp); break;
  }
}

// ---------------------------------------------------------------- expand
// bt[r*16 + i] = B[o0 + i, r]  (fp32), rows i >= nrows are zero
template <typename T>
static inline void transpose_block(const T* b, int64_t ld, int64_t rw, int64_t nrows, float* bt) {
  for (int64_t c0 = 0; c0 < rw; c0 += 16) {
    __mmask16 cm = mask16(rw - c0);
    __m512 r[16];
    for (int i = 0; i < 16; ++i) r[i] = (i < nrows) ? load16(b + i * ld + c0, cm) : _mm512_setzero_ps();
    transpose16(r);
    int64_t nc = std::min<int64_t>(16, rw - c0);
    for (int j = 0; j < nc; ++j) _mm512_store_ps(bt + (c0 + j) * 16, r[j]);
  }
}

template <typename T, typename W, int TJ>
static inline void expand_tile(const W* bt, int64_t ld, int64_t R, const float* const* hp, T* const* yp, __mmask16 om) {
  __m512 acc[TJ];
  for (int j = 0; j < TJ; ++j) acc[j] = _mm512_setzero_ps();
  for (int64_t r = 0; r < R; ++r) {
    __m512 b = load16(bt + r * ld, om);
    for (int j = 0; j < TJ; ++j) acc[j] = _mm512_fmadd_ps(_mm512_set1_ps(hp[j][r]), b, acc[j]);
  }
  for (int j = 0; j < TJ; ++j) {
    __m512 yv = load16(yp[j], om);
    store16(yp[j], _mm512_add_ps(yv, acc[j]), om);
  }
}
template <typename T, typename W>
static inline void expand_dispatch(int tj, const W* bt, int64_t ld, int64_t R, const float* const* hp, T* const* yp, __mmask16 om) {
  switch (tj) {
    case 8: expand_tile<T, W, 8>(bt, ld, R, hp, yp, om); break;
    case 7: expand_tile<T, W, 7>(bt, ld, R, hp, yp, om); break;
    case 6: expand_tile<T, W, 6>(bt, ld, R, hp, yp, om); break;
    case 5: expand_tile<T, W, 5>(bt, ld, R, hp, yp, om); break;
    case 4: expand_tile<T, W, 4>(bt, ld, R, hp, yp, om); break;
    case 3: expand_tile<T, W, 3>(bt, ld, R, hp, yp, om); break;
    case 2: expand_tile<T, W, 2>(bt, ld, R, hp, yp, om); break;
    default: expand_tile<T, W, 1>(bt, ld, R, hp, yp, om); break;
  }
}


// bf16 path: B stays bf16; pairs of adjacent rank columns form one dword, so a 16-row x 16-col
// bf16 block is a 16 x 8 dword matrix; transpose it to 8 zmm (one per rank pair, 16 rows each)
// and use vdpbf16ps with a broadcast (h[2p], h[2p+1]) bf16 pair.  bt[p*16 + i] = pair p of row i.
static inline void transpose_block_pairs(const bf16raw* b, int64_t ld, int64_t rw, int64_t nrows, uint32_t* bt) {
  for (int64_t c0 = 0; c0 < rw; c0 += 16) {
    const __mmask16 cm = mask16(rw - c0);
    __m512i z[8];
    for (int i = 0; i < 8; ++i) {
      __m256i lo = (i < nrows) ? _mm256_maskz_loadu_epi16(cm, b + i * ld + c0) : _mm256_setzero_si256();
      __m256i hi = (i + 8 < nrows) ? _mm256_maskz_loadu_epi16(cm, b + (i + 8) * ld + c0) : _mm256_setzero_si256();
      z[i] = _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1);
    }
    __m512i t[8], u[8];
    for (int i = 0; i < 4; ++i) {
      t[2 * i] = _mm512_unpacklo_epi32(z[2 * i], z[2 * i + 1]);
      t[2 * i + 1] = _mm512_unpackhi_epi32(z[2 * i], z[2 * i + 1]);
    }
    for (int i = 0; i < 2; ++i) {
      u[4 * i + 0] = _mm512_unpacklo_epi64(t[4 * i], t[4 * i + 2]);
      u[4 * i + 1] = _mm512_unpackhi_epi64(t[4 * i], t[4 * i + 2]);
      u[4 * i + 2] = _mm512_unpacklo_epi64(t[4 * i + 1], t[4 * i + 3]);
      u[4 * i + 3] = _mm512_unpackhi_epi64(t[4 * i + 1], t[4 * i + 3]);
    }
    const int64_t np = std::min<int64_t>(8, (rw - c0 + 1) / 2);
    for (int j = 0; j < 4; ++j) {
      __m512i v0 = _mm512_shuffle_i32x4(u[j], u[4 + j], 0x88);
      __m512i v1 = _mm512_shuffle_i32x4(u[j], u[4 + j], 0xDD);
      v0 = _mm512_shuffle_i32x4(v0, v0, 0xD8);
      v1 = _mm512_shuffle_i32x4(v1, v1, 0xD8);
      if (j < np) _mm512_store_si512((void*)(bt + (c0 / 2 + j) * 16), v0);
      if (4 + j < np) _mm512_store_si512((void*)(bt + (c0 / 2 + 4 + j) * 16), v1);
    }
  }
}

template <int TJ>
static inline void expand_tile_pairs(const uint32_t* bt, int64_t ld, int64_t np, const uint32_t* const* hp,
                                     bf16raw* const* yp, __mmask16 om) {
  __m512 acc[TJ];
  for (int j = 0; j < TJ; ++j) acc[j] = _mm512_setzero_ps();
  for (int64_t p = 0; p < np; ++p) {
    __m512bh b = (__m512bh)_mm512_maskz_loadu_epi32(om, (const void*)(bt + p * ld));
    for (int j = 0; j < TJ; ++j)
      acc[j] = _mm512_dpbf16_ps(acc[j], (__m512bh)_mm512_set1_epi32((int)hp[j][p]), b);
  }
  for (int j = 0; j < TJ; ++j) {
    __m512 yv = load16(yp[j], om);
    store16(yp[j], _mm512_add_ps(yv, acc[j]), om);
  }
}
static inline void expand_dispatch_pairs(int tj, const uint32_t* bt, int64_t ld, int64_t np, const uint32_t* const* hp,
                                         bf16raw* const* yp, __mmask16 om) {
  switch (tj) {
    case 8: expand_tile_pairs<8>(bt, ld, np, hp, yp, om); break;
    case 7: expand_tile_pairs<7>(bt, ld, np, hp, yp, om); break;
    case 6: expand_tile_pairs<6>(bt, ld, np, hp, yp, om); break;
    case 5: expand_tile_pairs<5>(bt, ld, np, hp, yp, om); break;
    case 4: expand_tile_pairs<4>(bt, ld, np, hp, yp, om); break;
    case 3: expand_tile_pairs<3>(bt, ld, np, hp, yp, om); break;
    case 2: expand_tile_pairs<2>(bt, ld, np, hp, yp, om); break;
    default: expand_tile_pairs<1>(bt, ld, np, hp, yp, om); break;
  }
}

// ---------------------------------------------------------------- expand, dot-product form (small groups)
// For a group of 1-2 tokens the per-call transpose of a B block costs more than the FMAs it feeds. Instead
// take B rows as they lie (contiguous in rank): p[i] = B[o0+i, :] * h (lane-wise), then reduce the 16
// vectors to one vector of 16 row sums with a shuffle/add tree (30 shuffles vs. 64 for the transpose).
// Different summation order than the transposed form: equal within fp rounding, not bit for bit.
static inline __m512 reduce16x16(__m512 p[16]) {  // out lane i = sum of all lanes of p[i]
  __m512 q[8], r[4];
  for (int j = 0; j < 8; ++j)  // 128-bit lane L of q[j]: rows 2j, 2j+1 (2 partials each)
    q[j] = _mm512_add_ps(_mm512_unpacklo_ps(p[2 * j], p[2 * j + 1]), _mm512_unpackhi_ps(p[2 * j], p[2 * j + 1]));
  for (int j = 0; j < 4; ++j) {  // 128-bit lane L of r[j]: rows 4j..4j+3, partial over lane L
    __m512d a = _mm512_castps_pd(q[2 * j]), b = _mm512_castps_pd(q[2 * j + 1]);
    r[j] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(a, b)), _mm512_castpd_ps(_mm512_unpackhi_pd(a, b)));
  }
  __m512 s0 = _mm512_add_ps(_mm512_shuffle_f32x4(r[0], r[1], 0x88), _mm512_shuffle_f32x4(r[0], r[1], 0xDD));
  __m512 s1 = _mm512_add_ps(_mm512_shuffle_f32x4(r[2], r[3], 0x88), _mm512_shuffle_f32x4(r[2], r[3], 0xDD));
  // s0 lanes: [r0 (l0+l1), r0 (l2+l3), r1 (..), r1 (..)]
  return _mm512_add_ps(_mm512_shuffle_f32x4(s0, s1, 0x88), _mm512_shuffle_f32x4(s0, s1, 0xDD));
}
// p[j] = [row j (8 lanes) | row j+8 (8 lanes)]  ->  out lane i = row-i sum
static inline __m512 reduce8x2(__m512 p[8]) {
  __m512 q[4], r[2];
  for (int j = 0; j < 4; ++j)
    q[j] = _mm512_add_ps(_mm512_unpacklo_ps(p[2 * j], p[2 * j + 1]), _mm512_unpackhi_ps(p[2 * j], p[2 * j + 1]));
  for (int j = 0; j < 2; ++j) {  // r[j] 128-bit lanes: [rows 4j.. (a), rows 4j.. (b), rows 8+4j.. (a), (b)]
    __m512d a = _mm512_castps_pd(q[2 * j]), b = _mm512_castps_pd(q[2 * j + 1]);
    r[j] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(a, b)), _mm512_castpd_ps(_mm512_unpackhi_pd(a, b)));
  }
  __m512 s = _mm512_add_ps(_mm512_shuffle_f32x4(r[0], r[1], 0x88), _mm512_shuffle_f32x4(r[0], r[1], 0xDD));
  return _mm512_shuffle_f32x4(s, s, 0xD8);  // [0-3, 8-11, 4-7, 12-15] -> [0-3, 4-7, 8-11, 12-15]
}
static inline __m256 load8(const float* p, __mmask8 m) { return _mm256_maskz_loadu_ps(m, p); }

// fp32: y[o0+i] += sum_r b[i*ld + r] * h[r], i < nrows, r < rw
static inline __m512 dot_block(const float* b, int64_t ld, int64_t rw, int64_t nrows, const float* h) {
  if (rw <= 8) {
    const __mmask8 cm = (__mmask8)((1u << rw) - 1u);
    const __m256 h8 = load8(h, cm);
    const __m512 hv = _mm512_insertf32x8(_mm512_castps256_ps512(h8), h8, 1);
    __m512 p[8];
    for (int j = 0; j < 8; ++j) {
      __m256 lo = j < nrows ? load8(b + j * ld, cm) : _mm256_setzero_ps();
      __m256 hi = j + 8 < nrows ? load8(b + (j + 8) * ld, cm) : _mm256_setzero_ps();
      p[j] = _mm512_mul_ps(_mm512_insertf32x8(_mm512_castps256_ps512(lo), hi, 1), hv);
    }
    return reduce8x2(p);
  }
  __m512 p[16];
  for (int i = 0; i < 16; ++i) p[i] = _mm512_setzero_ps();
  for (int64_t c0 = 0; c0 < rw; c0 += 16) {
    const __mmask16 cm = mask16(rw - c0);
    const __m512 hv = _mm512_maskz_loadu_ps(cm, h + c0);
    for (int i = 0; i < 16; ++i)
      if (i < nrows) p[i] = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(cm, b + i * ld + c0), hv, p[i]);
  }
  return reduce16x16(p);
}
// bf16 (pair path): h as bf16 (rounded once, as in the transposed form), vdpbf16ps over rank pairs
static inline __m512 dot_block(const bf16raw* b, int64_t ld, int64_t rw, int64_t nrows, const bf16raw* h) {
  if (rw <= 16) {
    const __mmask16 cm = mask16(rw);
    const __m256i h16 = _mm256_maskz_loadu_epi16(cm, h);
    const __m512bh hv = (__m512bh)_mm512_inserti64x4(_mm512_castsi256_si512(h16), h16, 1);
    __m512 p[8];
    for (int j = 0; j < 8; ++j) {
      __m256i lo = j < nrows ? _mm256_maskz_loadu_epi16(cm, b + j * ld) : _mm256_setzero_si256();
      __m256i hi = j + 8 < nrows ? _mm256_maskz_loadu_epi16(cm, b + (j + 8) * ld) : _mm256_setzero_si256();
      p[j] = _mm512_dpbf16_ps(_mm512_setzero_ps(), (__m512bh)_mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1), hv);
    }
    return reduce8x2(p);
  }
  __m512 p[16];
  for (int i = 0; i < 16; ++i) p[i] = _mm512_setzero_ps();
  for (int64_t c0 = 0; c0 < rw; c0 += 32) {
    const __mmask32 cm = mask32(rw - c0);
    const __m512bh hv = (__m512bh)_mm512_maskz_loadu_epi16(cm, h + c0);
    for (int i = 0; i < 16; ++i)
      if (i < nrows) p[i] = _mm512_dpbf16_ps(p[i], (__m512bh)_mm512_maskz_loadu_epi16(cm, b + i * ld + c0), hv);
  }
  return reduce16x16(p);
}

// one 16-row output block; its rows use the shrunk rows [rlo, rlo + rw) (rlo = slice * r)
struct ExpBlock { int64_t o0, nrows, rlo, rw; };

// groups of up to this many tokens use the dot-product expand (no B transpose); measured on Zen 4,
// 2 threads: fp32 gains up to ~45% at 1-2 tokens/slot and still ~5% at 6 (loses at 8); bf16 (cheaper
// pair transpose, and vdpbf16ps already halves the dot work) gains only at 1 token
#ifndef LORA_DOT_MAX_F32
#define LORA_DOT_MAX_F32 6
#endif
#ifndef LORA_DOT_MAX_BF16
#define LORA_DOT_MAX_BF16 1
#endif

static inline void prefetch_lines(const void* p, int64_t bytes) {
  const char* c = (const char*)p;
  for (int64_t off = 0; off < bytes; off += 64) _mm_prefetch(c + off, _MM_HINT_T0);
}

struct Group { int64_t slot, start, len, rank; };  // rank: real rank per slice (<= R/K), > 0
struct ShrinkItem { int64_t g, r0; int rt; };            // rank rows [r0, r0 + rt) of group g

template <typename T>
static void add_lora_impl(T* y, int64_t ys, const T* x, int64_t xs, const T* A, const T* B,
                          const int64_t* slots, int64_t N, int64_t in, int64_t out, int64_t L, int64_t R,
                          int64_t K, const int64_t* ranks, const std::vector<ExpBlock>& blocks) {
  constexpr bool kBF16 = std::is_same<T, bf16raw>::value;
  const int64_t RK = R / K;  // rank per slice = B's row length
  constexpr int64_t kDotMax = kBF16 ? LORA_DOT_MAX_BF16 : LORA_DOT_MAX_F32;
  // 0. counting sort by slot (stable); slots of rank 0 contribute nothing and are dropped
  std::vector<int64_t> cnt(L + 1, 0);
  for (int64_t t = 0; t < N; ++t) {
    int64_t s = slots[t];
    if (s >= 0) cnt[s + 1]++;
  }
  for (int64_t s = 0; s < L; ++s) cnt[s + 1] += cnt[s];
  const int64_t M = cnt[L];
  if (M == 0 || R == 0) return;
  std::vector<int32_t> order(M);
  {
    std::vector<int64_t> pos(cnt.begin(), cnt.end() - 1);
    for (int64_t t = 0; t < N; ++t) {
      int64_t s = slots[t];
      if (s >= 0) order[pos[s]++] = (int32_t)t;
    }
  }
  std::vector<Group> groups;
  double work = 0.0;
  for (int64_t s = 0; s < L; ++s) {
    const int64_t rk = ranks ? ranks[s] : RK;
    if (cnt[s + 1] > cnt[s] && rk > 0) {
      groups.push_back({s, cnt[s], cnt[s + 1] - cnt[s], rk});
      work += (double)(cnt[s + 1] - cnt[s]) * (double)(rk * K) * (double)(in + out);
    }
  }
  const int64_t G = (int64_t)groups.size();
  if (G == 0) return;
  // shrink work items: group major, then A's rows in memory order (only the real rank rows), so each
  // thread's share of A is a few long sequential streams (decode is bound by reading A and B from DRAM)
  std::vector<ShrinkItem> items;
  for (int64_t g = 0; g < G; ++g)
    for (int64_t k = 0; k < K; ++k)
      for (int64_t c = 0; c < groups[g].rank; c += 4)
        items.push_back({g, k * RK + c, (int)std::min<int64_t>(4, groups[g].rank - c)});
  const int64_t nitems = (int64_t)items.size();
  // bf16 pair path needs every block's rank range to be pair aligned
  bool pairs = kBF16 && RK % 2 == 0;
  for (const auto& b : blocks) pairs = pairs && (b.rlo % 2 == 0) && (b.rw % 2 == 0);
  const int64_t Rp = (R + 1) / 2 * 2;
  // zero-initialized: rank rows a slot skips stay 0 (the odd-rank pair's upper half reads them)
  std::vector<float> h((size_t)M * R);
  std::vector<bf16raw> hb(pairs ? (size_t)M * Rp : 0);
  float* hbuf = h.data();
  bf16raw* hbb = hb.data();

  const int64_t nob = (int64_t)blocks.size();
  int nth = at::get_num_threads();
  if (work < 2.0e5) nth = 1;                 // tiny problems: skip the fork/join
  int64_t rwmax = 0;
  for (const auto& b : blocks) rwmax = std::max(rwmax, b.rw);
  const int64_t R16 = (rwmax + 15) / 16 * 16;

#pragma omp parallel num_threads(nth) if (nth > 1)
  {
    // ---- 1. shrink
#pragma omp for schedule(static)
    for (int64_t it = 0; it < nitems; ++it) {
      const ShrinkItem& si = items[it];
      const Group& gr = groups[si.g];
      const int64_t r0 = si.r0;
      const int rt = si.rt;
      const T* ap = A + (gr.slot * R + r0) * in;
      if (it + 1 < nitems) {  // the next item's A rows (likely this thread's next): fetch them while this one computes
        const ShrinkItem& nx = items[it + 1];
        prefetch_lines(A + (groups[nx.g].slot * R + nx.r0) * in, (int64_t)nx.rt * in * (int64_t)sizeof(T));
      }
      for (int64_t p0 = 0; p0 < gr.len; p0 += 4) {
        const int tt = (int)std::min<int64_t>(4, gr.len - p0);
        const T* xp[4];
        float* hp[4];
        for (int i = 0; i < tt; ++i) {
          const int64_t p = gr.start + p0 + i;
          xp[i] = x + (int64_t)order[p] * xs;
          hp[i] = hbuf + p * R + r0;
        }
        shrink_dispatch<T>(tt, rt, xp, ap, in, hp);
        if (pairs)
          for (int i = 0; i < tt; ++i) {
            const int64_t p = gr.start + p0 + i;
            for (int j = 0; j < rt; ++j) hbb[p * Rp + r0 + j] = c10::BFloat16(hp[i][j]).x;  // RNE
          }
      }
    }
    // (implicit barrier)
    // ---- 2. expand
    alignas(64) float bt_stack[64 * 16];
    std::vector<float> bt_heap;
    float* bt = bt_stack;
    if (R16 > 64) {
      bt_heap.resize((size_t)R16 * 16 + 16);
      bt = (float*)(((uintptr_t)bt_heap.data() + 63) & ~(uintptr_t)63);
    }
    // each thread owns a contiguous range of output blocks and walks it once per group: B[slot]'s rows
    // of that range are one sequential stream
    const int tid = omp_get_thread_num(), nt = omp_get_num_threads();
    const int64_t ob_begin = nob * tid / nt, ob_end = nob * (tid + 1) / nt;
    for (int64_t g = 0; g < G; ++g) {
      const Group& gr = groups[g];
      for (int64_t ob = ob_begin; ob < ob_end; ++ob) {
        const ExpBlock& eb = blocks[ob];
        const __mmask16 om = mask16(eb.nrows);
        const int64_t rw = std::min(eb.rw, gr.rank);  // real rank columns of this block
        const T* bsrc = B + (gr.slot * out + eb.o0) * RK;
        // the next block this thread expands (the next rows of B[slot], or the next group's first block)
        if (ob + 1 < ob_end) prefetch_lines(bsrc + 16 * RK, blocks[ob + 1].nrows * RK * (int64_t)sizeof(T));
        else if (g + 1 < G) prefetch_lines(B + (groups[g + 1].slot * out + blocks[ob_begin].o0) * RK,
                                           blocks[ob_begin].nrows * RK * (int64_t)sizeof(T));
        if (gr.len <= kDotMax && (!kBF16 || pairs)) {  // small group: no transpose
          for (int64_t p = gr.start; p < gr.start + gr.len; ++p) {
            T* yp = y + (int64_t)order[p] * ys + eb.o0;
            __m512 d;
            if constexpr (kBF16) d = dot_block(bsrc, RK, rw, eb.nrows, hbb + p * Rp + eb.rlo);
            else d = dot_block(bsrc, RK, rw, eb.nrows, hbuf + p * R + eb.rlo);
            store16(yp, _mm512_add_ps(load16(yp, om), d), om);
          }
          continue;
        }
        if constexpr (kBF16) {
          if (pairs) {
            const int64_t np = (rw + 1) / 2;  // odd rank: last pair's upper half is h = 0 (padding)
            transpose_block_pairs(bsrc, RK, rw, eb.nrows, (uint32_t*)bt);
            for (int64_t p0 = 0; p0 < gr.len; p0 += 8) {
              const int tj = (int)std::min<int64_t>(8, gr.len - p0);
              const uint32_t* hp[8];
              T* yp[8];
              for (int i = 0; i < tj; ++i) {
                const int64_t p = gr.start + p0 + i;
                hp[i] = (const uint32_t*)(hbb + p * Rp + eb.rlo);
                yp[i] = y + (int64_t)order[p] * ys + eb.o0;
              }
              expand_dispatch_pairs(tj, (const uint32_t*)bt, 16, np, hp, yp, om);
            }
            continue;
          }
        }
        transpose_block<T>(bsrc, RK, rw, eb.nrows, bt);
        for (int64_t p0 = 0; p0 < gr.len; p0 += 8) {
          const int tj = (int)std::min<int64_t>(8, gr.len - p0);
          const float* hp[8];
          T* yp[8];
          for (int i = 0; i < tj; ++i) {
            const int64_t p = gr.start + p0 + i;
            hp[i] = hbuf + p * R + eb.rlo;
            yp[i] = y + (int64_t)order[p] * ys + eb.o0;
          }
          expand_dispatch<T, float>(tj, bt, 16, rw, hp, yp, om);
        }
      }
    }
  }
}

}  // namespace

// out_slices: optional sizes of output slices (packed projections, e.g. qkv = [576, 192, 192]): slice k's
// output rows use shrunk rows [k*R/K, (k+1)*R/K). Empty list = one slice.
void add_lora(torch::Tensor y, torch::Tensor x, torch::Tensor lora_a, torch::Tensor lora_b,
              torch::Tensor token_slots, std::vector<int64_t> out_slices = {},
              c10::optional<torch::Tensor> slot_ranks = c10::nullopt) {
  TORCH_CHECK(x.dim() == 2 && y.dim() == 2 && lora_a.dim() == 3 && lora_b.dim() == 3 && token_slots.dim() == 1,
              "add_lora: bad ranks");
  TORCH_CHECK(x.device().is_cpu() && y.device().is_cpu(), "add_lora: CPU only");
  const auto dt = x.scalar_type();
  TORCH_CHECK(dt == y.scalar_type() && dt == lora_a.scalar_type() && dt == lora_b.scalar_type(),
              "add_lora: dtype mismatch");
  TORCH_CHECK(dt == at::kFloat || dt == at::kBFloat16, "add_lora: fp32 or bf16 only");
  TORCH_CHECK(token_slots.scalar_type() == at::kLong && token_slots.is_contiguous(), "add_lora: slots int64 contiguous");
  const int64_t N = x.size(0), in = x.size(1), out = y.size(1);
  const int64_t L = lora_a.size(0), R = lora_a.size(1);
  TORCH_CHECK(y.size(0) == N && token_slots.size(0) == N, "add_lora: N mismatch");
  TORCH_CHECK(lora_a.size(2) == in && lora_b.size(0) == L, "add_lora: weight shape mismatch");
  TORCH_CHECK(lora_a.is_contiguous() && lora_b.is_contiguous(), "add_lora: weights must be contiguous");
  TORCH_CHECK(x.stride(1) == 1 && y.stride(1) == 1, "add_lora: x/y need unit column stride");
  if (N == 0) return;
  const int64_t* sl = token_slots.data_ptr<int64_t>();
  for (int64_t t = 0; t < N; ++t) TORCH_CHECK(sl[t] >= -1 && sl[t] < L, "add_lora: slot out of range");
  if (out_slices.empty()) out_slices.push_back(out);
  const int64_t K = (int64_t)out_slices.size();
  TORCH_CHECK(R % K == 0, "add_lora: lora_a's rows must be divisible by the number of out_slices");
  TORCH_CHECK(lora_b.size(1) == out && lora_b.size(2) == R / K, "add_lora: lora_b must be [L, out, R/K]");
  // slot_ranks: real rank r_s <= R/K of each slot (adapters zero-padded to R/K per slice)
  torch::Tensor ranks_t;
  const int64_t* ranks = nullptr;
  if (slot_ranks.has_value() && slot_ranks->defined() && slot_ranks->numel() > 0) {
    ranks_t = slot_ranks->contiguous();
    TORCH_CHECK(ranks_t.device().is_cpu() && ranks_t.scalar_type() == at::kLong && ranks_t.dim() == 1 &&
                ranks_t.size(0) == L, "add_lora: slot_ranks must be an int64 CPU tensor [L]");
    ranks = ranks_t.data_ptr<int64_t>();
    for (int64_t s = 0; s < L; ++s)
      TORCH_CHECK(ranks[s] >= 0 && ranks[s] <= R / K, "add_lora: slot_ranks[", s, "] = ", ranks[s],
                  " not in [0, R/K = ", R / K, "]");
  }
  std::vector<ExpBlock> blocks;
  int64_t o0 = 0;
  for (int64_t k = 0; k < K; ++k) {
    for (int64_t o = 0; o < out_slices[k]; o += 16)
      blocks.push_back({o0 + o, std::min<int64_t>(16, out_slices[k] - o), k * (R / K), R / K});
    o0 += out_slices[k];
  }
  TORCH_CHECK(o0 == out, "add_lora: out_slices must sum to out");
  if (dt == at::kFloat) {
    add_lora_impl<float>(y.data_ptr<float>(), y.stride(0), x.data_ptr<float>(), x.stride(0),
                         lora_a.data_ptr<float>(), lora_b.data_ptr<float>(), sl, N, in, out, L, R, K, ranks, blocks);
  } else {
    add_lora_impl<bf16raw>((bf16raw*)y.data_ptr<at::BFloat16>(), y.stride(0),
                           (const bf16raw*)x.data_ptr<at::BFloat16>(), x.stride(0),
                           (const bf16raw*)lora_a.data_ptr<at::BFloat16>(),
                           (const bf16raw*)lora_b.data_ptr<at::BFloat16>(), sl, N, in, out, L, R, K, ranks, blocks);
  }
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("add_lora", &add_lora, "y += per-token LoRA (in place)", py::arg("y"), py::arg("x"), py::arg("lora_a"),
        py::arg("lora_b"), py::arg("token_slots"), py::arg("out_slices") = std::vector<int64_t>{},
        py::arg("slot_ranks") = py::none(),
        py::call_guard<py::gil_scoped_release>());
}
