// Paged decode attention CPU kernel (fp32 / bf16), AVX-512 (+AVX512_BF16), OpenMP.
//
//   decode_attention(q, k_cache, v_cache, block_tables, context_lens, block_size, scale) -> out
//     q [B, H, D] (unit last stride; any other strides), k_cache/v_cache [NB*bs, KVH, D] contiguous,
//     block_tables [B, max_blocks] int64, context_lens [B] int64 in [1, max_blocks*bs]
//     out [B, H, D] new, dtype of q.  Head h uses kv head h / G (G = H / KVH).
//     key p of sequence b is row block_tables[b, p / bs] * bs + p % bs of the caches.
//
// Algorithm (one work unit = sequence b, kv head h, key range [t0, t1)):
//   0. row offsets of the range's keys (through the block table) into a thread-local buffer
//   1. scores s[g][t] = scale * q[g] . k[t] for the G query heads of the group: tiles of 4 keys x up
//      to 4 heads, vectorized along D (bf16: vdpbf16ps, fp32 accumulate); the lane sums of 16 keys
//      x 1 head are finished together by one unpack/shuffle/add tree (~3 shuffles per score);
//      K rows (and V rows in step 3) are software-prefetched 8 keys ahead (random block order)
//   2. softmax in fp32 (two passes over the L1/L2 resident score buffer: max, then exp + sum)
//   3. acc[g] = sum_t e[g][t] * v[t] (fp32), tiles of up to 4 heads x 64 columns
//   4. out = acc / sum, rounded (RNE) to bf16 where needed.
//   Units: one per (b, h) unless there are too few for the threads (small batch, long context):
//   then each sequence's keys are split (flash-decoding) and the partial (max, sum, acc) are merged
//   in a second OpenMP loop. Threads: at::get_num_threads() (torch's libgomp), dynamic schedule
//   (ragged context lengths). Single thread for tiny problems.
//
//   store_kv(k_cache, v_cache, k, v, cache_rows)   in place
//     k_cache[cache_rows[t]] = k[t], v_cache[cache_rows[t]] = v[t]: the new tokens' keys and values
//     into the paged caches [S, KVH, D] (contiguous); k, v [T, KVH, D] with unit last stride (views of the
//     fused qkv output), cache_rows [T] int64 in [0, S). What two index_copy_ calls do, in one call
//     and plain row copies: index_copy_ cost ~1-1.8 ms of a 32-sequence decode step (60 calls).
#include "torch_api.h"
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <omp.h>
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <utility>
#include <vector>

#include "simd.h"

namespace {

// unmasked loads (simd.h has the masked ones)
static inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
static inline __m512 load16(const bf16raw* p) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)p)), 16));
}
using ::load16;  // the masked overloads from simd.h, which these would otherwise hide

// prefetch one K/V row (bytes) into L1
template <typename T>
static inline void prefetch_row(const T* p, int64_t D) {
  const char* c = (const char*)p;
  for (int64_t o = 0; o < D * (int64_t)sizeof(T); o += 64) _mm_prefetch(c + o, _MM_HINT_T0);
}
constexpr int64_t kPF = 8;  // keys ahead

// 4 vectors -> one vector whose 128-bit lane L holds 4 partial sums (of lanes 4L..4L+3) of a0..a3
static inline __m512 reduce4p(__m512 a0, __m512 a1, __m512 a2, __m512 a3) {
  const __m512 t0 = _mm512_add_ps(_mm512_unpacklo_ps(a0, a1), _mm512_unpackhi_ps(a0, a1));
  const __m512 t1 = _mm512_add_ps(_mm512_unpacklo_ps(a2, a3), _mm512_unpackhi_ps(a2, a3));
  const __m512d d0 = _mm512_castps_pd(t0), d1 = _mm512_castps_pd(t1);
  return _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(d0, d1)), _mm512_castpd_ps(_mm512_unpackhi_pd(d0, d1)));
}
// 4 reduce4p results (keys 4c..4c+3 in u[c]) -> the 16 full sums, in key order
static inline __m512 reduce16(const __m512 u[4]) {
  const __m512 w0 = _mm512_add_ps(_mm512_shuffle_f32x4(u[0], u[1], 0x88), _mm512_shuffle_f32x4(u[0], u[1], 0xDD));
  const __m512 w1 = _mm512_add_ps(_mm512_shuffle_f32x4(u[2], u[3], 0x88), _mm512_shuffle_f32x4(u[2], u[3], 0xDD));
  return _mm512_add_ps(_mm512_shuffle_f32x4(w0, w1, 0x88), _mm512_shuffle_f32x4(w0, w1, 0xDD));
}

// ---------------------------------------------------------------- 1. scores
// s[g][i] = scale * q[g] . k(off[i]),  i in [0, n), GT heads
template <typename T, int GT>
static inline void score_tile(const T* kc, const int64_t* off, int64_t n, const T* const* qp, int64_t D,
                              float scale, float* const* sp) {
  const __m512 vscale = _mm512_set1_ps(scale);
  for (int64_t i0 = 0; i0 < n; i0 += 16) {
    __m512 u[GT][4];
    for (int c = 0; c < 4; ++c) {
      const int64_t i = i0 + 4 * c;
      const T* kp[4];
      for (int j = 0; j < 4; ++j) kp[j] = kc + off[std::min<int64_t>(i + j, n - 1)];
      if (i + kPF + 4 <= n)
        for (int j = 0; j < 4; ++j) prefetch_row(kc + off[i + kPF + j], D);
      __m512 acc[GT][4];
      for (int g = 0; g < GT; ++g)
        for (int j = 0; j < 4; ++j) acc[g][j] = _mm512_setzero_ps();
      dot_tile(qp, kp, D, acc);
      for (int g = 0; g < GT; ++g) u[g][c] = reduce4p(acc[g][0], acc[g][1], acc[g][2], acc[g][3]);
    }
    const __mmask16 sm = mask16(n - i0);
    for (int g = 0; g < GT; ++g) _mm512_mask_storeu_ps(sp[g] + i0, sm, _mm512_mul_ps(reduce16(u[g]), vscale));
  }
}

template <typename T>
static inline void score_dispatch(int gt, const T* kc, const int64_t* off, int64_t n, const T* const* qp, int64_t D,
                                  float scale, float* const* sp) {
  switch (gt) {
    case 4: score_tile<T, 4>(kc, off, n, qp, D, scale, sp); break;
    case 3: score_tile<T, 3>(kc, off, n, qp, D, scale, sp); break;
    case 2: score_tile<T, 2>(kc, off, n, qp, D, scale, sp); break;
    default: score_tile<T, 1>(kc, off, n, qp, D, scale, sp); break;
  }
}

// ---------------------------------------------------------------- 3. weighted sum of V
// o[g][c0 + 16k ...] = sum_i p[g][i] * v(off[i])[c0 + 16k ...],  NV vectors (last one masked by lm)
template <typename T, int GT, int NV>
static inline void av_tile(const T* vc, const int64_t* off, int64_t n, const float* const* pp, __mmask16 lm,
                           float* const* op) {
  __m512 acc[GT][NV];
  for (int g = 0; g < GT; ++g)
    for (int k = 0; k < NV; ++k) acc[g][k] = _mm512_setzero_ps();
  for (int64_t i = 0; i < n; ++i) {
    const T* vp = vc + off[i];
    if (i + kPF < n) prefetch_row(vc + off[i + kPF], 16 * NV);
    __m512 v[NV];
    for (int k = 0; k < NV - 1; ++k) v[k] = load16(vp + 16 * k);
    v[NV - 1] = load16(vp + 16 * (NV - 1), lm);
    for (int g = 0; g < GT; ++g) {
      const __m512 p = _mm512_set1_ps(pp[g][i]);
      for (int k = 0; k < NV; ++k) acc[g][k] = _mm512_fmadd_ps(p, v[k], acc[g][k]);
    }
  }
  for (int g = 0; g < GT; ++g) {
    for (int k = 0; k < NV - 1; ++k) _mm512_storeu_ps(op[g] + 16 * k, acc[g][k]);
    _mm512_mask_storeu_ps(op[g] + 16 * (NV - 1), lm, acc[g][NV - 1]);
  }
}

template <typename T, int GT>
static inline void av_nv(int nv, const T* vc, const int64_t* off, int64_t n, const float* const* pp, __mmask16 lm,
                         float* const* op) {
  switch (nv) {
    case 4: av_tile<T, GT, 4>(vc, off, n, pp, lm, op); break;
    case 3: av_tile<T, GT, 3>(vc, off, n, pp, lm, op); break;
    case 2: av_tile<T, GT, 2>(vc, off, n, pp, lm, op); break;
    default: av_tile<T, GT, 1>(vc, off, n, pp, lm, op); break;
  }
}
template <typename T>
static inline void av_dispatch(int gt, int nv, const T* vc, const int64_t* off, int64_t n, const float* const* pp,
                               __mmask16 lm, float* const* op) {
  switch (gt) {
    case 4: av_nv<T, 4>(nv, vc, off, n, pp, lm, op); break;
    case 3: av_nv<T, 3>(nv, vc, off, n, pp, lm, op); break;
    case 2: av_nv<T, 2>(nv, vc, off, n, pp, lm, op); break;
    default: av_nv<T, 1>(nv, vc, off, n, pp, lm, op); break;
  }
}

// ---------------------------------------------------------------- driver
struct Unit {
  int64_t b, h, t0, t1, slot;  // slot: index into the partial buffer, -1: write the output directly
};

struct Scratch {
  std::vector<int64_t> off;
  std::vector<float> s;    // [G][n_pad]
  std::vector<float> acc;  // [G][D]
};

template <typename T>
static void run_unit(const Unit& u, Scratch& sc, const T* q, int64_t qs0, int64_t qs1, const T* kc, const T* vc,
                     const int64_t* bt, int64_t bts0, int64_t bs, int64_t KVH, int64_t G, int64_t D, float scale,
                     T* out, float* part) {
  const int64_t n = u.t1 - u.t0;
  const int64_t npad = (n + 15) & ~(int64_t)15;
  if ((int64_t)sc.off.size() < n) sc.off.resize(n);
  if ((int64_t)sc.s.size() < G * npad) sc.s.resize(G * npad);
  if ((int64_t)sc.acc.size() < G * D) sc.acc.resize(G * D);
  int64_t* off = sc.off.data();
  float* s = sc.s.data();
  float* acc = sc.acc.data();

  // 0. row offsets (element index of K/V row start for kv head h)
  {
    const int64_t* row = bt + u.b * bts0;
    const int64_t rs = KVH * D;
    int64_t t = u.t0, i = 0;
    while (t < u.t1) {
      const int64_t blk = t / bs, in0 = t - blk * bs;
      const int64_t cnt = std::min(bs - in0, u.t1 - t);
      const int64_t base = ((row[blk] * bs + in0) * KVH + u.h) * D;
      for (int64_t j = 0; j < cnt; ++j) off[i + j] = base + j * rs;
      i += cnt;
      t += cnt;
    }
  }
  const T* qh = q + u.b * qs0 + u.h * G * qs1;
  // split G into near-equal tiles of at most 4 heads
  const int64_t ntile = (G + 3) / 4, gstep = (G + ntile - 1) / ntile;

  // 1. scores
  for (int64_t g0 = 0; g0 < G; g0 += gstep) {
    const int gt = (int)std::min(gstep, G - g0);
    const T* qp[4];
    float* sp[4];
    for (int j = 0; j < gt; ++j) {
      qp[j] = qh + (g0 + j) * qs1;
      sp[j] = s + (g0 + j) * npad;
    }
    score_dispatch<T>(gt, kc, off, n, qp, D, scale, sp);
  }
  // 2. softmax (unnormalized; max and sum kept)
  float mx[64], sum[64];
  for (int64_t g = 0; g < G; ++g) {
    float* sg = s + g * npad;
    __m512 m = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
    int64_t i = 0;
    for (; i + 16 <= n; i += 16) m = _mm512_max_ps(m, _mm512_loadu_ps(sg + i));
    if (i < n) m = _mm512_mask_max_ps(m, mask16(n - i), m, _mm512_maskz_loadu_ps(mask16(n - i), sg + i));
    const float mval = _mm512_reduce_max_ps(m);
    const __m512 vm = _mm512_set1_ps(mval);
    __m512 l = _mm512_setzero_ps();
    for (i = 0; i + 16 <= n; i += 16) {
      const __m512 e = exp512(_mm512_sub_ps(_mm512_loadu_ps(sg + i), vm));
      _mm512_storeu_ps(sg + i, e);
      l = _mm512_add_ps(l, e);
    }
    if (i < n) {
      const __mmask16 tm = mask16(n - i);
      const __m512 e = _mm512_maskz_mov_ps(tm, exp512(_mm512_sub_ps(_mm512_maskz_loadu_ps(tm, sg + i), vm)));
      _mm512_mask_storeu_ps(sg + i, tm, e);
      l = _mm512_add_ps(l, e);
    }
    mx[g] = mval;
    sum[g] = _mm512_reduce_add_ps(l);
  }
  // 3. acc = sum_t e[g][t] v[t]
  for (int64_t c0 = 0; c0 < D; c0 += 64) {
    const int64_t w = std::min<int64_t>(64, D - c0);
    const int nv = (int)((w + 15) / 16);
    const __mmask16 lm = mask16(w - 16 * (nv - 1));
    for (int64_t g0 = 0; g0 < G; g0 += gstep) {
      const int gt = (int)std::min(gstep, G - g0);
      const float* pp[4];
      float* op[4];
      for (int j = 0; j < gt; ++j) {
        pp[j] = s + (g0 + j) * npad;
        op[j] = acc + (g0 + j) * D + c0;
      }
      av_dispatch<T>(gt, nv, vc + c0, off, n, pp, lm, op);
    }
  }
  // 4. write
  if (u.slot < 0) {
    T* o = out + (u.b * KVH + u.h) * G * D;
    for (int64_t g = 0; g < G; ++g) {
      const __m512 inv = _mm512_set1_ps(1.0f / sum[g]);
      for (int64_t d = 0; d < D; d += 16) {
        const __mmask16 m = mask16(D - d);
        store16(o + g * D + d, _mm512_mul_ps(_mm512_maskz_loadu_ps(m, acc + g * D + d), inv), m);
      }
    }
  } else {
    float* p = part + u.slot * G * (D + 2);
    for (int64_t g = 0; g < G; ++g) {
      p[g * (D + 2)] = mx[g];
      p[g * (D + 2) + 1] = sum[g];
      std::copy(acc + g * D, acc + (g + 1) * D, p + g * (D + 2) + 2);
    }
  }
}

template <typename T>
static void decode_impl(const T* q, int64_t qs0, int64_t qs1, const T* kc, const T* vc, const int64_t* bt,
                        int64_t bts0, const int64_t* cl, int64_t B, int64_t H, int64_t KVH, int64_t D, int64_t bs,
                        float scale, T* out) {
  const int64_t G = H / KVH;
  int nth = std::max(1, at::get_num_threads());
  int64_t total = 0;
  for (int64_t b = 0; b < B; ++b) total += cl[b];
  total *= KVH;
  // tiny problems: the parallel region costs more than it saves
  if (total * G * D < (int64_t)24 * 1024) nth = 1;
  // split sequences when (b, h) units are too few for the threads
  int64_t chunk = std::numeric_limits<int64_t>::max();
  if (nth > 1 && B * KVH < 4 * (int64_t)nth) {
    chunk = std::max<int64_t>(256, (total + 4 * nth - 1) / (4 * nth));
    chunk = (chunk + 63) & ~(int64_t)63;
  }
  std::vector<Unit> units;
  units.reserve(B * KVH);
  struct Merge {
    int64_t b, h, first, count;
  };
  std::vector<Merge> merges;
  int64_t nslots = 0;
  for (int64_t b = 0; b < B; ++b)
    for (int64_t h = 0; h < KVH; ++h) {
      const int64_t n = cl[b];
      if (n <= chunk) {
        units.push_back({b, h, 0, n, -1});
      } else {
        const int64_t k = (n + chunk - 1) / chunk, step = (n + k - 1) / k;
        merges.push_back({b, h, nslots, k});
        for (int64_t t0 = 0; t0 < n; t0 += step) units.push_back({b, h, t0, std::min(n, t0 + step), nslots++});
      }
    }
  std::vector<float> part((size_t)(nslots * G * (D + 2)));
  const int64_t nu = (int64_t)units.size(), nm = (int64_t)merges.size();
#pragma omp parallel num_threads(nth) if (nth > 1)
  {
    Scratch sc;
#pragma omp for schedule(dynamic, 1)
    for (int64_t i = 0; i < nu; ++i)
      run_unit<T>(units[i], sc, q, qs0, qs1, kc, vc, bt, bts0, bs, KVH, G, D, scale, out, part.data());
    if (nm > 0) {
#pragma omp for schedule(static)
      for (int64_t i = 0; i < nm * G; ++i) {
        const Merge& mg = merges[i / G];
        const int64_t g = i % G;
        float M = -std::numeric_limits<float>::infinity();
        for (int64_t k = 0; k < mg.count; ++k) M = std::max(M, part[((mg.first + k) * G + g) * (D + 2)]);
        float L = 0.f;
        std::vector<float>& a = sc.acc;
        if ((int64_t)a.size() < D) a.resize(D);
        std::fill(a.begin(), a.begin() + D, 0.f);
        for (int64_t k = 0; k < mg.count; ++k) {
          const float* p = part.data() + ((mg.first + k) * G + g) * (D + 2);
          const float w = std::exp(p[0] - M);
          L += w * p[1];
          for (int64_t d = 0; d < D; ++d) a[d] += w * p[2 + d];
        }
        const float inv = 1.0f / L;
        T* o = out + ((mg.b * KVH + mg.h) * G + g) * D;
        for (int64_t d = 0; d < D; d += 16) {
          const __mmask16 m = mask16(D - d);
          store16(o + d, _mm512_mul_ps(_mm512_maskz_loadu_ps(m, a.data() + d), _mm512_set1_ps(inv)), m);
        }
      }
    }
  }
}

}  // namespace

at::Tensor decode_attention(at::Tensor q, at::Tensor k_cache, at::Tensor v_cache, at::Tensor block_tables,
                               at::Tensor context_lens, int64_t block_size, double scale) {
  TORCH_CHECK(q.dim() == 3, "decode_attention: q must be [batch, num_heads, head_dim], got ", q.sizes());
  TORCH_CHECK(k_cache.dim() == 3 && v_cache.dim() == 3,
              "decode_attention: k_cache/v_cache must be [num_blocks*block_size, kv_heads, head_dim]");
  TORCH_CHECK(block_tables.dim() == 2, "decode_attention: block_tables must be [batch, max_blocks]");
  TORCH_CHECK(context_lens.dim() == 1, "decode_attention: context_lens must be [batch]");
  TORCH_CHECK(q.device().is_cpu() && k_cache.device().is_cpu() && v_cache.device().is_cpu() &&
                  block_tables.device().is_cpu() && context_lens.device().is_cpu(),
              "decode_attention: CPU tensors only");
  const auto dt = q.scalar_type();
  TORCH_CHECK(dt == at::kFloat || dt == at::kBFloat16, "decode_attention: float32 or bfloat16 only, got ", dt);
  TORCH_CHECK(k_cache.scalar_type() == dt && v_cache.scalar_type() == dt,
              "decode_attention: q, k_cache, v_cache dtypes differ (", dt, ", ", k_cache.scalar_type(), ", ",
              v_cache.scalar_type(), ")");
  TORCH_CHECK(block_tables.scalar_type() == at::kLong && context_lens.scalar_type() == at::kLong,
              "decode_attention: block_tables and context_lens must be int64");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), "decode_attention: k_cache/v_cache must be contiguous");
  TORCH_CHECK(k_cache.sizes() == v_cache.sizes(), "decode_attention: k_cache ", k_cache.sizes(), " and v_cache ",
              v_cache.sizes(), " differ");
  TORCH_CHECK(q.stride(2) == 1, "decode_attention: q needs unit stride on head_dim");
  TORCH_CHECK(block_tables.stride(1) == 1, "decode_attention: block_tables needs unit column stride");
  TORCH_CHECK(context_lens.is_contiguous(), "decode_attention: context_lens must be contiguous");
  const int64_t B = q.size(0), H = q.size(1), D = q.size(2);
  const int64_t KVH = k_cache.size(1);
  TORCH_CHECK(k_cache.size(2) == D, "decode_attention: head_dim of q (", D, ") and cache (", k_cache.size(2), ") differ");
  TORCH_CHECK(KVH >= 1 && H % KVH == 0, "decode_attention: num_heads (", H, ") not a multiple of kv_heads (", KVH, ")");
  TORCH_CHECK(H / KVH <= 64, "decode_attention: at most 64 query heads per kv head");
  TORCH_CHECK(D >= 1, "decode_attention: empty head_dim");
  TORCH_CHECK(block_size >= 1, "decode_attention: block_size must be >= 1");
  TORCH_CHECK(k_cache.size(0) % block_size == 0, "decode_attention: cache rows (", k_cache.size(0),
              ") not a multiple of block_size (", block_size, ")");
  TORCH_CHECK(block_tables.size(0) == B && context_lens.size(0) == B, "decode_attention: batch mismatch (q ", B,
              ", block_tables ", block_tables.size(0), ", context_lens ", context_lens.size(0), ")");
  const int64_t num_blocks = k_cache.size(0) / block_size, max_blocks = block_tables.size(1);
  const int64_t* cl = context_lens.data_ptr<int64_t>();
  const int64_t* bt = block_tables.data_ptr<int64_t>();
  const int64_t bts0 = block_tables.stride(0);
  for (int64_t b = 0; b < B; ++b) {
    TORCH_CHECK(cl[b] >= 1 && cl[b] <= max_blocks * block_size, "decode_attention: context_lens[", b, "] = ", cl[b],
                " outside [1, max_blocks * block_size = ", max_blocks * block_size, "]");
    const int64_t nb = (cl[b] + block_size - 1) / block_size;
    for (int64_t j = 0; j < nb; ++j)
      TORCH_CHECK(bt[b * bts0 + j] >= 0 && bt[b * bts0 + j] < num_blocks, "decode_attention: block_tables[", b, ", ",
                  j, "] = ", bt[b * bts0 + j], " outside [0, ", num_blocks, ")");
  }
  auto out = at::empty({B, H, D}, q.options().memory_format(at::MemoryFormat::Contiguous));
  if (B == 0 || H == 0) return out;
  if (dt == at::kFloat) {
    decode_impl<float>(q.data_ptr<float>(), q.stride(0), q.stride(1), k_cache.data_ptr<float>(),
                       v_cache.data_ptr<float>(), bt, bts0, cl, B, H, KVH, D, block_size, (float)scale,
                       out.data_ptr<float>());
  } else {
    decode_impl<bf16raw>((const bf16raw*)q.data_ptr<at::BFloat16>(), q.stride(0), q.stride(1),
                         (const bf16raw*)k_cache.data_ptr<at::BFloat16>(), (const bf16raw*)v_cache.data_ptr<at::BFloat16>(),
                         bt, bts0, cl, B, H, KVH, D, block_size, (float)scale,
                         (bf16raw*)out.data_ptr<at::BFloat16>());
  }
  return out;
}

void store_kv(at::Tensor k_cache, at::Tensor v_cache, at::Tensor k, at::Tensor v, at::Tensor cache_rows) {
  TORCH_CHECK(k_cache.dim() == 3 && k_cache.is_contiguous() && v_cache.sizes() == k_cache.sizes() && v_cache.is_contiguous(),
              "store_kv: k_cache/v_cache must be contiguous [slots, kv_heads, head_dim] of one shape");
  TORCH_CHECK(k.dim() == 3 && v.sizes() == k.sizes() && k.size(1) == k_cache.size(1) && k.size(2) == k_cache.size(2),
              "store_kv: k/v must be [tokens, kv_heads, head_dim] matching the cache, got ", k.sizes(), " and ", v.sizes());
  TORCH_CHECK(k.stride(2) == 1 && v.stride(2) == 1, "store_kv: k/v need unit stride on head_dim");
  const auto dt = k_cache.scalar_type();
  TORCH_CHECK(v_cache.scalar_type() == dt && k.scalar_type() == dt && v.scalar_type() == dt, "store_kv: dtypes differ");
  TORCH_CHECK(k_cache.device().is_cpu() && v_cache.device().is_cpu() && k.device().is_cpu() && v.device().is_cpu() &&
                  cache_rows.device().is_cpu(), "store_kv: CPU tensors only");
  TORCH_CHECK(cache_rows.dim() == 1 && cache_rows.scalar_type() == at::kLong && cache_rows.is_contiguous() &&
                  cache_rows.size(0) == k.size(0), "store_kv: cache_rows must be a contiguous int64 [tokens]");
  const int64_t T = k.size(0), S = k_cache.size(0), D = k.size(2);
  const int64_t* sl = cache_rows.data_ptr<int64_t>();
  for (int64_t t = 0; t < T; ++t)
    TORCH_CHECK(sl[t] >= 0 && sl[t] < S, "store_kv: cache_rows[", t, "] = ", sl[t], " outside [0, ", S, ")");
  const int64_t es = k.element_size(), head_bytes = D * es, row_bytes = k.size(1) * head_bytes;
  for (auto [src, cache] : {std::pair{&k, &k_cache}, std::pair{&v, &v_cache}}) {
    const char* from = (const char*)src->data_ptr();
    char* to = (char*)cache->data_ptr();
    const int64_t s0 = src->stride(0) * es, s1 = src->stride(1) * es, heads = src->size(1);
    at::parallel_for(0, T, 256, [&](int64_t t0, int64_t t1) {  // decode (T <= a few hundred): no fork
      for (int64_t t = t0; t < t1; ++t)
        for (int64_t h = 0; h < heads; ++h) std::memcpy(to + sl[t] * row_bytes + h * head_bytes, from + t * s0 + h * s1, head_bytes);
    });
  }
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("store_kv", &store_kv, "k_cache[cache_rows] = k; v_cache[cache_rows] = v", py::arg("k_cache"),
        py::arg("v_cache"), py::arg("k"), py::arg("v"), py::arg("cache_rows"), py::call_guard<py::gil_scoped_release>());
  m.def("decode_attention", &decode_attention, "paged decode attention (one query token per sequence)", py::arg("q"),
        py::arg("k_cache"), py::arg("v_cache"), py::arg("block_tables"), py::arg("context_lens"), py::arg("block_size"),
        py::arg("scale"), py::call_guard<py::gil_scoped_release>());
}
