// Multi-LoRA "add_lora" CPU kernel (fp32 / bf16), AVX-512 (+AVX512_BF16), OpenMP.
//
//   add_lora(y, x, lora_a, lora_b, token_slots)      in-place, returns None
//     x [N,in], y [N,out] (row stride may differ from width; unit column stride)
//     lora_a [L,R,in], lora_b [L,out,R] contiguous, token_slots [N] int64 in [-1,L)
//     y[t] += lora_b[s] @ (lora_a[s] @ x[t])   for s = token_slots[t] >= 0
//
// Algorithm
//   0. counting sort of token indices by slot -> groups (slot, list of tokens). Works for
//      sorted and unsorted slots; -1 tokens are dropped.
//   1. shrink: h[p, r] = A[s, r, :] . x[tok(p), :]   (fp32 scratch h [M, R])
//      tile = up to 4 tokens x 4 rank-rows, vectorized along `in`
//      (bf16: vdpbf16ps, 32 bf16 pairs per instruction, fp32 accumulate)
//   2. expand: for each 16-row block of `out` and each group: the 16 x R block of B[s]
//      (row-major [out,R]) is converted to fp32 and transposed in registers into an
//      L1 scratch bt[R][16]; then for tiles of up to 8 tokens:
//      acc[t] += bcast(h[t, r]) * bt[r]; y[t, o0:o0+16] += acc[t]  (bf16: RNE rounding)
//   Threads: one OpenMP region (uses the libgomp already loaded by torch, same soname),
//   num_threads = at::get_num_threads(); shrink split over (rank-chunk, group) items,
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

// one 16-row output block; rows use rank columns [rlo, rlo + rw)  (packed/sliced LoRA: B block-diagonal)
struct ExpBlock { int64_t o0, nrows, rlo, rw; };

struct Group { int64_t slot, start, len; };

template <typename T>
static void add_lora_impl(T* y, int64_t ys, const T* x, int64_t xs, const T* A, const T* B,
                          const int64_t* slots, int64_t N, int64_t in, int64_t out, int64_t L, int64_t R,
                          const std::vector<ExpBlock>& blocks, bool packed) {
  constexpr bool kBF16 = std::is_same<T, bf16raw>::value;
  // 0. counting sort by slot (stable)
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
  for (int64_t s = 0; s < L; ++s)
    if (cnt[s + 1] > cnt[s]) groups.push_back({s, cnt[s], cnt[s + 1] - cnt[s]});
  const int64_t G = (int64_t)groups.size();
  // bf16 pair path needs every block's rank range to be pair aligned
  bool pairs = kBF16 && (packed || R % 2 == 0);
  for (const auto& b : blocks) pairs = pairs && (b.rlo % 2 == 0) && (b.rw % 2 == 0);
  const int64_t Rp = (R + 1) / 2 * 2;
  std::vector<float> h((size_t)M * R);
  std::vector<bf16raw> hb(pairs ? (size_t)M * Rp : 0);
  float* hbuf = h.data();
  bf16raw* hbb = hb.data();

  const int64_t nrc = (R + 3) / 4;           // rank chunks of 4
  const int64_t nob = (int64_t)blocks.size();
  const double work = (double)M * (double)R * (double)(in + out);
  int nth = at::get_num_threads();
  if (work < 2.0e5) nth = 1;                 // tiny problems: skip the fork/join
  int64_t rwmax = 0;
  for (const auto& b : blocks) rwmax = std::max(rwmax, b.rw);
  const int64_t R16 = (rwmax + 15) / 16 * 16;

#pragma omp parallel num_threads(nth) if (nth > 1)
  {
    // ---- 1. shrink
#pragma omp for schedule(static)
    for (int64_t item = 0; item < nrc * G; ++item) {
      const int64_t rc = item / G, g = item % G;
      const Group& gr = groups[g];
      const int64_t r0 = rc * 4;
      const int rt = (int)std::min<int64_t>(4, R - r0);
      const T* ap = A + (gr.slot * R + r0) * in;
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
#pragma omp for schedule(static)
    for (int64_t ob = 0; ob < nob; ++ob) {
      const ExpBlock& eb = blocks[ob];
      const __mmask16 om = mask16(eb.nrows);
      for (int64_t g = 0; g < G; ++g) {
        const Group& gr = groups[g];
        const T* bsrc = B + (gr.slot * out + eb.o0) * R + eb.rlo;
        if constexpr (kBF16) {
          if (pairs) {
            const uint32_t* bt32 = (const uint32_t*)bt;
            int64_t ld = 16;
            if (packed) {  // B packed as [L, R/2, out, 2]
              bt32 = (const uint32_t*)B + (gr.slot * (R / 2) + eb.rlo / 2) * out + eb.o0;
              ld = out;
            } else {
              transpose_block_pairs(bsrc, R, eb.rw, eb.nrows, (uint32_t*)bt);
            }
            for (int64_t p0 = 0; p0 < gr.len; p0 += 8) {
              const int tj = (int)std::min<int64_t>(8, gr.len - p0);
              const uint32_t* hp[8];
              T* yp[8];
              for (int i = 0; i < tj; ++i) {
                const int64_t p = gr.start + p0 + i;
                hp[i] = (const uint32_t*)(hbb + p * Rp + eb.rlo);
                yp[i] = y + (int64_t)order[p] * ys + eb.o0;
              }
              expand_dispatch_pairs(tj, bt32, ld, eb.rw / 2, hp, yp, om);
            }
            continue;
          }
        }
        if (packed) {  // fp32 B packed as [L, R, out]
          const T* bp = B + (gr.slot * R + eb.rlo) * out + eb.o0;
          for (int64_t p0 = 0; p0 < gr.len; p0 += 8) {
            const int tj = (int)std::min<int64_t>(8, gr.len - p0);
            const float* hp[8];
            T* yp[8];
            for (int i = 0; i < tj; ++i) {
              const int64_t p = gr.start + p0 + i;
              hp[i] = hbuf + p * R + eb.rlo;
              yp[i] = y + (int64_t)order[p] * ys + eb.o0;
            }
            expand_dispatch<T, T>(tj, bp, out, eb.rw, hp, yp, om);
          }
          continue;
        }
        transpose_block<T>(bsrc, R, eb.rw, eb.nrows, bt);
        for (int64_t p0 = 0; p0 < gr.len; p0 += 8) {
          const int tj = (int)std::min<int64_t>(8, gr.len - p0);
          const float* hp[8];
          T* yp[8];
          for (int i = 0; i < tj; ++i) {
            const int64_t p = gr.start + p0 + i;
            hp[i] = hbuf + p * R + eb.rlo;
            yp[i] = y + (int64_t)order[p] * ys + eb.o0;
          }
          expand_dispatch<T, float>(tj, bt, 16, eb.rw, hp, yp, om);
        }
      }
    }
  }
}

}  // namespace

// out_slices: optional sizes of output slices (packed projections, e.g. qkv = [576, 192, 192]);
// slice k only uses rank columns [k*R/K, (k+1)*R/K) of B (B block-diagonal), so the zero blocks are
// skipped. Empty list = one dense slice.
void add_lora(torch::Tensor y, torch::Tensor x, torch::Tensor lora_a, torch::Tensor lora_b,
              torch::Tensor token_slots, std::vector<int64_t> out_slices = {}, bool b_packed = false) {
  TORCH_CHECK(x.dim() == 2 && y.dim() == 2 && lora_a.dim() == 3 && (lora_b.dim() == 3 || b_packed) && token_slots.dim() == 1,
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
  if (!b_packed) {
    TORCH_CHECK(lora_b.size(1) == out && lora_b.size(2) == R, "add_lora: lora_b must be [L, out, R]");
  } else if (dt == at::kFloat) {
    TORCH_CHECK(lora_b.size(1) == R && lora_b.size(2) == out, "add_lora: packed fp32 lora_b must be [L, R, out]");
  } else {
    TORCH_CHECK(R % 2 == 0 && lora_b.dim() == 4 && lora_b.size(1) == R / 2 && lora_b.size(2) == out && lora_b.size(3) == 2,
                "add_lora: packed bf16 lora_b must be [L, R/2, out, 2] (needs even R)");
  }
  TORCH_CHECK(lora_a.is_contiguous() && lora_b.is_contiguous(), "add_lora: weights must be contiguous");
  TORCH_CHECK(x.stride(1) == 1 && y.stride(1) == 1, "add_lora: x/y need unit column stride");
  if (N == 0) return;
  const int64_t* sl = token_slots.data_ptr<int64_t>();
  for (int64_t t = 0; t < N; ++t) TORCH_CHECK(sl[t] >= -1 && sl[t] < L, "add_lora: slot out of range");
  if (out_slices.empty()) out_slices.push_back(out);
  const int64_t K = (int64_t)out_slices.size();
  TORCH_CHECK(R % K == 0, "add_lora: R must be divisible by the number of out_slices");
  TORCH_CHECK(!(b_packed && dt == at::kBFloat16) || (R / K) % 2 == 0, "add_lora: packed bf16 needs even rank per slice");
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
                         lora_a.data_ptr<float>(), lora_b.data_ptr<float>(), sl, N, in, out, L, R, blocks, b_packed);
  } else {
    add_lora_impl<bf16raw>((bf16raw*)y.data_ptr<at::BFloat16>(), y.stride(0),
                           (const bf16raw*)x.data_ptr<at::BFloat16>(), x.stride(0),
                           (const bf16raw*)lora_a.data_ptr<at::BFloat16>(),
                           (const bf16raw*)lora_b.data_ptr<at::BFloat16>(), sl, N, in, out, L, R, blocks, b_packed);
  }
}

// One-time re-layout of lora_b (e.g. when an adapter is loaded into a slot) so the expand step
// streams B without per-call in-register transposes.
torch::Tensor pack_lora_b(torch::Tensor b) {
  TORCH_CHECK(b.dim() == 3, "pack_lora_b: expects [L, out, R]");
  if (b.scalar_type() == at::kBFloat16) {
    TORCH_CHECK(b.size(2) % 2 == 0, "pack_lora_b: bf16 needs even R");
    return b.reshape({b.size(0), b.size(1), b.size(2) / 2, 2}).permute({0, 2, 1, 3}).contiguous();
  }
  return b.transpose(1, 2).contiguous();
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("add_lora", &add_lora, "y += per-token LoRA (in place)", py::arg("y"), py::arg("x"), py::arg("lora_a"),
        py::arg("lora_b"), py::arg("token_slots"), py::arg("out_slices") = std::vector<int64_t>{},
        py::arg("b_packed") = false,
        py::call_guard<py::gil_scoped_release>());
  m.def("pack_lora_b", &pack_lora_b, "[L,out,R] -> fp32: [L,R,out]; bf16: [L,R/2,out,2] (for b_packed=True)");
}
