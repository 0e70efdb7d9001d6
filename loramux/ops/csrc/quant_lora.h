// quant_cpu.cpp's fused LoRA call: one row of x (a batch-1 decode), the base matmul and one adapter's LoRA in
// one OpenMP region.
// Included by quant_cpu.cpp inside its anonymous namespace, after what it uses; part of every kernel's build hash
// (ops/cpu_extension.py), so a change here rebuilds them.
#pragma once
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

// A's row j . x (x fp32; A fp32, or bf16 widened): simd.h's tile of one by one
template <typename Wt>
static inline float dot_x(const Wt* a, const float* x, int64_t K) {
  const float* xs[1] = {x};
  const Wt* as[1] = {a};
  __m512 acc[1][1] = {{_mm512_setzero_ps()}};
  dot_tile(xs, as, K, acc);
  return _mm512_reduce_add_ps(acc[0][0]);
}

// y[o0, o1) += sum_r h[r] bt[r * ld + o] (Y: fp32, or bf16 rounded once), as add_lora adds its sums
template <typename Wt, typename Y>
static inline void expand_outputs(const Wt* bt, int64_t ld, int64_t rank, const float* h, Y* y, int64_t o0, int64_t o1) {
  for (int64_t o = o0; o < o1; o += 16) expand_row16(bt + o, ld, rank, h, y + o, mask16(o1 - o));
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
