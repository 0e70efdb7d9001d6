// AMX helpers shared by the CPU kernels that multiply by bf16 tiles (quant_cpu, moe_cpu). Include only where
// __AMX_TILE__ and __AMX_BF16__ are defined (-march=native on a CPU with AMX).
// Part of every kernel's build hash (ops/cpu_extension.py), so a change here rebuilds them.
#pragma once
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>
#include <cstdint>
#include <vector>

struct TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// The first n tiles 16 rows x 64 bytes (a full bf16 A or B tile, or an fp32 C tile of 16 x 16)
static inline TileConfig square_tiles(int n = 8) {
  TileConfig cfg;
  for (int t = 0; t < n; ++t) cfg.rows[t] = 16, cfg.colsb[t] = 64;
  return cfg;
}

// Linux hands out the AMX tile state only on request (once per process)
static inline bool amx_usable() {
  static const bool ok = syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XFEATURE_XTILEDATA */) == 0;
  return ok;
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

// x [M, K] bf16 (row stride K) -> [K / 32][tiles][16 pairs][16 rows][2]: the B tile of rows 16t..16t+15,
// inputs 32c..32c+31, in AMX's pair-interleaved layout (a 16 x 16 dword transpose each); rows past M are zero.
// K a multiple of 32.
static inline std::vector<uint32_t> pack_x(const uint16_t* x, int64_t M, int64_t K, int64_t tiles) {
  std::vector<uint32_t> out(static_cast<size_t>(K / 32 * tiles * 256));
  for (int64_t t = 0; t < tiles; ++t)
    for (int64_t c = 0; c < K / 32; ++c) {
      __m512i r[16];
      for (int64_t m = 0; m < 16; ++m)
        r[m] = 16 * t + m < M ? _mm512_loadu_si512(x + (16 * t + m) * K + 32 * c) : _mm512_setzero_si512();
      transpose16(r);  // r[i]: pair i of the tile's 16 rows
      for (int i = 0; i < 16; ++i) _mm512_storeu_si512(out.data() + ((c * tiles + t) * 16 + i) * 16, r[i]);
    }
  return out;
}
