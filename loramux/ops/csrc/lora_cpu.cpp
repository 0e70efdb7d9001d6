// Multi-LoRA "add_lora" CPU kernel (fp32 / bf16), AVX-512 (+AVX512_BF16), OpenMP.
//
//   add_lora(y, x, lora_a, lora_b, token_slots, out_slices=[], slot_ranks=None)
//     in-place, returns None
//     x [N,in], y [N,out] (row stride may differ from width; unit column stride)
//     lora_a [L,K*r,in] contiguous; lora_b [L,out,r] stored rank-major: strides (r*out, 1, out), i.e.
//     lora_b.transpose(1, 2) is contiguous (LoRALinear allocates it so); token_slots [N] int64 in [-1,L)
//     K = len(out_slices) (1 if empty); output rows of slice k use the shrunk rows [k*r, (k+1)*r):
//     y[t, rows_k] += lora_b[s, rows_k] @ (lora_a[s, k*r:(k+1)*r] @ x[t])   for s = token_slots[t] >= 0
//     slot_ranks: optional int64 [L], real rank r_s <= r of each slot (zero-padded adapters): only A rows
//     [k*r, k*r + r_s) and B's rank rows [0, r_s) are read; slots of rank 0 are skipped.
//
// Algorithm
//   0. counting sort of token indices by slot -> groups (slot, list of tokens). Works for
//      sorted and unsorted slots; -1 tokens (and rank-0 slots) are dropped.
//   1. shrink: h[p, r] = A[s, r, :] . x[tok(p), :]   (fp32 scratch h [M, K*r])
//      tile = up to 4 tokens x 4 rank-rows, vectorized along `in`; only the slot's real rank rows
//      (bf16: vdpbf16ps, 32 bf16 pairs per instruction, fp32 accumulate)
//   2. expand, per 16-output block (within one slice) and group: B's rank rows hold 16 contiguous
//      outputs each, so for tiles of up to 8 tokens acc[t] += bcast(h[t, r]) * B[s, r, o0:o0+16] and
//      y[t, o0:o0+16] += acc[t] (bf16: B widened to fp32, y rounded RNE). Rank-major B is why: an
//      out-major [out, r] block would need a transpose or a horizontal reduction per block, and a
//      slot of rank r_s < r reads r_s whole rows instead of r_s of every row's r columns.
//   Memory: decode reads every active slot's A and B from DRAM once per call; both passes walk them
//   slot by slot in address order and software-prefetch one work item ahead.
//   Threads: one OpenMP region (uses the libgomp already loaded by torch, same soname),
//   num_threads = at::get_num_threads(); shrink split over (group, rank-chunk) items,
//   expand split over output blocks (balanced regardless of group sizes).
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <omp.h>
#include <cstdint>
#include <vector>
#include <algorithm>
#include <type_traits>

#include "simd.h"

namespace {

// ---------------------------------------------------------------- shrink tiles
// h[t][j] = dot(A row (r0+j), x row t)   for TT tokens, RT rank rows
template <typename T, int TT, int RT>
static inline void shrink_tile(const T* const* xp, const T* ap, int64_t in, float* const* hp) {
  const T* arows[RT];
  for (int j = 0; j < RT; ++j) arows[j] = ap + j * in;
  __m512 acc[TT][RT];
  for (int t = 0; t < TT; ++t)
    for (int j = 0; j < RT; ++j) acc[t][j] = _mm512_setzero_ps();
  dot_tile(xp, arows, in, acc);
  for (int t = 0; t < TT; ++t)
    for (int j = 0; j < RT; ++j) hp[t][j] = _mm512_reduce_add_ps(acc[t][j]);
}

template <typename T, int TT>
static inline void shrink_rt(int rt, const T* const* xp, const T* ap, int64_t in, float* const* hp) {
  switch (rt) {
    case 4: shrink_tile<T, TT, 4>(xp, ap, in, hp); break;
    case 3: shrink_tile<T, TT, 3>(xp, ap, in, hp); break;
    case 2: shrink_tile<T, TT, 2>(xp, ap, in, hp); break;
    default: shrink_tile<T, TT, 1>(xp, ap, in, hp); break;
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
// y[t, 16 outputs] += sum_r h[t][r] * b[r * ld + 0:16]   for TJ tokens (b: rank-major B at the block)
template <typename T, int TJ>
static inline void expand_tile(const T* bt, int64_t ld, int64_t R, const float* const* hp, T* const* yp, __mmask16 om) {
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
template <typename T>
static inline void expand_dispatch(int tj, const T* bt, int64_t ld, int64_t R, const float* const* hp, T* const* yp, __mmask16 om) {
  switch (tj) {
    case 8: expand_tile<T, 8>(bt, ld, R, hp, yp, om); break;
    case 7: expand_tile<T, 7>(bt, ld, R, hp, yp, om); break;
    case 6: expand_tile<T, 6>(bt, ld, R, hp, yp, om); break;
    case 5: expand_tile<T, 5>(bt, ld, R, hp, yp, om); break;
    case 4: expand_tile<T, 4>(bt, ld, R, hp, yp, om); break;
    case 3: expand_tile<T, 3>(bt, ld, R, hp, yp, om); break;
    case 2: expand_tile<T, 2>(bt, ld, R, hp, yp, om); break;
    default: expand_tile<T, 1>(bt, ld, R, hp, yp, om); break;
  }
}


// bf16 path: B stays bf16; pairs of adjacent rank columns form one dword, so a 16-row x 16-col
// bf16 block is a 16 x 8 dword matrix; transpose it to 8 zmm (one per rank pair, 16 rows each)

// one block of up to 16 outputs; its rows use the shrunk rows [rlo, rlo + rw) (rlo = slice * r)
struct ExpBlock { int64_t o0, nrows, rlo, rw; };
struct Group { int64_t slot, start, len, rank; };  // rank: real rank per slice (<= R/K), > 0
struct ShrinkItem { int64_t g, r0; int rt; };       // rank rows [r0, r0 + rt) of group g

static inline void prefetch_lines(const void* p, int64_t bytes, int64_t rows = 1, int64_t stride = 0) {
  const char* c = (const char*)p;
  for (int64_t i = 0; i < rows; ++i)
    for (int64_t off = 0; off < bytes; off += 64) _mm_prefetch(c + i * stride + off, _MM_HINT_T0);
}

template <typename T>
static void add_lora_impl(T* y, int64_t ys, const T* x, int64_t xs, const T* A, const T* B,
                          const int64_t* slots, int64_t N, int64_t in, int64_t out, int64_t L, int64_t R,
                          int64_t K, const int64_t* ranks, const std::vector<ExpBlock>& blocks) {
  const int64_t RK = R / K;  // rank per slice = B's rank rows
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
  std::vector<float> h((size_t)M * R);
  float* hbuf = h.data();
  const int64_t nob = (int64_t)blocks.size();
  int nth = at::get_num_threads();
  if (work < 2.0e5) nth = 1;  // tiny problems: skip the fork/join
  const int64_t B_slot = RK * out, row_bytes = 16 * (int64_t)sizeof(T);

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
      }
    }
    // (implicit barrier)
    // ---- 2. expand: each thread owns a contiguous range of output blocks and walks it once per group
    const int tid = omp_get_thread_num(), nt = omp_get_num_threads();
    const int64_t ob_begin = nob * tid / nt, ob_end = nob * (tid + 1) / nt;
    for (int64_t g = 0; g < G; ++g) {
      const Group& gr = groups[g];
      for (int64_t ob = ob_begin; ob < ob_end; ++ob) {
        const ExpBlock& eb = blocks[ob];
        const __mmask16 om = mask16(eb.nrows);
        const int64_t rw = std::min(eb.rw, gr.rank);  // real rank rows of this slot
        const T* bp = B + gr.slot * B_slot + eb.o0;
        // the next block this thread expands: the next 16 outputs of the same rank rows, or the next group's first
        if (ob + 1 < ob_end) prefetch_lines(bp + 16, row_bytes, rw, out * (int64_t)sizeof(T));
        else if (g + 1 < G)
          prefetch_lines(B + groups[g + 1].slot * B_slot + blocks[ob_begin].o0, row_bytes,
                         std::min(blocks[ob_begin].rw, groups[g + 1].rank), out * (int64_t)sizeof(T));
        for (int64_t p0 = 0; p0 < gr.len; p0 += 8) {
          const int tj = (int)std::min<int64_t>(8, gr.len - p0);
          const float* hp[8];
          T* yp[8];
          for (int i = 0; i < tj; ++i) {
            const int64_t p = gr.start + p0 + i;
            hp[i] = hbuf + p * R + eb.rlo;
            yp[i] = y + (int64_t)order[p] * ys + eb.o0;
          }
          expand_dispatch<T>(tj, bp, out, rw, hp, yp, om);
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
  TORCH_CHECK(lora_a.is_contiguous(), "add_lora: lora_a must be contiguous");
  TORCH_CHECK(x.stride(1) == 1 && y.stride(1) == 1, "add_lora: x/y need unit column stride");
  if (N == 0) return;
  const int64_t* sl = token_slots.data_ptr<int64_t>();
  for (int64_t t = 0; t < N; ++t) TORCH_CHECK(sl[t] >= -1 && sl[t] < L, "add_lora: slot out of range");
  if (out_slices.empty()) out_slices.push_back(out);
  const int64_t K = (int64_t)out_slices.size();
  TORCH_CHECK(R % K == 0, "add_lora: lora_a's rows must be divisible by the number of out_slices");
  TORCH_CHECK(lora_b.size(1) == out && lora_b.size(2) == R / K, "add_lora: lora_b must be [L, out, R/K]");
  TORCH_CHECK(lora_b.stride(0) == out * (R / K) && lora_b.stride(1) == 1 && lora_b.stride(2) == out,
              "add_lora: lora_b must be stored rank-major (lora_b.transpose(1, 2) contiguous)");
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
