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

// Linux hands out the AMX tile state only on request (once per process)
static inline bool amx_usable() {
  static const bool ok = syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XFEATURE_XTILEDATA */) == 0;
  return ok;
}

// x [M, K] bf16 (row stride K) -> [K / 32][tiles][16 pairs][16 rows][2]: the B tile of rows 16t..16t+15,
// inputs 32c..32c+31, in AMX's pair-interleaved layout; rows past M are zero. K a multiple of 32.
static inline std::vector<uint32_t> pack_x(const uint16_t* x, int64_t M, int64_t K, int64_t tiles) {
  std::vector<uint32_t> out(static_cast<size_t>(K / 32 * tiles * 256), 0);
  for (int64_t c = 0; c < K / 32; ++c)
    for (int64_t m = 0; m < M; ++m)
      for (int64_t i = 0; i < 16; ++i) {
        const uint16_t* pair = x + m * K + 32 * c + 2 * i;
        out[((c * tiles + m / 16) * 16 + i) * 16 + m % 16] = pair[0] | (static_cast<uint32_t>(pair[1]) << 16);
      }
  return out;
}
