// Per-token pointwise ops of a Llama layer (fp32 / bf16), AVX-512: one pass over each row, rounding to
// the storage dtype at the same steps as HF transformers' torch code (see ops/pointwise_torch.py).
//
//   rms_norm(x [N, D], weight [D], eps) -> out [N, D]
//     out = weight * to_dtype(x * rsqrt(mean(x^2) + eps))      (normalized in fp32, rounded, scaled)
//   add_rms_norm(x [N, D], residual [N, D], weight [D], eps) -> (out [N, D], sum [N, D])
//     sum = to_dtype(residual + x) (a decoder layer's residual add), out = rms_norm(sum): one pass per row
//   silu_and_mul(x [N, 2d]) -> out [N, d]
//     out = to_dtype(to_dtype(silu(gate)) * up)                 (gate = x[:, :d], up = x[:, d:])
//   rotary_(q [T, H, Dh], k [T, KVH, Dh], cos [T, Dh], sin [T, Dh])   in place
//     x = to_dtype(to_dtype(x * cos) + to_dtype(rotate_half(x) * sin)), rotate_half(x) = [-x2, x1]
//   argmax(x [N, V] fp32) -> int64 [N]
//     the first index of each row's maximum, a NaN counting as the maximum (torch.argmax): greedy
//     sampling over the vocabulary (torch's own argmax does not vectorize: ~1 ms for 32 x 49152)
// x, q, k: unit last stride, any other strides. Rows (tokens) in parallel when there are many.
#include "torch_api.h"
#include <ATen/Parallel.h>
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "simd.h"

namespace {

// rows per parallel task, ~16k elements each: smaller problems stay on one thread
static inline int64_t grain_rows(int64_t elems_per_row) { return std::max<int64_t>(1, 16384 / std::max<int64_t>(elems_per_row, 1)); }

template <typename T>
static void rms_norm_rows(const T* x, int64_t xs, const T* w, T* out, int64_t n0, int64_t n1, int64_t D, float eps) {
  for (int64_t n = n0; n < n1; ++n) {
    const T* xr = x + n * xs;
    __m512 acc = _mm512_setzero_ps();
    for (int64_t d = 0; d < D; d += 16) {
      const __m512 v = load16(xr + d, mask16(D - d));
      acc = _mm512_fmadd_ps(v, v, acc);
    }
    const __m512 inv = _mm512_set1_ps(1.0f / std::sqrt(_mm512_reduce_add_ps(acc) / (float)D + eps));
    T* orow = out + n * D;
    for (int64_t d = 0; d < D; d += 16) {
      const __mmask16 m = mask16(D - d);
      const __m512 normed = round_as(_mm512_mul_ps(load16(xr + d, m), inv), xr);
      store16(orow + d, _mm512_mul_ps(load16(w + d, m), normed), m);
    }
  }
}

template <typename T>
static void add_rows(const T* x, int64_t xs, const T* r, int64_t rs, T* sum, int64_t n0, int64_t n1, int64_t D) {
  for (int64_t n = n0; n < n1; ++n)
    for (int64_t d = 0; d < D; d += 16) {
      const __mmask16 m = mask16(D - d);
      store16(sum + n * D + d, _mm512_add_ps(load16(r + n * rs + d, m), load16(x + n * xs + d, m)), m);  // rounds as torch
    }
}


// one head's row x [Dh] in place
template <typename T>
static inline void rotate_row(T* x, const T* c, const T* s, int64_t half) {
  for (int64_t i = 0; i < half; i += 16) {
    const __mmask16 m = mask16(half - i);
    const __m512 x1 = load16(x + i, m), x2 = load16(x + half + i, m);
    const __m512 lo = _mm512_add_ps(round_as(_mm512_mul_ps(x1, load16(c + i, m)), x),
                                    round_as(_mm512_mul_ps(_mm512_sub_ps(_mm512_setzero_ps(), x2), load16(s + i, m)), x));
    const __m512 hi = _mm512_add_ps(round_as(_mm512_mul_ps(x2, load16(c + half + i, m)), x),
                                    round_as(_mm512_mul_ps(x1, load16(s + half + i, m)), x));
    store16(x + i, lo, m);
    store16(x + half + i, hi, m);
  }
}

template <typename T>
static void rotary_tokens(at::Tensor& q, at::Tensor& k, const T* cos, const T* sin, int64_t t0, int64_t t1) {
  const int64_t Dh = q.size(2), half = Dh / 2;
  for (at::Tensor* x : {&q, &k}) {
    T* base = (T*)x->data_ptr();
    const int64_t heads = x->size(1), s0 = x->stride(0), s1 = x->stride(1);
    for (int64_t t = t0; t < t1; ++t)
      for (int64_t h = 0; h < heads; ++h) rotate_row<T>(base + t * s0 + h * s1, cos + t * Dh, sin + t * Dh, half);
  }
}

// first index of the row's maximum; a NaN beats every number, so the first NaN wins (as in torch)
static int64_t argmax_row(const float* x, int64_t V) {
  __m512 best = _mm512_set1_ps(-INFINITY);
  __mmask16 nan = 0;
  for (int64_t v = 0; v < V; v += 16) {
    const __mmask16 m = mask16(V - v);
    const __m512 a = _mm512_mask_loadu_ps(best, m, x + v);  // lanes past V keep `best`: they change nothing
    nan |= _mm512_cmp_ps_mask(a, a, _CMP_UNORD_Q);
    best = _mm512_max_ps(best, a);
  }
  if (nan) {
    int64_t i = 0;
    while (!std::isnan(x[i])) ++i;
    return i;
  }
  const __m512 top = _mm512_set1_ps(_mm512_reduce_max_ps(best));
  for (int64_t v = 0; v < V; v += 16) {
    const __mmask16 m = mask16(V - v);
    const __mmask16 hit = _mm512_mask_cmp_ps_mask(m, _mm512_maskz_loadu_ps(m, x + v), top, _CMP_EQ_OQ);
    if (hit) return v + __builtin_ctz(hit);
  }
  return 0;  // unreachable: the maximum is one of the row's values
}

}  // namespace

// x [N, D] and weight [D] as both norms take them; op names the caller in the messages
static void check_norm_args(const at::Tensor& x, const at::Tensor& weight, const char* op) {
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1 && x.device().is_cpu(), op, ": x must be a CPU [N, D] with unit column stride");
  TORCH_CHECK(weight.dim() == 1 && weight.size(0) == x.size(1) && weight.is_contiguous() &&
              weight.scalar_type() == x.scalar_type(), op, ": weight must be [D], contiguous, x's dtype");
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16, op, ": fp32 or bf16 only");
}

// t's data as T (float, or bf16raw for a bf16 tensor)
template <typename T>
static inline T* data_as(const at::Tensor& t) { return (T*)t.data_ptr(); }

at::Tensor rms_norm(at::Tensor x, at::Tensor weight, double eps) {
  check_norm_args(x, weight, "rms_norm");
  const int64_t N = x.size(0), D = x.size(1), xs = x.stride(0);
  auto out = at::empty({N, D}, x.options());
  auto rows = [&](auto zero, int64_t n0, int64_t n1) {
    using T = decltype(zero);
    rms_norm_rows<T>(data_as<T>(x), xs, data_as<T>(weight), data_as<T>(out), n0, n1, D, (float)eps);
  };
  at::parallel_for(0, N, grain_rows(D), [&](int64_t n0, int64_t n1) {
    if (x.scalar_type() == at::kFloat) rows(float{}, n0, n1); else rows(bf16raw{}, n0, n1);
  });
  return out;
}

std::vector<at::Tensor> add_rms_norm(at::Tensor x, at::Tensor residual, at::Tensor weight, double eps) {
  check_norm_args(x, weight, "add_rms_norm");
  TORCH_CHECK(residual.sizes() == x.sizes() && residual.stride(1) == 1 && residual.device().is_cpu() &&
              residual.scalar_type() == x.scalar_type(), "add_rms_norm: residual must be x's shape, dtype and device, "
              "with unit column stride");
  const int64_t N = x.size(0), D = x.size(1), xs = x.stride(0), rs = residual.stride(0);
  auto sum = at::empty({N, D}, x.options());
  auto out = at::empty({N, D}, x.options());
  auto rows = [&](auto zero, int64_t n0, int64_t n1) {  // add, then norm the rows while they are in L1
    using T = decltype(zero);
    add_rows<T>(data_as<T>(x), xs, data_as<T>(residual), rs, data_as<T>(sum), n0, n1, D);
    rms_norm_rows<T>(data_as<T>(sum), D, data_as<T>(weight), data_as<T>(out), n0, n1, D, (float)eps);
  };
  at::parallel_for(0, N, grain_rows(D), [&](int64_t n0, int64_t n1) {
    if (x.scalar_type() == at::kFloat) rows(float{}, n0, n1); else rows(bf16raw{}, n0, n1);
  });
  return {out, sum};
}

at::Tensor silu_and_mul(at::Tensor x) {
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1 && x.size(1) % 2 == 0 && x.device().is_cpu(),
              "silu_and_mul: x must be a CPU [N, 2d] with unit column stride");
  const auto dt = x.scalar_type();
  TORCH_CHECK(dt == at::kFloat || dt == at::kBFloat16, "silu_and_mul: fp32 or bf16 only");
  const int64_t N = x.size(0), d = x.size(1) / 2, xs = x.stride(0);
  auto out = at::empty({N, d}, x.options());
  at::parallel_for(0, N, grain_rows(d), [&](int64_t n0, int64_t n1) {
    if (dt == at::kFloat)
      silu_and_mul_rows<float>(x.data_ptr<float>(), xs, out.data_ptr<float>(), n0, n1, d);
    else
      silu_and_mul_rows<bf16raw>((const bf16raw*)x.data_ptr<at::BFloat16>(), xs, (bf16raw*)out.data_ptr<at::BFloat16>(), n0, n1, d);
  });
  return out;
}

void rotary_(at::Tensor q, at::Tensor k, at::Tensor cos, at::Tensor sin) {
  const auto dt = q.scalar_type();
  TORCH_CHECK(dt == at::kFloat || dt == at::kBFloat16, "rotary_: fp32 or bf16 only");
  TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && q.stride(2) == 1 && k.stride(2) == 1 && q.device().is_cpu() &&
              k.scalar_type() == dt, "rotary_: q, k must be CPU [T, heads, Dh] with unit last stride, one dtype");
  const int64_t T = q.size(0), Dh = q.size(2);
  TORCH_CHECK(Dh % 2 == 0 && k.size(0) == T && k.size(2) == Dh, "rotary_: q and k must share T and an even Dh");
  TORCH_CHECK(cos.sizes() == sin.sizes() && cos.dim() == 2 && cos.size(0) == T && cos.size(1) == Dh &&
              cos.is_contiguous() && sin.is_contiguous() && cos.scalar_type() == dt && sin.scalar_type() == dt,
              "rotary_: cos and sin must be contiguous [T, Dh] in q's dtype");
  at::parallel_for(0, T, grain_rows((q.size(1) + k.size(1)) * Dh), [&](int64_t t0, int64_t t1) {
    if (dt == at::kFloat)
      rotary_tokens<float>(q, k, cos.data_ptr<float>(), sin.data_ptr<float>(), t0, t1);
    else
      rotary_tokens<bf16raw>(q, k, (const bf16raw*)cos.data_ptr<at::BFloat16>(), (const bf16raw*)sin.data_ptr<at::BFloat16>(), t0, t1);
  });
}

at::Tensor argmax(at::Tensor x) {
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1 && x.device().is_cpu() && x.scalar_type() == at::kFloat && x.size(1) > 0,
              "argmax: x must be a non-empty fp32 CPU [N, V] with unit column stride");
  const int64_t N = x.size(0), V = x.size(1), xs = x.stride(0);
  auto out = at::empty({N}, x.options().dtype(at::kLong));
  const float* xp = x.data_ptr<float>();
  int64_t* op = out.data_ptr<int64_t>();
  at::parallel_for(0, N, grain_rows(V), [&](int64_t n0, int64_t n1) {
    for (int64_t n = n0; n < n1; ++n) op[n] = argmax_row(xp + n * xs, V);
  });
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("rms_norm", &rms_norm, "weight * to_dtype(x * rsqrt(mean(x^2) + eps)) per row", py::arg("x"),
        py::arg("weight"), py::arg("eps"), py::call_guard<py::gil_scoped_release>());
  m.def("add_rms_norm", &add_rms_norm, "(rms_norm(residual + x), residual + x)", py::arg("x"), py::arg("residual"),
        py::arg("weight"), py::arg("eps"), py::call_guard<py::gil_scoped_release>());
  m.def("argmax", &argmax, "first index of each row's maximum (NaN counts as the maximum)", py::arg("x"),
        py::call_guard<py::gil_scoped_release>());
  m.def("silu_and_mul", &silu_and_mul, "silu(x[:, :d]) * x[:, d:]", py::arg("x"), py::call_guard<py::gil_scoped_release>());
  m.def("rotary_", &rotary_, "rotate q and k in place (HF apply_rotary_pos_emb)", py::arg("q"), py::arg("k"),
        py::arg("cos"), py::arg("sin"), py::call_guard<py::gil_scoped_release>());
}
