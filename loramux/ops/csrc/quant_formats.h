// The formats of quant_cpu.cpp (the quantized-matmul kernel): each one's decoder, plain and AVX-512, a row's
// layout, and where a kernel's sums go (Out).
// Included by quant_cpu.cpp inside its anonymous namespace, after what it uses; part of every kernel's build hash
// (ops/cpu_extension.py), so a change here rebuilds them.
#pragma once
static inline float f16(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
#ifdef __F16C__
  return _cvtsh_ss(h);  // one instruction (c10::Half's portable conversion is a few dozen)
#else
  return static_cast<float>(c10::Half(h, c10::Half::from_bits()));
#endif
}
static inline float f32(const uint8_t* p) {
  float v;
  std::memcpy(&v, p, 4);
  return v;
}

// ---- decoders: run r (32 weights) of the block at p -> out[32] ---------------------------------------
// 16 bytes of nibbles -> 32 weights a * q (+ b): low nibbles are elements 0-15, high nibbles 16-31.
static inline void nibbles32(const uint8_t* q, float a, float b, int offset, float* out) {
  for (int i = 0; i < 16; ++i) out[i] = a * static_cast<float>((q[i] & 0xF) + offset) + b;
  for (int i = 0; i < 16; ++i) out[i + 16] = a * static_cast<float>((q[i] >> 4) + offset) + b;
}

struct Q8_0 {
  static constexpr int64_t kElems = 32, kBytes = 34;
  static inline void decode(const uint8_t* p, int, float* out) {
    const float d = f16(p);
    const int8_t* q = reinterpret_cast<const int8_t*>(p + 2);
    for (int i = 0; i < 32; ++i) out[i] = static_cast<float>(q[i]) * d;
  }
};

struct Q4_0 {
  static constexpr int64_t kElems = 32, kBytes = 18;
  static inline void decode(const uint8_t* p, int, float* out) {
    nibbles32(p + 2, f16(p), -0.0f, -8, out);  // d * (q - 8) (+ -0: exact, keeps a zero's sign as gguf-py)
  }
};

struct Q4_1 {
  static constexpr int64_t kElems = 32, kBytes = 20;
  static inline void decode(const uint8_t* p, int, float* out) {
    nibbles32(p + 4, f16(p), f16(p + 2), 0, out);
  }
};

// q4_k / q5_k: sub-block j (of 8) has a 6-bit scale and min packed in 12 bytes
static inline void scale_min_k4(int j, const uint8_t* s, int* sc, int* mn) {
  if (j < 4) {
    *sc = s[j] & 63;
    *mn = s[j + 4] & 63;
  } else {
    *sc = (s[j + 4] & 0xF) | ((s[j - 4] >> 6) << 4);
    *mn = (s[j + 4] >> 4) | ((s[j] >> 6) << 4);
  }
}

// q4_k / q5_k run r: its scale d and offset dm (x = d * q - dm, as gguf-py computes them)
static inline void k4_run_scale(const uint8_t* p, int r, float* d, float* dm) {
  int sc, mn;
  scale_min_k4(r, p + 4, &sc, &mn);
  *d = f16(p) * static_cast<float>(sc);
  *dm = f16(p + 2) * static_cast<float>(mn);
}

struct Q4_K {
  static constexpr int64_t kElems = 256, kBytes = 144;
  static inline void decode(const uint8_t* p, int r, float* out) {
    float d, dm;
    k4_run_scale(p, r, &d, &dm);
    const uint8_t* q = p + 16 + (r / 2) * 32;  // runs 2i and 2i+1 share 32 bytes (low, then high nibbles)
    const int shift = (r % 2) * 4;
    for (int i = 0; i < 32; ++i) out[i] = d * static_cast<float>((q[i] >> shift) & 0xF) - dm;
  }
};

struct Q5_K {
  static constexpr int64_t kElems = 256, kBytes = 176;
  static inline void decode(const uint8_t* p, int r, float* out) {
    float d, dm;
    k4_run_scale(p, r, &d, &dm);
    const uint8_t* qh = p + 16;
    const uint8_t* q = p + 48 + (r / 2) * 32;
    const int shift = (r % 2) * 4;
    for (int i = 0; i < 32; ++i) {
      const int v = ((q[i] >> shift) & 0xF) | (((qh[i] >> r) & 1) << 4);
      out[i] = d * static_cast<float>(v) - dm;
    }
  }
};

struct Q6_K {
  static constexpr int64_t kElems = 256, kBytes = 210;
  static inline void decode(const uint8_t* p, int r, float* out) {
    // half h = r / 4 (128 weights): run j = r % 4 takes ql[l + 32 * (j % 2)] nibble (j / 2) and qh bits 2j
    const int h = r / 4, j = r % 4;
    const uint8_t* ql = p + h * 64 + (j % 2) * 32;
    const uint8_t* qh = p + 128 + h * 32;
    const int8_t* scales = reinterpret_cast<const int8_t*>(p + 192) + h * 8;
    const float d = f16(p + 208);
    const int shift = (j / 2) * 4;
    const float d0 = d * static_cast<float>(scales[2 * j]), d1 = d * static_cast<float>(scales[2 * j + 1]);
    for (int i = 0; i < 32; ++i) {
      const int v = (((ql[i] >> shift) & 0xF) | (((qh[i] >> (2 * j)) & 3) << 4)) - 32;
      out[i] = (i < 16 ? d0 : d1) * static_cast<float>(v);
    }
  }
};

struct I8C {  // a block is the whole row: fp32 scale, then K int8
  static constexpr int64_t kElems = 0, kBytes = 0;  // per tensor (see run_format)
  static inline void decode(const uint8_t* p, int r, float* out) {
    const float s = f32(p);
    const int8_t* q = reinterpret_cast<const int8_t*>(p + 4) + r * 32;
    for (int i = 0; i < 32; ++i) out[i] = static_cast<float>(q[i]) * s;
  }
};

struct I4G {  // fp32 a, fp32 b, then G/2 bytes: runs of 32 as q4_0
  static constexpr int64_t kElems = 0, kBytes = 0;
  static inline void decode(const uint8_t* p, int r, float* out) {
    nibbles32(p + 8 + r * 16, f32(p), f32(p + 4), 0, out);
  }
};

// bitsandbytes' 4-bit code books (bitsandbytes.functional.get_4bit_type), in float32.
alignas(64) constexpr float kNF4[16] = {
    -1.0f, -0.6961928009986877f, -0.5250730514526367f, -0.39491748809814453f, -0.28444138169288635f,
    -0.18477343022823334f, -0.09105003625154495f, 0.0f, 0.07958029955625534f, 0.16093020141124725f,
    0.24611230194568634f, 0.33791524171829224f, 0.44070982933044434f, 0.5626170039176941f, 0.7229568362236023f, 1.0f};
alignas(64) constexpr float kFP4[16] = {
    0.0f, 0.0052083334885537624f, 0.6666666865348816f, 1.0f, 0.3333333432674408f, 0.5f, 0.1666666716337204f, 0.25f,
    0.0f, -0.0052083334885537624f, -0.6666666865348816f, -1.0f, -0.3333333432674408f, -0.5f, -0.1666666716337204f,
    -0.25f};

template <const float* Code>
struct Lut4G {  // fp32 absmax, then G/2 bytes: runs of 32 as q4_0
  static constexpr int64_t kElems = 0, kBytes = 0;
  static inline void decode(const uint8_t* p, int r, float* out) {
    const float s = f32(p);
    const uint8_t* q = p + 4 + r * 16;
    for (int i = 0; i < 16; ++i) out[i] = Code[q[i] & 0xF] * s;
    for (int i = 0; i < 16; ++i) out[i + 16] = Code[q[i] >> 4] * s;
  }
};
using NF4G = Lut4G<kNF4>;
using FP4G = Lut4G<kFP4>;

#ifdef __AVX512F__
// AVX-512 decoders: run r of a block -> weights 0-15 (lo) and 16-31 (hi) in registers, the same values as the
// plain decoders above (the same multiplies and adds, each rounded once).
struct W32 {
  __m512 lo, hi;
};
static inline __m512i u8x16i(const uint8_t* p) { return _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)p)); }
static inline __m512 i8x16(const uint8_t* p) { return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)p))); }
static inline __m512 f16x16(const uint8_t* p) {  // the fp16 at p, broadcast
#ifdef __AVX512FP16__
  __m512 r;  // one instruction, the broadcast folded into the load (the shuffle port stays free for the lookups)
  asm("vcvtph2psx %1%{1to16%}, %0" : "=v"(r) : "m"(*reinterpret_cast<const uint16_t*>(p)));
  return r;
#else
  uint16_t h;  // vpbroadcastw + vcvtph2ps
  std::memcpy(&h, p, 2);
  return _mm512_cvtph_ps(_mm256_set1_epi16(static_cast<short>(h)));
#endif
}
static inline W32 decode_v(Q8_0, const uint8_t* p, int) {
  const __m512 d = f16x16(p);
  return {_mm512_mul_ps(i8x16(p + 2), d), _mm512_mul_ps(i8x16(p + 18), d)};
}
// 4-bit formats by table lookup: table[j] = the weight of nibble value j (computed as the plain decoder
// computes a * j + b, so the values are the same), vpermps picks by each lane's low 4 bits.
static inline __m512 iota16() { return _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15); }
static inline W32 lut32(const uint8_t* q, __m512 table) {  // 16 bytes: low nibbles 0-15, high 16-31
  const __m512i v = u8x16i(q);
  return {_mm512_permutexvar_ps(v, table), _mm512_permutexvar_ps(_mm512_srli_epi32(v, 4), table)};
}
static inline W32 decode_v(Q4_0, const uint8_t* p, int) {
  const __m512 q = _mm512_sub_ps(iota16(), _mm512_set1_ps(8.0f));  // exact: q - 8 as gguf-py, then * d
  return lut32(p + 2, _mm512_mul_ps(f16x16(p), q));
}
static inline W32 decode_v(Q4_1, const uint8_t* p, int) {
  return lut32(p + 4, _mm512_add_ps(_mm512_mul_ps(f16x16(p), iota16()), f16x16(p + 2)));
}
// K-quants: a block's scales (d * sc, dmin * mn per run; q6_k: d * scale per 16 weights) are worked out once
// per block of 256 (BlockScales), the runs then broadcast them.
struct BlockScales {
  float d[16], m[8];
};
static inline BlockScales k4_scales(const uint8_t* p) {
  // the 8 six-bit scales and mins unpacked with 32-bit masks (as llama.cpp does; scale_min_k4 one by one
  // took a third of the decode time), then widened and multiplied 8 at a time
  uint32_t u[4];
  std::memcpy(u, p + 4, 12);
  constexpr uint32_t k6 = 0x3f3f3f3f, k4 = 0x0f0f0f0f, k2 = 0x03030303;
  u[3] = ((u[2] >> 4) & k4) | (((u[1] >> 6) & k2) << 4);  // mins 4-7
  const uint32_t mins = u[1] & k6;                          // mins 0-3
  u[1] = (u[2] & k4) | (((u[0] >> 6) & k2) << 4);           // scales 4-7
  u[2] = mins;
  u[0] &= k6;                                               // scales 0-3
  const __m128i bytes = _mm_loadu_si128((const __m128i*)u);  // scales 0-7, then mins 0-7
  const __m256 sc = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(bytes));
  const __m256 mn = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(bytes, 8)));
  BlockScales s;
  _mm256_storeu_ps(s.d, _mm256_mul_ps(_mm256_set1_ps(f16(p)), sc));
  _mm256_storeu_ps(s.m, _mm256_mul_ps(_mm256_set1_ps(f16(p + 2)), mn));
  return s;
}
static inline W32 decode_v(Q4_K, const BlockScales& s, const uint8_t* p, int r) {
  const uint8_t* q = p + 16 + (r / 2) * 32;  // 32 bytes: this run's nibble of each
  const int shift = (r % 2) * 4;
  const __m512 table = _mm512_sub_ps(_mm512_mul_ps(_mm512_set1_ps(s.d[r]), iota16()), _mm512_set1_ps(s.m[r]));
  return {_mm512_permutexvar_ps(_mm512_srli_epi32(u8x16i(q), shift), table),
          _mm512_permutexvar_ps(_mm512_srli_epi32(u8x16i(q + 16), shift), table)};
}
// 32 bytes widened to 32 16-bit lanes; 16-bit lanes -> two fp32 halves
static inline __m512i u8x32w(const uint8_t* p) { return _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i*)p)); }
static inline W32 scaled(__m512i q16, __m512 d_lo, __m512 d_hi, __m512 m) {
  const __m512 lo = _mm512_cvtepi32_ps(_mm512_cvtepi16_epi32(_mm512_castsi512_si256(q16)));
  const __m512 hi = _mm512_cvtepi32_ps(_mm512_cvtepi16_epi32(_mm512_extracti64x4_epi64(q16, 1)));
  return {_mm512_sub_ps(_mm512_mul_ps(d_lo, lo), m), _mm512_sub_ps(_mm512_mul_ps(d_hi, hi), m)};
}
static inline W32 decode_v(Q5_K, const BlockScales& s, const uint8_t* p, int r) {
  const int shift = (r % 2) * 4;
  const __m512i low = _mm512_and_si512(_mm512_srli_epi16(u8x32w(p + 48 + (r / 2) * 32), shift), _mm512_set1_epi16(0xF));
  const __m512i high = _mm512_slli_epi16(_mm512_and_si512(_mm512_srli_epi16(u8x32w(p + 16), r), _mm512_set1_epi16(1)), 4);
  const __m512 d = _mm512_set1_ps(s.d[r]);
  return scaled(_mm512_or_si512(low, high), d, d, _mm512_set1_ps(s.m[r]));
}
static inline BlockScales q6_scales(const uint8_t* p) {
  BlockScales s;
  _mm512_storeu_ps(s.d, _mm512_mul_ps(_mm512_set1_ps(f16(p + 208)), i8x16(p + 192)));
  return s;
}
static inline W32 decode_v(Q6_K, const BlockScales& s, const uint8_t* p, int r) {
  // half h = r / 4 (128 weights): run j = r % 4 takes ql[l + 32 * (j % 2)] nibble (j / 2) and qh bits 2j
  const int h = r / 4, j = r % 4;
  const __m512i low = _mm512_and_si512(_mm512_srli_epi16(u8x32w(p + h * 64 + (j % 2) * 32), (j / 2) * 4),
                                       _mm512_set1_epi16(0xF));
  const __m512i high = _mm512_slli_epi16(_mm512_and_si512(_mm512_srli_epi16(u8x32w(p + 128 + h * 32), 2 * j),
                                                          _mm512_set1_epi16(3)), 4);
  const __m512i q = _mm512_sub_epi16(_mm512_or_si512(low, high), _mm512_set1_epi16(32));
  const int g = h * 8 + 2 * j;  // its two groups of 16
  return scaled(q, _mm512_set1_ps(s.d[g]), _mm512_set1_ps(s.d[g + 1]), _mm512_setzero_ps());  // (- +0: exact)
}
static inline W32 decode_v(I8C, const uint8_t* p, int r) {
  const __m512 s = _mm512_set1_ps(f32(p));
  const uint8_t* q = p + 4 + r * 32;
  return {_mm512_mul_ps(i8x16(q), s), _mm512_mul_ps(i8x16(q + 16), s)};
}
static inline W32 decode_v(I4G, const uint8_t* p, int r) {
  return lut32(p + 8 + r * 16, _mm512_add_ps(_mm512_mul_ps(_mm512_set1_ps(f32(p)), iota16()), _mm512_set1_ps(f32(p + 4))));
}
template <const float* Code>
static inline W32 decode_v(Lut4G<Code>, const uint8_t* p, int r) {  // the table: code * absmax, as decode's
  return lut32(p + 4 + r * 16, _mm512_mul_ps(_mm512_load_ps(Code), _mm512_set1_ps(f32(p))));
}
// What a block's runs share, worked out once per block (none for most formats).
template <typename Dec>
struct BlockState {
  static int make(const uint8_t*) { return 0; }
};
template <> struct BlockState<Q4_K> { static BlockScales make(const uint8_t* p) { return k4_scales(p); } };
template <> struct BlockState<Q5_K> { static BlockScales make(const uint8_t* p) { return k4_scales(p); } };
template <> struct BlockState<Q6_K> { static BlockScales make(const uint8_t* p) { return q6_scales(p); } };
template <typename Dec>
static inline W32 decode_v(Dec dec, int, const uint8_t* p, int r) { return decode_v(dec, p, r); }
#endif

// The shape of one format's rows: block_elems weights in block_bytes, runs of 32 inside.
struct Layout {
  int64_t elems, bytes, row_bytes;
};

// Where a kernel's fp32 sums go: y [M, N] (row stride ld) in x's dtype, plus the bias [N] (fp32) if any,
// rounded once (as the reference's fp32 result + bias, then .to(dtype)). Written by the kernel itself: a
// separate fp32 result and two conversions would cost more than a small call's matmul, ~120 calls a step.
struct Out {
  float* f = nullptr;           // fp32 y, or
  c10::BFloat16* b = nullptr;   // bf16 y
  const float* bias = nullptr;
  int64_t ld = 0;
  inline void put(int64_t m, int64_t n, float v) const {
    if (bias) v += bias[n];
    if (f) f[m * ld + n] = v;
    else b[m * ld + n] = c10::BFloat16(v);
  }
};
