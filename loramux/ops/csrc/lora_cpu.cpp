// Multi-LoRA "add_lora" CPU kernel (fp32 / bf16), AVX-512 (+AVX512_BF16), OpenMP.
//
//   add_lora(y, x, lora_a, lora_b, token_slots, out_slices=[], slot_ranks=None)
//     in-place, returns None
//     x [N,in], y [N,out] (row stride may differ from width; unit column stride); x, y, A, B all fp32, all bf16,
//     or x, y fp32 with A, B bf16 (lora_dtype bf16 on an fp32 model: B's bytes halved, fp32 math on exact widenings)
//     lora_a [L,K*r,in] contiguous; lora_b [L,out,r] read rank-major: strides (r*out, 1, out), i.e.
//     lora_b.transpose(1, 2) contiguous (LoRALinear allocates it so; any other layout is copied per call);
//     token_slots [N] int64 in [-1,L)
//     K = len(out_slices) (1 if empty); output rows of slice k use the shrunk rows [k*r, (k+1)*r):
//     y[t, rows_k] += lora_b[s, rows_k] @ (lora_a[s, k*r:(k+1)*r] @ x[t])   for s = token_slots[t] >= 0
//     slot_ranks: optional int64 [L], real rank r_s <= r of each slot (zero-padded adapters): only A rows
//     [k*r, k*r + r_s) and B's rank rows [0, r_s) are read; slots of rank 0 are skipped.
//
// Algorithm
//   0. counting sort of token indices by slot -> groups (slot, list of tokens). Works for
//      sorted and unsorted slots; -1 tokens (and rank-0 slots) are dropped.
//   1. shrink: h[p, r] = A[s, r, :] . x[tok(p), :]   (fp32 scratch h [M, K*r], 0 past each slot's rank)
//      tile = up to 4 tokens x 4 rank-rows, vectorized along `in`; only the slot's real rank rows
//      (bf16: vdpbf16ps, 32 bf16 pairs per instruction, fp32 accumulate); a 4 x 4 tile's 16 sums
//      come out of one transpose-and-add tree
//   2. expand, per block of one cache line of outputs (fp32 16, bf16 32; within one slice) and group:
//      B's rank rows hold the block's outputs contiguously, so for tiles of up to 8 tokens
//      fp32: acc[t] += bcast(h[t, r]) * B[s, r, o0:o0+16]
//      bf16: h rounded to bf16 (as a bf16 reference rounds A's output); rank rows r, r+1 interleaved
//            into pairs, acc[t] += vdpbf16ps(bcast(h[t, r], h[t, r+1]), pairs): two ranks per instruction
//      and y[t, block] += acc[t] (bf16: y rounded RNE). Rank-major B is why: an out-major [out, r]
//      block would need a transpose or a horizontal reduction per block, and a slot of rank r_s < r
//      reads r_s whole rows instead of r_s of every row's r columns.
//   Both passes loop over a group's token tiles outside and its items / blocks inside: with many tokens
//   per adapter (prefill) the adapter's A and B stay in L2 and x and y are each read once, row by row.
//   Memory: decode reads every active slot's A and B from DRAM once per call (~0.5 MB, 120 calls a step,
//   between compute-bound base GEMMs that leave them out of cache). Each thread lists the A rows and B
//   columns it will read, in the order it reads them, and a prefetch cursor walks that list 16 KB ahead
//   of the arithmetic, into L2: the memory system sees one steady stream per thread instead of the
//   tiles' 4-16 short concurrent ones (the gain: docs/performance.md, "numbers behind the kernels").
//   Threads: one OpenMP region (uses the libgomp already loaded by torch, same soname),
//   num_threads = at::get_num_threads(). As many groups as threads or more (decode over many
//   adapters): each thread owns a run of whole groups (balanced by work) and does their shrink and
//   expand without a barrier. Fewer (one adapter, prefill): shrink split over (group, rank-chunk)
//   items, a barrier, expand split over output blocks (balanced regardless of group sizes).
//   Work lists and scratch live in a per-thread Plan reused across calls (no allocation when warm).
//   bf16 groups of >= 16 tokens (a prefill's prompt on one adapter), where the CPU has AMX, in % 32 == 0 and
//   rank <= 32: AMX tiles instead (amx_groups, below), 16 tokens a tile, the group's A and B packed as B tiles
//   by each thread that takes its tiles; the same roundings (h to bf16, y once); about twice the speed of the
//   vector path on such groups.
#include "torch_api.h"
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <omp.h>
#include <cstdint>
#include <vector>
#include <algorithm>
#include <cstring>
#include <utility>
#include <type_traits>

#include "simd.h"
#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
#include "amx.h"  // outside the anonymous namespace: it includes system headers
#define LORA_AMX 1
#endif

namespace {

// ---------------------------------------------------------------- shrink tiles
// hp[t][0:4] = the horizontal sums of acc[t][0:4] for t < 4, as one transpose-and-add tree: 45
// shuffles/adds for the 16 sums instead of ~8 per _mm512_reduce_add_ps (a third of a decode tile's time)
static inline void store_sums_4x4(__m512 (&acc)[4][4], float* const* hp) {
  __m512 z[4];
  for (int t = 0; t < 4; ++t) {
    // per 128-bit lane: x01 = [a0+a2, b0+b2, a1+a3, b1+b3] for a, b = acc[t][0], acc[t][1]
    const __m512 x01 = _mm512_add_ps(_mm512_unpacklo_ps(acc[t][0], acc[t][1]), _mm512_unpackhi_ps(acc[t][0], acc[t][1]));
    const __m512 x23 = _mm512_add_ps(_mm512_unpacklo_ps(acc[t][2], acc[t][3]), _mm512_unpackhi_ps(acc[t][2], acc[t][3]));
    // per 128-bit lane: [j0, j1, j2, j3] partial sums of token t
    z[t] = _mm512_add_ps(_mm512_shuffle_ps(x01, x23, 0x44), _mm512_shuffle_ps(x01, x23, 0xEE));
  }
  // sum the four 128-bit lanes of each z[t]; lane t of r = token t's four sums
  const __m512 p = _mm512_add_ps(_mm512_shuffle_f32x4(z[0], z[1], 0x44), _mm512_shuffle_f32x4(z[0], z[1], 0xEE));
  const __m512 q = _mm512_add_ps(_mm512_shuffle_f32x4(z[2], z[3], 0x44), _mm512_shuffle_f32x4(z[2], z[3], 0xEE));
  const __m512 r = _mm512_add_ps(_mm512_shuffle_f32x4(p, q, 0x88), _mm512_shuffle_f32x4(p, q, 0xDD));
  _mm_storeu_ps(hp[0], _mm512_castps512_ps128(r));
  _mm_storeu_ps(hp[1], _mm512_extractf32x4_ps(r, 1));
  _mm_storeu_ps(hp[2], _mm512_extractf32x4_ps(r, 2));
  _mm_storeu_ps(hp[3], _mm512_extractf32x4_ps(r, 3));
}

// h[t][j] = dot(A row (r0+j), x row t)   for TT tokens, RT rank rows (x: T; A: W, = T or bf16 under fp32 x)
template <typename T, typename W, int TT, int RT>
static inline void shrink_tile(const T* const* xp, const W* ap, int64_t in, float* const* hp) {
  const W* arows[RT];
  for (int j = 0; j < RT; ++j) arows[j] = ap + j * in;
  __m512 acc[TT][RT];
  for (int t = 0; t < TT; ++t)
    for (int j = 0; j < RT; ++j) acc[t][j] = _mm512_setzero_ps();
  dot_tile(xp, arows, in, acc);  // (bf16: vdpbf16ps over pairs; fp32 x against bf16 A: widened)
  if constexpr (TT == 4 && RT == 4) {
    store_sums_4x4(acc, hp);
  } else {
    for (int t = 0; t < TT; ++t)
      for (int j = 0; j < RT; ++j) hp[t][j] = _mm512_reduce_add_ps(acc[t][j]);
  }
}

template <typename T, typename W, int TT>
static inline void shrink_rt(int rt, const T* const* xp, const W* ap, int64_t in, float* const* hp) {
  switch (rt) {
    case 4: shrink_tile<T, W, TT, 4>(xp, ap, in, hp); break;
    case 3: shrink_tile<T, W, TT, 3>(xp, ap, in, hp); break;
    case 2: shrink_tile<T, W, TT, 2>(xp, ap, in, hp); break;
    default: shrink_tile<T, W, TT, 1>(xp, ap, in, hp); break;
  }
}
template <typename T, typename W>
static inline void shrink_dispatch(int tt, int rt, const T* const* xp, const W* ap, int64_t in, float* const* hp) {
  switch (tt) {
    case 4: shrink_rt<T, W, 4>(rt, xp, ap, in, hp); break;
    case 3: shrink_rt<T, W, 3>(rt, xp, ap, in, hp); break;
    case 2: shrink_rt<T, W, 2>(rt, xp, ap, in, hp); break;
    default: shrink_rt<T, W, 1>(rt, xp, ap, in, hp); break;
  }
}


// ---------------------------------------------------------------- expand
// fp32: y[t, 16 outputs] += sum_r h[t][r] * b[r * ld + 0:16]   for TJ tokens (b: rank-major B at the block, fp32
// or bf16 widened). One token: simd.h's expand_row16 (four partial sums); two: the rank sum split over two partial
// sums (r mod 2), independent FMA chains instead of one rank-long chain of FMA latencies
template <int TJ, typename W>
static inline void expand_tile_f32(const W* bt, int64_t ld, int64_t rw, const float* const* hp, float* const* yp,
                                   __mmask16 om) {
  if constexpr (TJ == 1) {
    expand_row16(bt, ld, rw, hp[0], yp[0], om);
  } else {
    constexpr int S = TJ == 2 ? 2 : 1;
    __m512 acc[S][TJ];
    for (int k = 0; k < S; ++k)
      for (int j = 0; j < TJ; ++j) acc[k][j] = _mm512_setzero_ps();
    for (int64_t r = 0; r < rw; ++r) {
      const __m512 b = load16(bt + r * ld, om);
      for (int j = 0; j < TJ; ++j) acc[r % S][j] = _mm512_fmadd_ps(_mm512_set1_ps(hp[j][r]), b, acc[r % S][j]);
    }
    for (int j = 0; j < TJ; ++j) {
      __m512 sum = acc[0][j];
      for (int k = 1; k < S; ++k) sum = _mm512_add_ps(sum, acc[k][j]);
      store16(yp[j], _mm512_add_ps(load16(yp[j], om), sum), om);
    }
  }
}

// bf16: y[t, 32 outputs] += sum_r h[t][r] * b[r * ld + 0:32] with h rounded to bf16 (as a bf16 reference
// rounds A's output). Rank rows r, r+1 interleaved (vpunpck{l,h}wd) form dword pairs (B[r][o], B[r+1][o]),
// so one vdpbf16ps adds both ranks for 16 outputs: twice the rank rows and 2x the outputs per instruction
// of an fp32 FMA. hp[t] is token t's h row in bf16, read as pairs. The unpacks work within 128-bit
// lanes: `lo` holds outputs {0-3, 8-11, 16-19, 24-27}, `hi` the rest, reordered at the end.
template <int TJ>
static inline void expand_tile_bf16(const bf16raw* bt, int64_t ld, int64_t rw, const bf16raw* const* hp,
                                    bf16raw* const* yp, __mmask32 om) {
  __m512 lo[TJ], hi[TJ];
  for (int j = 0; j < TJ; ++j) lo[j] = hi[j] = _mm512_setzero_ps();
  for (int64_t r = 0; r < rw; r += 2) {
    const __m512i b0 = _mm512_maskz_loadu_epi16(om, bt + r * ld);
    const __m512i b1 = r + 1 < rw ? _mm512_maskz_loadu_epi16(om, bt + (r + 1) * ld) : _mm512_setzero_si512();
    const __m512bh pl = (__m512bh)_mm512_unpacklo_epi16(b0, b1), ph = (__m512bh)_mm512_unpackhi_epi16(b0, b1);
    for (int j = 0; j < TJ; ++j) {
      int32_t pair;  // (h[r], h[r+1]); past the last row h[r+1] is whatever follows (finite) times B's 0
      __builtin_memcpy(&pair, hp[j] + r, 4);
      const __m512bh hv = (__m512bh)_mm512_set1_epi32(pair);
      lo[j] = _mm512_dpbf16_ps(lo[j], pl, hv);
      hi[j] = _mm512_dpbf16_ps(hi[j], ph, hv);
    }
  }
  const __m512i first = _mm512_setr_epi32(0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23);
  const __m512i second = _mm512_setr_epi32(8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15, 28, 29, 30, 31);
  const __mmask16 m0 = (__mmask16)(om & 0xFFFF), m1 = (__mmask16)(om >> 16);
  for (int j = 0; j < TJ; ++j) {
    store16(yp[j], _mm512_add_ps(load16(yp[j], m0), _mm512_permutex2var_ps(lo[j], first, hi[j])), m0);
    if (m1) store16(yp[j] + 16, _mm512_add_ps(load16(yp[j] + 16, m1), _mm512_permutex2var_ps(lo[j], second, hi[j])), m1);
  }
}

template <typename T, typename W, typename H, typename M>
static inline void expand_dispatch(int tj, const W* bt, int64_t ld, int64_t rw, const H* const* hp, T* const* yp, M om) {
#define LORA_EXPAND_CASE(n) \
  case n: \
    if constexpr (std::is_same<T, float>::value) expand_tile_f32<n>(bt, ld, rw, hp, yp, om); \
    else expand_tile_bf16<n>(bt, ld, rw, hp, yp, om); \
    break;
  switch (tj) {
    LORA_EXPAND_CASE(8) LORA_EXPAND_CASE(7) LORA_EXPAND_CASE(6) LORA_EXPAND_CASE(5)
    LORA_EXPAND_CASE(4) LORA_EXPAND_CASE(3) LORA_EXPAND_CASE(2) default: LORA_EXPAND_CASE(1)
  }
#undef LORA_EXPAND_CASE
}

// one block of up to kBlock<T> outputs (one 64-byte line of each B rank row) within one output slice;
// its rows use the shrunk rows [rlo, rlo + group rank) (rlo = slice * r)
template <typename T> constexpr int64_t kBlock = 64 / sizeof(T);
struct ExpBlock { int64_t o0, nrows, rlo; };
struct Group { int64_t slot, start, len, rank; };  // rank: real rank per slice (<= R/K), > 0
struct ShrinkItem { int64_t g, r0; int rt; };       // rank rows [r0, r0 + rt) of group g

// A call's work lists and scratch, kept per thread across calls: a decode step makes 100+ calls of a
// few microseconds each, and allocating these every time was a fifth of the kernel's time.
struct Plan {
  std::vector<int64_t> cnt, pos, item_begin, gbeg;
  std::vector<int32_t> order;  // token indices sorted by slot
  std::vector<Group> groups;
  std::vector<ShrinkItem> items;
  std::vector<ExpBlock> blocks;
  std::vector<float> h;        // [M, R] shrink output (fp32); 0 past each slot's rank
  std::vector<bf16raw> hb;     // bf16 path: h rounded to bf16, [M, R] + 1 (the expand reads pairs)
  std::vector<Group> big;      // bf16 groups of >= big_min tokens: on AMX tiles (amx_groups), not in `groups`
};
static Plan& thread_plan() {
  static thread_local Plan plan;
  return plan;
}

// What one thread will read, in the order it reads it, and a prefetch position that runs ahead of it.
// A region is `cols` cache lines wide and `rows` deep, read column by column: line (r, c) at
// p + r * stride + c * 64. A's rows of a shrink item are one row of lines (they are contiguous; a 4-row
// tile reads them ~together, within 16 KB); B's columns for a range of output blocks are `rank` deep.
struct Region { const char* p; int64_t rows, stride, cols; };
struct Cursor {
  static constexpr int64_t kAhead = 256;  // lines (16 KB): measured best of 8-64 KB; L1-targeted hints hurt
  std::vector<Region> regions;
  size_t i = 0;
  int64_t row = 0, col = 0;
  void reset() { regions.clear(); i = 0; row = col = 0; }
  void add(const void* p, int64_t rows, int64_t stride, int64_t cols) {
    if (rows > 0 && cols > 0) regions.push_back({(const char*)p, rows, stride, cols});
  }
  // prefetch the next `lines` lines into L2 (call with what the arithmetic is about to consume)
  inline void advance(int64_t lines) {
    for (; lines > 0 && i < regions.size(); --lines) {
      const Region& g = regions[i];
      _mm_prefetch(g.p + row * g.stride + col * 64, _MM_HINT_T1);
      if (++row == g.rows) {
        row = 0;
        if (++col == g.cols) col = 0, ++i;
      }
    }
  }
};
static Cursor& thread_cursor() {  // per OpenMP worker (the pool persists across calls)
  static thread_local Cursor cursor;
  return cursor;
}
static inline int64_t lines_of(int64_t bytes) { return (bytes + 63) / 64; }

// Sorts tokens by slot into groups and lists the shrink items and expand blocks; false: nothing to do.
static bool make_plan(Plan& pl, const int64_t* slots, int64_t N, int64_t L, int64_t R, int64_t K,
                      const int64_t* ranks, const std::vector<int64_t>& out_slices, int64_t block, int64_t big_min) {
  const int64_t RK = R / K;
  pl.cnt.assign(L + 1, 0);
  for (int64_t t = 0; t < N; ++t)
    if (slots[t] >= 0) pl.cnt[slots[t] + 1]++;
  for (int64_t s = 0; s < L; ++s) pl.cnt[s + 1] += pl.cnt[s];
  const int64_t M = pl.cnt[L];
  if (M == 0 || R == 0) return false;
  pl.order.resize(M);
  pl.pos.assign(pl.cnt.begin(), pl.cnt.end() - 1);
  for (int64_t t = 0; t < N; ++t)  // stable counting sort
    if (slots[t] >= 0) pl.order[pl.pos[slots[t]]++] = (int32_t)t;
  pl.groups.clear();
  pl.big.clear();
  for (int64_t s = 0; s < L; ++s) {
    const int64_t rk = ranks ? ranks[s] : RK, len = pl.cnt[s + 1] - pl.cnt[s];
    if (len > 0 && rk > 0) (big_min > 0 && len >= big_min ? pl.big : pl.groups).push_back({s, pl.cnt[s], len, rk});
  }
  const int64_t G = (int64_t)pl.groups.size();
  if (G == 0) return !pl.big.empty();
  // shrink items: group major, then A's rows in memory order (only the real rank rows), so a thread's
  // share of A is a few long sequential streams (decode is bound by reading A and B from DRAM)
  pl.items.clear();
  pl.item_begin.assign(G + 1, 0);
  for (int64_t g = 0; g < G; ++g) {
    for (int64_t k = 0; k < K; ++k)
      for (int64_t c = 0; c < pl.groups[g].rank; c += 4)
        pl.items.push_back({g, k * RK + c, (int)std::min<int64_t>(4, pl.groups[g].rank - c)});
    pl.item_begin[g + 1] = (int64_t)pl.items.size();
  }
  pl.blocks.clear();
  int64_t o0 = 0;
  for (int64_t k = 0; k < K; ++k) {
    for (int64_t o = 0; o < out_slices[k]; o += block)
      pl.blocks.push_back({o0 + o, std::min<int64_t>(block, out_slices[k] - o), k * RK});
    o0 += out_slices[k];
  }
  pl.h.assign((size_t)M * R, 0.0f);
  return true;
}

// Many groups (decode over many adapters): each thread owns a run of whole groups, in slot order, and
// does their shrink and expand with no barrier, reading a few long streams through A and B. Empty
// (split every group over all threads) when there are fewer groups than threads or the split is uneven.
static inline double group_work(const Group& g, int64_t K, int64_t in, int64_t out) {
  return (double)g.len * (double)(g.rank * K) * (double)(in + out);
}
static void own_groups(Plan& pl, int nth, double total, int64_t K, int64_t in, int64_t out) {
  const int64_t G = (int64_t)pl.groups.size();
  pl.gbeg.clear();
  if (nth <= 1 || G < nth) return;
  pl.gbeg.assign(nth + 1, G);
  pl.gbeg[0] = 0;
  double acc = 0.0, prev = 0.0, worst = 0.0;
  int t = 1;
  for (int64_t g = 0; g < G && t < nth; ++g) {
    acc += group_work(pl.groups[g], K, in, out);
    if (acc >= total * t / nth) {
      worst = std::max(worst, acc - prev);
      prev = acc;
      pl.gbeg[t++] = g + 1;
    }
  }
  worst = std::max(worst, total - prev);
  if (worst > 1.5 * total / nth) pl.gbeg.clear();
}

#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
// ---------------------------------------------------------------- AMX: bf16 groups of many tokens (prefill)
// A group of >= kAmxTokens tokens on one adapter runs on AMX tiles, 16 tokens a tile. Shrink: h = x A^T, with
// x's rows (gathered) as the A operand and the slot's real rank rows of A packed as B tiles (pairs of inputs
// interleaved, 16 rank rows a tile). Expand, per slice: y += h B^T, with h rounded to bf16 (as the vector path
// rounds it) as the A operand and the slice's rank rows of B packed as B tiles (pairs of ranks interleaved, 16
// outputs a tile). Shrunk rows are compact: slice k's rank rows at [k * rkp, k * rkp + rk), rkp = rk rounded
// up to a pair (the pad row of A and rank row of B are packed as zeros). The threads split the groups' token
// tiles; each packs the groups it has tiles of for itself. Needs in % 32 == 0 and rank <= 32.

constexpr int64_t kAmxTokens = 16;

struct AmxShape {
  int64_t rkp, rows, nch;  // rank per slice (even), compact shrunk rows rounded up to 16, input chunks of 32
};

static AmxShape amx_shape(const Group& gr, int64_t K, int64_t in) {
  const int64_t rkp = gr.rank + (gr.rank & 1), rows = (K * rkp + 15) / 16 * 16;
  return {rkp, rows, in / 32};
}

// B tile (jb, c) of the compact A: dword (k2, n) = inputs 32c + 2k2, +1 of compact row 16 jb + n (0 past the
// real rows). a: the slot's A, [R, in]; RK: rank rows per slice in the slot buffer.
static void pack_a_tile(const bf16raw* a, int64_t in, int64_t RK, int64_t K, const Group& gr, const AmxShape& sh,
                        int64_t jb, int64_t c, uint32_t* dst) {
  __m512i r[16];
  for (int n = 0; n < 16; ++n) {
    const int64_t j = 16 * jb + n, k = j / sh.rkp, rr = j % sh.rkp;
    r[n] = k < K && rr < gr.rank ? _mm512_loadu_si512(a + (k * RK + rr) * in + 32 * c) : _mm512_setzero_si512();
  }
  transpose16(r);
  for (int k2 = 0; k2 < 16; ++k2) _mm512_storeu_si512(dst + 16 * k2, r[k2]);
}

// B tile of outputs o..o+15 (n valid) of one slice: dword (k2, o) = (B[2 k2][o], B[2 k2 + 1][o]) of the slot's
// rank-major B (rank row r at b + r * out); rank rows past the real rank are zero
static void pack_b_tile(const bf16raw* b, int64_t out, int64_t rank, int64_t rkp, int64_t n, uint32_t* dst) {
  const __mmask16 m = mask16(n);
  for (int64_t k2 = 0; k2 < rkp / 2; ++k2) {
    const __m512i lo = _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m, b + 2 * k2 * out));
    const __m512i hi = 2 * k2 + 1 < rank ? _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m, b + (2 * k2 + 1) * out))
                                         : _mm512_setzero_si512();
    _mm512_storeu_si512(dst + 16 * k2, _mm512_or_si512(lo, _mm512_slli_epi32(hi, 16)));
  }
}

struct AmxCall {  // one call's operands, as the tiles see them
  bf16raw* y; int64_t ys; const bf16raw* x; int64_t xs; const bf16raw* A; const bf16raw* B;
  int64_t in, out, R, K; const std::vector<int64_t>* slices; const int32_t* order;
};

// per thread: the group's packed A and B, x rows of the tile [16, in], h [16, rows] fp32 and bf16, one C tile
struct AmxScratch {
  std::vector<uint32_t> pa, pb;
  std::vector<bf16raw> x, hb;
  std::vector<float> h;
  alignas(64) float c[16][16];
};

static inline void dp_into(int t) {  // C tile t (0-2) += x tile (3) . A tile (4): tile ids are immediates
  switch (t) {
    case 0: _tile_dpbf16ps(0, 3, 4); break;
    case 1: _tile_dpbf16ps(1, 3, 4); break;
    default: _tile_dpbf16ps(2, 3, 4); break;
  }
}
static inline void store_c(int t, float* p, int64_t stride) {
  switch (t) {
    case 0: _tile_stored(0, p, stride); break;
    case 1: _tile_stored(1, p, stride); break;
    default: _tile_stored(2, p, stride); break;
  }
}

// h [16, rows] = x rows . compact A^T, three C tiles (48 shrunk rows) a pass over x
static void amx_shrink(const AmxCall& a, const uint32_t* pa, const AmxShape& sh, AmxScratch& s) {
  for (int64_t j0 = 0; j0 < sh.rows / 16; j0 += 3) {
    const int nb = static_cast<int>(std::min<int64_t>(3, sh.rows / 16 - j0));
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    for (int64_t c = 0; c < sh.nch; ++c) {
      _tile_loadd(3, s.x.data() + 32 * c, a.in * 2);
      for (int b = 0; b < nb; ++b) {
        _tile_loadd(4, pa + ((j0 + b) * sh.nch + c) * 256, 64);
        dp_into(b);
      }
    }
    for (int b = 0; b < nb; ++b) store_c(b, s.h.data() + 16 * (j0 + b), sh.rows * 4);
  }
  for (int64_t i = 0; i < 16 * sh.rows; i += 16) store16(s.hb.data() + i, _mm512_loadu_ps(s.h.data() + i), 0xFFFF);
}

// C tile 0 or 7 (alternate blocks of the expand) -> c
static inline void store_expand(int t, float (*c)[16]) {
  if (t) _tile_stored(7, c, 64); else _tile_stored(0, c, 64);
}

// y rows of the tile += h . B^T, slice by slice, 16 outputs a C tile (tile 5: h's slice, 6: B, C: 0 and 7 by
// turns, so one block's multiply runs while the last block's sums are added into y)
static void amx_expand(const AmxCall& a, const uint32_t* pb, const AmxShape& sh, const Group& gr, int64_t p0, int n,
                       AmxScratch& s) {
  auto add_block = [&](int tile, int64_t first, int64_t count) {  // C tile -> y[tokens, first .. first + count)
    store_expand(tile, s.c);
    const __mmask16 m = mask16(count);
    for (int i = 0; i < n; ++i) {
      bf16raw* yp = a.y + static_cast<int64_t>(a.order[gr.start + p0 + i]) * a.ys + first;
      store16(yp, _mm512_add_ps(load16(yp, m), _mm512_load_ps(s.c[i])), m);
    }
  };
  int cur = 0;                       // the C tile of the block being multiplied (0: tile 0, 1: tile 7)
  int64_t last = -1, last_count = 0;  // the block before it, still to be added into y
  int64_t o0 = 0;
  for (int64_t k = 0; k < a.K; o0 += (*a.slices)[k++]) {
    const int64_t size = (*a.slices)[k];
    _tile_loadd(5, s.hb.data() + k * sh.rkp, sh.rows * 2);
    for (int64_t o = 0; o < size; o += 16, pb += sh.rkp * 8) {
      _tile_loadd(6, pb, 64);
      if (cur) {
        _tile_zero(7);
        _tile_dpbf16ps(7, 5, 6);
      } else {
        _tile_zero(0);
        _tile_dpbf16ps(0, 5, 6);
      }
      if (last >= 0) add_block(cur ^ 1, last, last_count);
      last = o0 + o, last_count = std::min<int64_t>(16, size - o), cur ^= 1;
    }
  }
  if (last >= 0) add_block(cur ^ 1, last, last_count);
}

// tokens [p0, p0 + 16) of a group (fewer at its end): gathered, shrunk, expanded into y
static void amx_tile(const AmxCall& a, const Group& gr, const AmxShape& sh, int64_t p0, AmxScratch& s) {
  const int n = static_cast<int>(std::min<int64_t>(16, gr.len - p0));
  for (int i = 0; i < n; ++i)  // rows past n keep older finite values: C's rows past n are never stored
    std::memcpy(s.x.data() + i * a.in, a.x + static_cast<int64_t>(a.order[gr.start + p0 + i]) * a.xs, a.in * 2);
  amx_shrink(a, s.pa.data(), sh, s);
  amx_expand(a, s.pb.data(), sh, gr, p0, n, s);
}

static void amx_config(const AmxShape& sh) {
  TileConfig cfg = square_tiles();
  cfg.colsb[5] = static_cast<uint16_t>(sh.rkp * 2);  // h's slice: 16 tokens x rkp ranks
  cfg.rows[6] = static_cast<uint8_t>(sh.rkp / 2);    // B: rkp / 2 pairs of ranks x 16 outputs
  _tile_loadconfig(&cfg);
}

// A group's A and B packed as B tiles, into s (by each thread that has tiles of the group: packing is a small
// part of a tile's work, and a copy of its own saves a barrier and reading the other core's half)
static void amx_pack(const AmxCall& a, const Group& gr, const AmxShape& sh,
                     const std::vector<std::pair<int64_t, int64_t>>& blocks, AmxScratch& s) {
  const int64_t RK = a.R / a.K;
  s.pa.resize(static_cast<size_t>(sh.rows / 16 * sh.nch * 256));
  s.pb.resize(blocks.size() * static_cast<size_t>(sh.rkp * 8));
  for (int64_t i = 0; i < sh.rows / 16 * sh.nch; ++i)
    pack_a_tile(a.A + gr.slot * a.R * a.in, a.in, RK, a.K, gr, sh, i / sh.nch, i % sh.nch, s.pa.data() + i * 256);
  for (size_t ob = 0; ob < blocks.size(); ++ob)
    pack_b_tile(a.B + gr.slot * RK * a.out + blocks[ob].first, a.out, gr.rank, sh.rkp, blocks[ob].second,
                s.pb.data() + ob * sh.rkp * 8);
  s.x.resize(static_cast<size_t>(16 * a.in));
  s.h.resize(static_cast<size_t>(16 * sh.rows));
  s.hb.resize(static_cast<size_t>(16 * sh.rows));
}

// Plan::big's groups: their 16-token tiles in one numbering, a contiguous range of it per thread
static void amx_groups(const Plan& pl, const AmxCall& a, int nth) {
  std::vector<std::pair<int64_t, int64_t>> blocks;  // B tiles: (first output, outputs), slice by slice
  for (int64_t k = 0, o0 = 0; k < a.K; o0 += (*a.slices)[k++])
    for (int64_t o = 0; o < (*a.slices)[k]; o += 16) blocks.push_back({o0 + o, std::min<int64_t>(16, (*a.slices)[k] - o)});
  std::vector<int64_t> tile0{0};  // each group's first tile
  for (const Group& gr : pl.big) tile0.push_back(tile0.back() + (gr.len + 15) / 16);
  const int64_t tiles = tile0.back();
  nth = static_cast<int>(std::min<int64_t>(nth, tiles));  // a thread per token tile at most
#pragma omp parallel num_threads(nth) if (nth > 1)
  {
    static thread_local AmxScratch s;
    const int tid = omp_get_thread_num(), nt = omp_get_num_threads();
    int64_t packed = -1;
    for (int64_t t = tiles * tid / nt; t < tiles * (tid + 1) / nt; ++t) {
      const int64_t g = std::upper_bound(tile0.begin(), tile0.end(), t) - tile0.begin() - 1;
      const AmxShape sh = amx_shape(pl.big[g], a.K, a.in);
      if (g != packed) {
        amx_pack(a, pl.big[g], sh, blocks, s);
        amx_config(sh);
        packed = g;
      }
      amx_tile(a, pl.big[g], sh, 16 * (t - tile0[g]), s);
    }
    if (packed >= 0) _tile_release();
  }
}
#endif

// T: x and y; W: A and B (T, or bf16 under fp32 activations)
template <typename T, typename W>
static void add_lora_impl(T* y, int64_t ys, const T* x, int64_t xs, const W* A, const W* B,
                          const int64_t* slots, int64_t N, int64_t in, int64_t out, int64_t L, int64_t R,
                          int64_t K, const int64_t* ranks, const std::vector<int64_t>& out_slices) {
  constexpr bool kF32 = std::is_same<T, float>::value;
  Plan& pl = thread_plan();
  int64_t big_min = 0;  // groups of this many tokens or more run on AMX (bf16, where built and allowed)
#ifdef LORA_AMX
  if constexpr (!kF32)
    if (in % 32 == 0 && R / K <= 32 && amx_usable()) big_min = kAmxTokens;
#endif
  if (!make_plan(pl, slots, N, L, R, K, ranks, out_slices, kBlock<T>, big_min)) return;
#ifdef LORA_AMX
  if constexpr (!kF32)
    if (!pl.big.empty()) amx_groups(pl, AmxCall{y, ys, x, xs, A, B, in, out, R, K, &out_slices, pl.order.data()},
                                    at::get_num_threads());
#endif
  if (pl.groups.empty()) return;
  const int64_t RK = R / K;  // rank per slice = B's rank rows
  const int64_t M = (int64_t)pl.order.size(), G = (int64_t)pl.groups.size();
  double work = 0.0;
  for (const Group& g : pl.groups) work += group_work(g, K, in, out);
  int nth = at::get_num_threads();
  // Tiny problems skip the fork/join. At batch 1 a projection's adapter (~20-150K weights) comes from DRAM,
  // where a second thread nearly doubles the rate, so the threshold sits below a batch-1 call's work.
  if (work < 2.0e4) nth = 1;
  own_groups(pl, nth, work, K, in, out);
  if (!kF32) {
    pl.hb.resize((size_t)M * R + 1);
    pl.hb.back() = 0;  // read (times a zero B row) as the pair partner of the last token's last row
  }
  const int32_t* order = pl.order.data();
  const Group* groups = pl.groups.data();
  const ShrinkItem* items = pl.items.data();
  const ExpBlock* blocks = pl.blocks.data();
  const int64_t* item_begin = pl.item_begin.data();
  const int64_t nitems = (int64_t)pl.items.size(), nob = (int64_t)pl.blocks.size();
  float* hbuf = pl.h.data();
  bf16raw* hbbuf = pl.hb.data();
  const int64_t B_slot = RK * out;
  const int64_t row_bytes = in * (int64_t)sizeof(W), out_bytes = out * (int64_t)sizeof(W);

  // where a shrink item's A rows and a group's B start: both what the arithmetic reads and what the
  // cursor prefetches
  auto a_rows = [&](const ShrinkItem& si) { return A + (groups[si.g].slot * R + si.r0) * in; };
  auto b_slot = [&](const Group& gr) { return B + gr.slot * B_slot; };
  auto item_lines = [&](int64_t it) { return lines_of(items[it].rt * row_bytes); };
  auto block_lines = [&](int64_t g, int64_t ob) {
    return groups[g].rank * lines_of(blocks[ob].nrows * (int64_t)sizeof(W));
  };
  // Loops run token tiles outside, items / blocks inside: a prefill group's A rows (<= ~110 KB) and B
  // columns stay in L2 across its tiles while x and y are each walked once, row by row (blocks outside
  // walked y down its columns, a 12 KB stride for gate_up: a DTLB miss per line, y 2x through DRAM).
  // The cursor advances on the first tile, where the weights are first read.
  auto shrink_items = [&](Cursor& cur, int64_t g, int64_t i0, int64_t i1) {  // items [i0, i1) of group g
    const Group& gr = groups[g];
    for (int64_t p0 = 0; p0 < gr.len; p0 += 4) {
      const int tt = (int)std::min<int64_t>(4, gr.len - p0);
      const T* xp[4];
      float* hrow[4];
      for (int i = 0; i < tt; ++i) {
        const int64_t p = gr.start + p0 + i;
        xp[i] = x + (int64_t)order[p] * xs;
        hrow[i] = hbuf + p * R;
      }
      for (int64_t it = i0; it < i1; ++it) {
        const ShrinkItem& si = items[it];
        if (p0 == 0) cur.advance(item_lines(it));
        float* hp[4];
        for (int i = 0; i < tt; ++i) hp[i] = hrow[i] + si.r0;
        shrink_dispatch<T, W>(tt, si.rt, xp, a_rows(si), in, hp);
      }
    }
  };
  auto round_group = [&](const Group& gr) {  // bf16: h rows of the group to bf16 (RNE)
    if constexpr (!kF32)
      for (int64_t i = gr.start * R; i < (gr.start + gr.len) * R; i += 16) {
        const __mmask16 m = mask16(gr.start * R + gr.len * R - i);
        store16(hbbuf + i, _mm512_maskz_loadu_ps(m, hbuf + i), m);
      }
  };
  using H = std::conditional_t<kF32, float, bf16raw>;  // the expand's h: fp32, or rounded to bf16
  const H* hsrc;
  if constexpr (kF32) hsrc = hbuf; else hsrc = hbbuf;
  auto expand_blocks = [&](Cursor& cur, int64_t g, int64_t ob0, int64_t ob1) {  // output blocks [ob0, ob1)
    const Group& gr = groups[g];
    const W* bslot = b_slot(gr);
    for (int64_t p0 = 0; p0 < gr.len; p0 += 8) {
      const int tj = (int)std::min<int64_t>(8, gr.len - p0);
      T* yrow[8];
      const H* hrow[8];
      for (int i = 0; i < tj; ++i) {
        yrow[i] = y + (int64_t)order[gr.start + p0 + i] * ys;
        hrow[i] = hsrc + (gr.start + p0 + i) * R;
      }
      for (int64_t ob = ob0; ob < ob1; ++ob) {
        const ExpBlock& eb = blocks[ob];
        if (p0 == 0) cur.advance(block_lines(g, ob));
        T* yp[8];
        const H* hp[8];
        for (int i = 0; i < tj; ++i) yp[i] = yrow[i] + eb.o0, hp[i] = hrow[i] + eb.rlo;
        if constexpr (kF32) expand_dispatch<T, W>(tj, bslot + eb.o0, out, gr.rank, hp, yp, mask16(eb.nrows));
        else expand_dispatch<T, W>(tj, bslot + eb.o0, out, gr.rank, hp, yp, mask32(eb.nrows));
      }
    }
  };
  // the cursor's regions: a shrink item's A rows; a group's B columns for output blocks [ob0, ob1)
  auto add_item = [&](Cursor& cur, int64_t it) { cur.add(a_rows(items[it]), 1, 0, item_lines(it)); };
  auto add_columns = [&](Cursor& cur, const Group& gr, int64_t ob0, int64_t ob1) {
    if (ob0 >= ob1) return;
    const int64_t o0 = blocks[ob0].o0, o1 = blocks[ob1 - 1].o0 + blocks[ob1 - 1].nrows;
    cur.add(b_slot(gr) + o0, gr.rank, out_bytes, lines_of((o1 - o0) * (int64_t)sizeof(W)));
  };
  const int64_t* gbeg = pl.gbeg.empty() ? nullptr : pl.gbeg.data();

#pragma omp parallel num_threads(nth) if (nth > 1)
  {
    const int tid = omp_get_thread_num(), nt = omp_get_num_threads();
    Cursor& cur = thread_cursor();
    cur.reset();
    if (gbeg && nt == nth) {  // each thread: its own groups, shrink then expand (a smaller team: split)
      const int64_t g0 = gbeg[tid], g1 = gbeg[tid + 1];
      for (int64_t g = g0; g < g1; ++g) {
        for (int64_t it = item_begin[g]; it < item_begin[g + 1]; ++it) add_item(cur, it);
        add_columns(cur, groups[g], 0, nob);
      }
      cur.advance(Cursor::kAhead);
      for (int64_t g = g0; g < g1; ++g) {
        shrink_items(cur, g, item_begin[g], item_begin[g + 1]);
        round_group(groups[g]);
        expand_blocks(cur, g, 0, nob);
      }
    } else {
      // ---- 1. shrink, split over items; 2. expand: each thread owns a contiguous range of output blocks
      // and walks it once per group (balanced regardless of group sizes)
      const int64_t it0 = nitems * tid / nt, it1 = nitems * (tid + 1) / nt;
      const int64_t ob0 = nob * tid / nt, ob1 = nob * (tid + 1) / nt;
      for (int64_t it = it0; it < it1; ++it) add_item(cur, it);
      for (int64_t g = 0; g < G; ++g) add_columns(cur, groups[g], ob0, ob1);
      cur.advance(Cursor::kAhead);
      if (it0 < it1)
        for (int64_t g = items[it0].g; g <= items[it1 - 1].g; ++g)
          shrink_items(cur, g, std::max(it0, item_begin[g]), std::min(it1, item_begin[g + 1]));
#pragma omp barrier
#pragma omp for schedule(static)
      for (int64_t g = 0; g < G; ++g) round_group(groups[g]);
      // (implicit barrier)
      for (int64_t g = 0; g < G; ++g) expand_blocks(cur, g, ob0, ob1);
    }
  }
}

}  // namespace

// out_slices: optional sizes of output slices (packed projections, e.g. qkv = [576, 192, 192]): slice k's
// output rows use shrunk rows [k*R/K, (k+1)*R/K). Empty list = one slice.
void add_lora(at::Tensor y, at::Tensor x, at::Tensor lora_a, at::Tensor lora_b,
              at::Tensor token_slots, std::vector<int64_t> out_slices = {},
              c10::optional<at::Tensor> slot_ranks = c10::nullopt) {
  TORCH_CHECK(x.dim() == 2 && y.dim() == 2 && lora_a.dim() == 3 && lora_b.dim() == 3 && token_slots.dim() == 1,
              "add_lora: bad ranks");
  TORCH_CHECK(x.device().is_cpu() && y.device().is_cpu(), "add_lora: CPU only");
  // activations (x, y) and LoRA weights (A, B): both fp32, both bf16, or fp32 activations with bf16 weights
  const auto dt = x.scalar_type(), wt = lora_a.scalar_type();
  TORCH_CHECK(dt == y.scalar_type() && wt == lora_b.scalar_type(), "add_lora: x/y or lora_a/lora_b dtype mismatch");
  TORCH_CHECK((dt == at::kFloat || dt == at::kBFloat16) && (wt == dt || wt == at::kBFloat16),
              "add_lora: fp32 or bf16 activations with LoRA weights of the same dtype or bf16; got ", dt, " and ", wt);
  TORCH_CHECK(token_slots.scalar_type() == at::kLong && token_slots.is_contiguous(), "add_lora: slots int64 contiguous");
  const int64_t N = x.size(0), in = x.size(1), out = y.size(1);
  const int64_t L = lora_a.size(0), R = lora_a.size(1);
  TORCH_CHECK(y.size(0) == N && token_slots.size(0) == N, "add_lora: N mismatch");
  TORCH_CHECK(lora_a.size(2) == in && lora_b.size(0) == L, "add_lora: weight shape mismatch");
  TORCH_CHECK(lora_a.is_contiguous(), "add_lora: lora_a must be contiguous");
  TORCH_CHECK(x.stride(1) == 1 && y.stride(1) == 1, "add_lora: x/y need unit column stride");
  if (N == 0) return;
  const int64_t* sl = token_slots.data_ptr<int64_t>();
  for (int64_t t = 0; t < N; ++t) TORCH_CHECK(sl[t] >= -1 && sl[t] < L, "add_lora: slot out of range");
  if (out_slices.empty()) out_slices.push_back(out);
  const int64_t K = (int64_t)out_slices.size();
  TORCH_CHECK(R % K == 0, "add_lora: lora_a's rows must be divisible by the number of out_slices");
  TORCH_CHECK(lora_b.size(1) == out && lora_b.size(2) == R / K, "add_lora: lora_b must be [L, out, R/K]");
  // rank-major B (LoRALinear's buffers are): any other layout is copied into it, per call
  if (!(lora_b.stride(0) == out * (R / K) && lora_b.stride(1) == 1 && (R / K == 1 || lora_b.stride(2) == out)))
    lora_b = lora_b.transpose(1, 2).contiguous().transpose(1, 2);
  // slot_ranks: real rank r_s <= R/K of each slot (adapters zero-padded to R/K per slice)
  at::Tensor ranks_t;
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
  int64_t total = 0;
  for (int64_t size : out_slices) total += size;
  TORCH_CHECK(total == out, "add_lora: out_slices must sum to out");
  auto* ys = y.data_ptr();
  const auto* xs = x.data_ptr();
  const int64_t y0 = y.stride(0), x0 = x.stride(0);
  if (dt == at::kFloat && wt == at::kFloat)
    add_lora_impl<float, float>((float*)ys, y0, (const float*)xs, x0, lora_a.data_ptr<float>(), lora_b.data_ptr<float>(),
                                sl, N, in, out, L, R, K, ranks, out_slices);
  else if (dt == at::kFloat)
    add_lora_impl<float, bf16raw>((float*)ys, y0, (const float*)xs, x0, (const bf16raw*)lora_a.data_ptr(),
                                  (const bf16raw*)lora_b.data_ptr(), sl, N, in, out, L, R, K, ranks, out_slices);
  else
    add_lora_impl<bf16raw, bf16raw>((bf16raw*)ys, y0, (const bf16raw*)xs, x0, (const bf16raw*)lora_a.data_ptr(),
                                    (const bf16raw*)lora_b.data_ptr(), sl, N, in, out, L, R, K, ranks, out_slices);
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("add_lora", &add_lora, "y += per-token LoRA (in place)", py::arg("y"), py::arg("x"), py::arg("lora_a"),
        py::arg("lora_b"), py::arg("token_slots"), py::arg("out_slices") = std::vector<int64_t>{},
        py::arg("slot_ranks") = py::none(),
        py::call_guard<py::gil_scoped_release>());
}
