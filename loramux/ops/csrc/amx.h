// AMX helpers shared by the CPU kernels that multiply by bf16 tiles (quant_cpu, moe_cpu). Include only where
// __AMX_TILE__ and __AMX_BF16__ are defined (-march=native on a CPU with AMX).
// Part of every kernel's build hash (ops/cpu_extension.py), so a change here rebuilds them.
#pragma once
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>
#include <cstdint>
#include <vector>

#include "simd.h"  // transpose16

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
