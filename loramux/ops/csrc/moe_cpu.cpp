// Fused experts of a mixture-of-experts block on CPU (fp32 / bf16), grouped by expert. Three calls, with
// the expert LoRA (ops/lora_cpu's add_lora over (slot, expert) pairs) applied between them by the caller:
//
//   experts_up(x [T,H], gate_up [E,2I,H], topk_ids [T,k] int64, token_slots [T] int64 or [0])
//     -> (order [P], offsets [E+1], pair_slots [P], xs [P,H], gu [P,2I])         P = T*k
//     A pair is (token t, choice j), flat index t*k + j. order lists the pairs by expert, stable (tokens
//     ascending within an expert, as the reference's nonzero() finds them); offsets[e] is where expert e's
//     run starts. xs[i] = x[order[i] / k]; gu[run of e] = xs[run] @ gate_up[e]^T, one GEMM per expert.
//     pair_slots[i] = token_slots[t] * E + e, the flat (slot, expert) index of the expert LoRA's buffers
//     viewed [slots * E, ...] (-1: a base token; all -1 when token_slots is empty).
//   experts_down(gu [P,2I], down [E,H,I], offsets) -> (h [P,I], y [P,H])
//     h = silu(gate) * up rounded at the reference's steps (bf16: silu rounded, then the product);
//     y[run of e] = h[run] @ down[e]^T.
//   combine(y [P,H], order, topk_weights [T,k] (x's dtype or fp32)) -> out [T,H] in y's dtype
//     out[t] = sum over t's pairs, in expert order, of to_dtype(y * w), each addition rounded to the
//     dtype: the reference's index_add_ into a zero tensor of x's dtype, expert by expert.
//
// GEMMs: decode gives each expert a few rows (32 tokens x top-4 over 32 experts: ~4), where torch's GEMM
// reads bf16 weights at ~1/3 of DRAM bandwidth and forks its threads per expert. On a CPU with AMX, runs of
// up to 32 rows in bf16 go through AMX tiles instead, every expert's 16-output groups in one parallel
// region: the weights are the A operand straight from memory (16 rows x 32 inputs, no copy), the expert's
// rows packed once as B, C = 16 outputs x 16 rows in fp32 (rounded to bf16 once, as a bf16 GEMM). Longer
// runs (prefill) and fp32 go through torch's GEMM, one per expert. The rest runs here in one pass each,
// rows in parallel: the reference's per-expert chain of small torch ops (nonzero, gathers, silu, mul,
// index_add_) cost ~0.15 ms an expert on two cores.
#include "torch_api.h"
#include <ATen/Parallel.h>
#include <cstdint>
#include <cstring>
#include <tuple>
#include <vector>

#include "simd.h"
#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
#include "amx.h"
#define MOE_AMX 1
#endif

namespace {

// rows per parallel task (~16k elements): small problems stay on one thread
static inline int64_t grain_rows(int64_t elems_per_row) { return std::max<int64_t>(1, 16384 / std::max<int64_t>(elems_per_row, 1)); }

// out[t] = sum over t's pairs (rank[t*k + j] = the pair's position in expert order) in that order
template <typename T, typename W>
static void combine_rows(const T* y, const int64_t* rank, const W* w, T* out, int64_t t0, int64_t t1, int64_t k,
                         int64_t H) {
  std::vector<int64_t> pos(k), idx(k);
  for (int64_t t = t0; t < t1; ++t) {
    for (int64_t j = 0; j < k; ++j) idx[j] = j;
    std::sort(idx.begin(), idx.end(), [&](int64_t a, int64_t b) { return rank[t * k + a] < rank[t * k + b]; });
    T* o = out + t * H;
    for (int64_t d = 0; d < H; d += 16) {
      const __mmask16 m = mask16(H - d);
      __m512 acc = _mm512_setzero_ps();
      for (int64_t j : idx) {
        const float wt = static_cast<float>(w[t * k + j]);
        const __m512 v = round_as(_mm512_mul_ps(load16(y + rank[t * k + j] * H + d, m), _mm512_set1_ps(wt)), o);
        acc = round_as(_mm512_add_ps(acc, v), o);
      }
      store16(o + d, acc, m);
    }
  }
}

template <typename T>
static void gather_rows(const T* x, int64_t xs, const int64_t* order, int64_t k, T* out, int64_t p0, int64_t p1,
                        int64_t H) {
  for (int64_t p = p0; p < p1; ++p) std::memcpy(out + p * H, x + (order[p] / k) * xs, H * sizeof(T));
}

#ifdef MOE_AMX
constexpr int64_t kAmxRows = 32;  // two B tiles of 16 rows

struct AmxRun { int64_t expert, off, n; std::vector<uint32_t> xb; };  // xb: the run's rows packed (pack_x)

// out[off + m, g + i] = sum_k w[e, g + i, k] * in[off + m, k] for the 16 outputs g.. of one run
static void amx_group(const AmxRun& run, const uint16_t* w, int64_t N, int64_t K, int64_t g, uint16_t* out) {
  const int64_t tiles = (run.n + 15) / 16;
  const uint16_t* rows = w + (run.expert * N + g) * K;
  for (int64_t off = 0; off < 16 * K * 2; off += 64)  // the next group's 16 rows: one contiguous stretch
    _mm_prefetch(reinterpret_cast<const char*>(rows + 16 * K) + off, _MM_HINT_T1);
  _tile_zero(0);
  _tile_zero(1);
  for (int64_t c = 0; c < K / 32; ++c) {
    _tile_loadd(2, rows + 32 * c, K * 2);
    _tile_loadd(3, run.xb.data() + c * tiles * 256, 64);
    _tile_dpbf16ps(0, 2, 3);
    if (tiles > 1) {
      _tile_loadd(4, run.xb.data() + (c * tiles + 1) * 256, 64);
      _tile_dpbf16ps(1, 2, 4);
    }
  }
  alignas(64) float acc[16][16];
  for (int64_t t = 0; t < tiles; ++t) {  // C: [16 outputs][16 rows]
    if (t == 0) _tile_stored(0, acc, 64);
    else _tile_stored(1, acc, 64);
    for (int64_t m = 16 * t; m < std::min(run.n, 16 * t + 16); ++m) {
      uint16_t* o = out + (run.off + m) * N + g;
      for (int i = 0; i < 16; i += 8) {  // 8 outputs (one column of C each) per conversion
        __m512 v = _mm512_setr_ps(acc[i][m - 16 * t], acc[i + 1][m - 16 * t], acc[i + 2][m - 16 * t], acc[i + 3][m - 16 * t],
                                  acc[i + 4][m - 16 * t], acc[i + 5][m - 16 * t], acc[i + 6][m - 16 * t], acc[i + 7][m - 16 * t],
                                  0, 0, 0, 0, 0, 0, 0, 0);
        store16(o + i, v, 0xFF);
      }
    }
  }
}

// every run's 16-output groups in one parallel region
static void amx_runs(const std::vector<AmxRun>& runs, const uint16_t* w, int64_t N, int64_t K, uint16_t* out) {
  const int64_t groups = N / 16, items = static_cast<int64_t>(runs.size()) * groups;
  at::parallel_for(0, items, 1, [&](int64_t i0, int64_t i1) {
    const TileConfig cfg = square_tiles(5);
    _tile_loadconfig(&cfg);
    for (int64_t i = i0; i < i1; ++i) amx_group(runs[i / groups], w, N, K, 16 * (i % groups), out);
    _tile_release();
  });
}
#endif

// out[run of e] = in[run of e] @ w[e]^T for every expert with rows (in, out contiguous)
static void per_expert_mm(const at::Tensor& in, const at::Tensor& w, const int64_t* offsets, at::Tensor& out) {
  const int64_t N = w.size(1), K = w.size(2);
#ifdef MOE_AMX
  const bool amx = in.scalar_type() == at::kBFloat16 && w.is_contiguous() && K % 32 == 0 && N % 16 == 0 && amx_usable();
  std::vector<AmxRun> runs;
#else
  const bool amx = false;
#endif
  const uint16_t* x = amx ? reinterpret_cast<const uint16_t*>(in.data_ptr<at::BFloat16>()) : nullptr;
  for (int64_t e = 0; e < w.size(0); ++e) {
    const int64_t n = offsets[e + 1] - offsets[e];
    if (n == 0) continue;
#ifdef MOE_AMX
    if (amx && n <= kAmxRows) {
      runs.push_back({e, offsets[e], n, pack_x(x + offsets[e] * K, n, K, (n + 15) / 16)});
      continue;
    }
#endif
    auto dst = out.narrow(0, offsets[e], n);
    at::mm_out(dst, in.narrow(0, offsets[e], n), w[e].t());
  }
#ifdef MOE_AMX
  if (!runs.empty())
    amx_runs(runs, reinterpret_cast<const uint16_t*>(w.data_ptr<at::BFloat16>()), N, K,
             reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>()));
#endif
}

}  // namespace

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> experts_up(
    at::Tensor x, at::Tensor gate_up, at::Tensor topk_ids, at::Tensor token_slots) {
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1 && x.device().is_cpu(), "experts_up: x must be a CPU [T, H], unit column stride");
  TORCH_CHECK(gate_up.dim() == 3 && gate_up.size(2) == x.size(1) && gate_up.scalar_type() == x.scalar_type(),
              "experts_up: gate_up must be [E, 2I, H] in x's dtype");
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16, "experts_up: fp32 or bf16 only");
  TORCH_CHECK(topk_ids.dim() == 2 && topk_ids.size(0) == x.size(0) && topk_ids.scalar_type() == at::kLong,
              "experts_up: topk_ids must be int64 [T, k]");
  const int64_t T = x.size(0), H = x.size(1), E = gate_up.size(0), k = topk_ids.size(1), P = T * k;
  const bool with_slots = token_slots.numel() > 0;
  TORCH_CHECK(!with_slots || (token_slots.numel() == T && token_slots.scalar_type() == at::kLong),
              "experts_up: token_slots must be int64 [T] or empty");
  auto ids_t = topk_ids.contiguous();
  auto slots_t = token_slots.contiguous();
  const int64_t* ids = ids_t.data_ptr<int64_t>();
  const auto lopt = topk_ids.options().dtype(at::kLong);
  auto order_t = at::empty({P}, lopt), offsets_t = at::zeros({E + 1}, lopt), pslots_t = at::empty({P}, lopt);
  int64_t *order = order_t.data_ptr<int64_t>(), *offsets = offsets_t.data_ptr<int64_t>();
  for (int64_t p = 0; p < P; ++p) {
    TORCH_CHECK(ids[p] >= 0 && ids[p] < E, "experts_up: expert id ", ids[p], " out of range [0, ", E, ")");
    ++offsets[ids[p] + 1];
  }
  for (int64_t e = 0; e < E; ++e) offsets[e + 1] += offsets[e];
  std::vector<int64_t> next(offsets, offsets + E);
  for (int64_t p = 0; p < P; ++p) order[next[ids[p]]++] = p;  // counting sort: stable
  int64_t* pslots = pslots_t.data_ptr<int64_t>();
  const int64_t* tslots = with_slots ? slots_t.data_ptr<int64_t>() : nullptr;
  for (int64_t i = 0; i < P; ++i) {
    const int64_t s = tslots ? tslots[order[i] / k] : -1;
    pslots[i] = s < 0 ? -1 : s * E + ids[order[i]];
  }
  auto xs = at::empty({P, H}, x.options()), gu = at::empty({P, gate_up.size(1)}, x.options());
  AT_DISPATCH_FLOATING_TYPES_AND(at::kBFloat16, x.scalar_type(), "experts_up", [&] {
    at::parallel_for(0, P, grain_rows(H), [&](int64_t p0, int64_t p1) {
      gather_rows(x.data_ptr<scalar_t>(), x.stride(0), order, k, xs.data_ptr<scalar_t>(), p0, p1, H);
    });
  });
  per_expert_mm(xs, gate_up, offsets, gu);
  return {order_t, offsets_t, pslots_t, xs, gu};
}

std::tuple<at::Tensor, at::Tensor> experts_down(at::Tensor gu, at::Tensor down, at::Tensor offsets_t) {
  TORCH_CHECK(gu.dim() == 2 && gu.is_contiguous() && down.dim() == 3 && down.scalar_type() == gu.scalar_type(),
              "experts_down: gu [P, 2I] contiguous, down [E, H, I] in its dtype");
  const int64_t P = gu.size(0), inter = down.size(2), H = down.size(1), E = down.size(0);
  TORCH_CHECK(gu.size(1) == 2 * inter && offsets_t.numel() == E + 1 && offsets_t.scalar_type() == at::kLong,
              "experts_down: shapes do not match");
  offsets_t = offsets_t.contiguous();
  const int64_t* off = offsets_t.data_ptr<int64_t>();
  TORCH_CHECK(off[0] == 0 && off[E] == P, "experts_down: offsets must run from 0 to the number of pairs");
  for (int64_t e = 0; e < E; ++e) TORCH_CHECK(off[e] <= off[e + 1], "experts_down: offsets must not decrease");
  auto h = at::empty({P, inter}, gu.options()), y = at::empty({P, H}, gu.options());
  if (gu.scalar_type() == at::kFloat) {
    at::parallel_for(0, P, grain_rows(2 * inter), [&](int64_t p0, int64_t p1) {
      silu_and_mul_rows(gu.data_ptr<float>(), 2 * inter, h.data_ptr<float>(), p0, p1, inter);
    });
  } else {
    TORCH_CHECK(gu.scalar_type() == at::kBFloat16, "experts_down: fp32 or bf16 only");
    at::parallel_for(0, P, grain_rows(2 * inter), [&](int64_t p0, int64_t p1) {
      silu_and_mul_rows((const bf16raw*)gu.data_ptr<at::BFloat16>(), 2 * inter, (bf16raw*)h.data_ptr<at::BFloat16>(), p0,
                        p1, inter);
    });
  }
  per_expert_mm(h, down, off, y);
  return {h, y};
}

at::Tensor combine(at::Tensor y, at::Tensor order_t, at::Tensor topk_weights) {
  TORCH_CHECK(y.dim() == 2 && y.is_contiguous() && topk_weights.dim() == 2 && order_t.numel() == y.size(0) &&
              topk_weights.numel() == y.size(0), "combine: y [P, H] contiguous, topk_weights [T, k], order [P]");
  const int64_t T = topk_weights.size(0), k = topk_weights.size(1), H = y.size(1), P = y.size(0);
  TORCH_CHECK(order_t.scalar_type() == at::kLong && order_t.is_contiguous(), "combine: order must be int64, contiguous");
  const int64_t* order = order_t.data_ptr<int64_t>();
  std::vector<int64_t> rank(P, -1);  // pair -> its position in expert order
  for (int64_t i = 0; i < P; ++i) {
    TORCH_CHECK(order[i] >= 0 && order[i] < P && rank[order[i]] < 0, "combine: order must be a permutation of the pairs");
    rank[order[i]] = i;
  }
  auto w = topk_weights.contiguous();
  auto out = at::empty({T, H}, y.options());
  const auto wt = w.scalar_type();
  TORCH_CHECK(wt == at::kFloat || wt == y.scalar_type(), "combine: weights in fp32 or y's dtype");
  at::parallel_for(0, T, grain_rows(H * k), [&](int64_t t0, int64_t t1) {
    if (y.scalar_type() == at::kFloat) {
      combine_rows(y.data_ptr<float>(), rank.data(), w.data_ptr<float>(), out.data_ptr<float>(), t0, t1, k, H);
    } else if (wt == at::kFloat) {
      combine_rows((const bf16raw*)y.data_ptr<at::BFloat16>(), rank.data(), w.data_ptr<float>(),
                   (bf16raw*)out.data_ptr<at::BFloat16>(), t0, t1, k, H);
    } else {
      combine_rows((const bf16raw*)y.data_ptr<at::BFloat16>(), rank.data(), w.data_ptr<at::BFloat16>(),
                   (bf16raw*)out.data_ptr<at::BFloat16>(), t0, t1, k, H);
    }
  });
  return out;
}

bool amx_enabled() {  // whether bf16 runs of up to 32 rows go through AMX here (built with it, and the OS allows it)
#ifdef MOE_AMX
  return amx_usable();
#else
  return false;
#endif
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("amx_enabled", &amx_enabled, "whether short bf16 runs use AMX tiles");
  m.def("experts_up", &experts_up, "pairs sorted by expert, their rows and the gate_up GEMMs",
        py::call_guard<py::gil_scoped_release>());
  m.def("experts_down", &experts_down, "silu(gate) * up and the down GEMMs", py::call_guard<py::gil_scoped_release>());
  m.def("combine", &combine, "each token's weighted sum over its experts", py::call_guard<py::gil_scoped_release>());
}
