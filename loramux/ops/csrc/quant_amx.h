// quant_cpu.cpp's AMX path: bf16 activations of 2 to kAmxWideRows rows on AMX tiles.
// Included by quant_cpu.cpp inside its anonymous namespace, after what it uses; part of every kernel's build hash
// (ops/cpu_extension.py), so a change here rebuilds them.
#pragma once
#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512F__)
// ---- AMX (bf16 activations, 2..kAmxRows rows of x): y^T = W x^T by tiles --------------------------------
// The weights are the A operand (16 rows of W x 32 inputs: a decoded run of each row, rounded to bf16 as a
// bf16 model's weights are, is one row of A: no transposition), x^T the B operand (x packed once per call in
// AMX's pair-interleaved layout), and C holds 16 outputs x 16 rows of x in fp32. The decode is the fused
// path's, so the weights still stream once; the multiply no longer grows with the rows of x.

// q4_k runs 2p and 2p+1 of one row, as bf16, into a[2p][i] and a[2p+1][i]: they share 32 bytes (low and
// high nibbles) and one 32-entry table (bf16(d * j - m) of each run, rounded as the fp32 decode is), looked up
// by vpermw: decode_v's values rounded to bf16, without widening to fp32 lanes
static inline void q4_k_bf16_pair(const BlockScales& s, const uint8_t* p, int pair, uint16_t (*a)[16][32], int i) {
  const __m512 lo = _mm512_sub_ps(_mm512_mul_ps(_mm512_set1_ps(s.d[2 * pair]), iota16()), _mm512_set1_ps(s.m[2 * pair]));
  const __m512 hi = _mm512_sub_ps(_mm512_mul_ps(_mm512_set1_ps(s.d[2 * pair + 1]), iota16()), _mm512_set1_ps(s.m[2 * pair + 1]));
  const __m512i table = (__m512i)_mm512_cvtne2ps_pbh(hi, lo);  // 0-15: run 2p, 16-31: run 2p+1
  const __m512i v = u8x32w(p + 16 + 32 * pair);
  const __m512i low = _mm512_and_si512(v, _mm512_set1_epi16(0xF));
  const __m512i high = _mm512_or_si512(_mm512_srli_epi16(v, 4), _mm512_set1_epi16(0x10));
  _mm512_storeu_si512(a[2 * pair][i], _mm512_permutexvar_epi16(low, table));
  _mm512_storeu_si512(a[2 * pair + 1][i], _mm512_permutexvar_epi16(high, table));
}

// C[h][t] += A[h] B[t0 + t] over n runs: tiles 0-3 hold C (W rows 16h.., x rows 16(t0 + t)..), 4-5 the decoded
// A of the two halves, 6-7 x's B tiles. Each B tile loaded serves both halves (x's packed tiles, 128 KB at K =
// 2048, come from L2: loading them once per 16 rows of W cost as much as the multiplies).
static inline void amx_multiply(uint16_t (*const a[2])[16][32], bool two, const uint32_t* xb, int64_t tiles,
                                int64_t chunk, int r0, int n, int64_t t0 = 0) {
  for (int r = r0; r < r0 + n; ++r) {
    _tile_loadd(4, a[0][r], 64);
    if (two) _tile_loadd(5, a[1][r], 64);
    _tile_loadd(6, xb + ((chunk + r) * tiles + t0) * 256, 64);
    _tile_dpbf16ps(0, 4, 6);
    if (two) _tile_dpbf16ps(2, 5, 6);
    if (t0 + 1 < tiles) {
      _tile_loadd(7, xb + ((chunk + r) * tiles + t0 + 1) * 256, 64);
      _tile_dpbf16ps(1, 4, 7);
      if (two) _tile_dpbf16ps(3, 5, 7);
    }
  }
}

// One block of each of the pass's rows (row 16h + i's at blocks[h][i]), from run r0: its runs decoded to bf16
// a chunk at a time (q4_k: the two runs that share bytes) for all rows, each chunk multiplied before the next
// is decoded, so the vector decode of one overlaps the tile multiplies of the last.
template <typename Dec, int... C>
static inline void amx_block(const uint8_t* const (*blocks)[16], const int* rows, int r0, uint16_t (*const a[2])[16][32],
                             const uint32_t* xb, int64_t tiles, int64_t chunk, std::integer_sequence<int, C...>) {
  constexpr int kChunk = std::is_same<Dec, Q4_K>::value ? 2 : 1;
  using State = decltype(BlockState<Dec>::make(nullptr));
  State st[2][16];
  for (int h = 0; h < 2; ++h)
    for (int i = 0; i < rows[h]; ++i) st[h][i] = BlockState<Dec>::make(blocks[h][i]);
  auto step = [&](auto cc) {
    constexpr int c = decltype(cc)::value;
    for (int h = 0; h < 2; ++h)
      for (int i = 0; i < rows[h]; ++i) {
        if constexpr (kChunk == 2) {
          q4_k_bf16_pair(st[h][i], blocks[h][i], c, a[h], i);
        } else {
          const W32 w = decode_v(Dec{}, st[h][i], blocks[h][i], r0 + c);
          _mm512_storeu_si512(a[h][c][i], (__m512i)_mm512_cvtne2ps_pbh(w.hi, w.lo));
        }
      }
    if (xb) amx_multiply(a, rows[1] > 0, xb, tiles, chunk, c * kChunk, kChunk);  // null: decode only
  };
  (step(std::integral_constant<int, C>{}), ...);
}

// C tile (h, t) -> y rows 16t.., outputs g + 16h..: column m of C is row m of y's 16 outputs, gathered in
// L1, then one store (storing each value down y's columns, a row stride apart, took a fifth of the call)
static inline void amx_store(int h, int64_t t, int rows, int64_t M, int64_t g, const Out& y) {
  alignas(64) float c[16][16];
  switch (2 * h + t) {
    case 0: _tile_stored(0, c, 64); break;
    case 1: _tile_stored(1, c, 64); break;
    case 2: _tile_stored(2, c, 64); break;
    default: _tile_stored(3, c, 64); break;
  }
  for (int64_t m = 16 * t; m < std::min(M, 16 * t + 16); ++m) {
    alignas(64) float col[16];
    for (int i = 0; i < 16; ++i) col[i] = c[i][m - 16 * t];
    put_row16(y, m, g + 16 * h, mask16(rows), _mm512_load_ps(col));
  }
}

// Bytes [lo, hi) of rows [r0, r1) of W into L2. 32 interleaved row streams are more than the hardware
// prefetchers follow, so each step asks for its slice of the next 32 rows: a slice per step, in pace with the
// decode (asking for 32 rows at once overran the queue of misses in flight).
static inline void prefetch_slice(const uint8_t* w, int64_t row_bytes, int64_t r0, int64_t r1, int64_t lo, int64_t hi) {
  for (int64_t row = r0; row < r1; ++row)
    for (int64_t off = lo & ~int64_t{63}; off < hi; off += 64) _mm_prefetch((const char*)(w + row * row_bytes + off), _MM_HINT_T1);
}

template <typename Dec>
constexpr int kAmxRuns = Dec::kElems > 0 ? static_cast<int>(Dec::kElems / 32) : 1;  // runs decoded per step

// The rows of W in each half (16, 16 or fewer) of the pass at row g of [n0, n1)
static inline void pass_rows(int64_t g, int64_t n1, int (&rows)[2]) {
  rows[0] = static_cast<int>(std::min<int64_t>(16, n1 - g));
  rows[1] = static_cast<int>(std::clamp<int64_t>(n1 - g - 16, 0, 16));
}

// Inputs [k, k + 32 kAmxRuns) of the pass's rows at g, decoded into a (each run at a[h][run - k / 32]) and, where xb
// is given, multiplied into the C tiles; the next pass's rows asked for a slice at a time
template <typename Dec>
static inline void amx_step(const uint8_t* w, const Layout& L, int64_t K, int64_t g, int64_t n1, const int (&rows)[2],
                            int64_t k, uint16_t (*const a[2])[16][32], const uint32_t* xb, int64_t tiles) {
  constexpr int kChunks = std::is_same<Dec, Q4_K>::value ? kAmxRuns<Dec> / 2 : kAmxRuns<Dec>;
  prefetch_slice(w, L.row_bytes, g + 32, std::min(g + 64, n1), L.row_bytes * k / K,
                 L.row_bytes * (k + 32 * kAmxRuns<Dec>) / K);
  const uint8_t* blocks[2][16];
  for (int h = 0; h < 2; ++h)
    for (int i = 0; i < rows[h]; ++i) blocks[h][i] = w + (g + 16 * h + i) * L.row_bytes + k / L.elems * L.bytes;
  amx_block<Dec>(blocks, rows, static_cast<int>(k % L.elems / 32), a, xb, tiles, k / 32,
                 std::make_integer_sequence<int, kChunks>{});
}

// rows [n0, n1) of W, 32 at a time (two halves of 16)
template <typename Dec>
static void amx_rows(const uint32_t* xb, int64_t M, int64_t K, const uint8_t* w, const Layout& L, int64_t n0,
                     int64_t n1, const Out& y) {
  const int64_t tiles = (M + 15) / 16;
  const TileConfig cfg = square_tiles();
  _tile_loadconfig(&cfg);
  alignas(64) static thread_local uint16_t buf[2][kAmxRuns<Dec>][16][32];  // [half][run][row of W][input]
  uint16_t (*const a[2])[16][32] = {buf[0], buf[1]};
  for (int64_t g = n0; g < n1; g += 32) {
    int rows[2];
    pass_rows(g, n1, rows);
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    for (int64_t k = 0; k < K; k += 32 * kAmxRuns<Dec>) amx_step<Dec>(w, L, K, g, n1, rows, k, a, xb, tiles);
    for (int h = 0; h < 2; ++h)
      for (int64_t t = 0; t < tiles && rows[h] > 0; ++t) amx_store(h, t, rows[h], M, g, y);
  }
  _tile_release();
}

// More than kAmxRows rows of x (prefill): rows [n0, n1) of W, 32 at a time, each block of 32 rows decoded whole
// into bf16 tiles once (as amx_rows decodes it, the next rows prefetched alike), then multiplied by x 32 rows
// at a time, C in tiles over all of K. The decode no longer overlaps the tiles, but serves every row of x.
template <typename Dec>
static void amx_wide_rows(const uint32_t* xb, int64_t M, int64_t K, const uint8_t* w, const Layout& L, int64_t n0,
                          int64_t n1, const Out& y) {
  const int64_t tiles = (M + 15) / 16, runs = K / 32;
  const TileConfig cfg = square_tiles();
  _tile_loadconfig(&cfg);
  static thread_local std::vector<uint16_t> buf;  // [half][run][row of W][input]
  buf.resize(static_cast<size_t>(2 * runs * 512));
  uint16_t (*const whole[2])[16][32] = {reinterpret_cast<uint16_t (*)[16][32]>(buf.data()),
                                        reinterpret_cast<uint16_t (*)[16][32]>(buf.data() + runs * 512)};
  for (int64_t g = n0; g < n1; g += 32) {
    int rows[2];
    pass_rows(g, n1, rows);
    for (int64_t k = 0; k < K; k += 32 * kAmxRuns<Dec>) {
      uint16_t (*const a[2])[16][32] = {whole[0] + k / 32, whole[1] + k / 32};
      amx_step<Dec>(w, L, K, g, n1, rows, k, a, nullptr, 0);
    }
    for (int64_t t0 = 0; t0 < tiles; t0 += 2) {
      _tile_zero(0);
      _tile_zero(1);
      _tile_zero(2);
      _tile_zero(3);
      amx_multiply(whole, rows[1] > 0, xb, tiles, 0, 0, static_cast<int>(runs), t0);
      Out part = y;  // x rows 16 t0.. of y
      if (part.f) part.f += 16 * t0 * y.ld; else part.b += 16 * t0 * y.ld;
      const int64_t m = std::min<int64_t>(32, M - 16 * t0);
      for (int h = 0; h < 2; ++h)
        for (int64_t t = 0; t < (m + 15) / 16 && rows[h] > 0; ++t) amx_store(h, t, rows[h], m, g, part);
    }
  }
  _tile_release();
}

template <typename Dec>
static void amx(const at::Tensor& x, const uint8_t* w, const Layout& L, int64_t N, int64_t K, const Out& y) {
  const int64_t M = x.size(0);
  const std::vector<uint32_t> xb = pack_x(reinterpret_cast<const uint16_t*>(x.data_ptr<c10::BFloat16>()), M, K, (M + 15) / 16);
  const int64_t groups = (N + 31) / 32;
  at::parallel_for(0, groups, grain_of(groups), [&](int64_t a, int64_t b) {
    if (M <= kAmxRows) amx_rows<Dec>(xb.data(), M, K, w, L, 32 * a, std::min(N, 32 * b), y);
    else amx_wide_rows<Dec>(xb.data(), M, K, w, L, 32 * a, std::min(N, 32 * b), y);
  });
}
#endif
