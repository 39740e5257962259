// AMX's tiles where the build's CPU has them (-march=native on a Sapphire Rapids or later Xeon): the
// process's permission and each thread's tile configuration, shared by the GEMM (linear.cpp's amx_micro),
// and prefill attention's two products (prefill_attention.cpp's bf16 path). Each call here is 16 query
// rows: every tile register is 16 rows of 64 bytes, and a TDPBF16PS multiplies 16 rows of 32 bf16 by 32
// bf16 "pairs rows" (k two by two, VNNI order) into 16 x 16 float32 sums.
#pragma once
// Only in the AVX-512 build: its key tiles are the 64 keys these calls take.
#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BW__) && defined(CPU_CAPABILITY_AVX512)
#define STREAMBATCH_AMX 1
#include <c10/util/BFloat16.h>
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cstdint>

namespace amx {

using bf16 = c10::BFloat16;

// Linux hands a process AMX's tile state only once asked (arch_prctl ARCH_REQ_XCOMP_PERM for
// XFEATURE_XTILEDATA); oneDNN asks too. A refusal (an old kernel) leaves the float32 path.
inline bool permitted() {
  static const bool granted = syscall(SYS_arch_prctl, 0x1023, 18) == 0;
  return granted;
}

// Every tile 16 rows of 64 bytes; per thread, before its first tile instruction.
inline void configure() {
  struct alignas(64) {
    uint8_t palette = 1, start_row = 0, reserved[14] = {};
    uint16_t colsb[16] = {};
    uint8_t rows[16] = {};
  } config;
  for (int i = 0; i < 8; ++i) config.colsb[i] = 64, config.rows[i] = 16;
  _tile_loadconfig(&config);
}

// dst[0 .. 2n) = a[0], b[0], a[1], b[1], ... for n <= 16 of each (a pair of rows in VNNI order)
inline void interleave(const bf16* a, const bf16* b, bf16* dst, int64_t n) {
  static const __m512i order = [] {
    alignas(64) int16_t index[32];
    for (int i = 0; i < 16; ++i) index[2 * i] = int16_t(i), index[2 * i + 1] = int16_t(32 + i);
    return _mm512_load_si512(index);
  }();
  const __mmask16 mask = n >= 16 ? __mmask16(0xffff) : __mmask16((1u << n) - 1);
  const __m512i low = _mm512_castsi256_si512(_mm256_maskz_loadu_epi16(mask, a));
  const __m512i high = b ? _mm512_castsi256_si512(_mm256_maskz_loadu_epi16(mask, b)) : _mm512_setzero_si512();
  const __mmask32 pairs = n >= 16 ? __mmask32(0xffffffff) : __mmask32((1ull << (2 * n)) - 1);
  _mm512_mask_storeu_epi16(dst, pairs, _mm512_permutex2var_epi16(low, order, high));
}

// Tiles 0-3 hold a call's float32 sums.
inline void zero_sums() {
  _tile_zero(0);
  _tile_zero(1);
  _tile_zero(2);
  _tile_zero(3);
}

// s[16, 64] (row stride 64) = q[16, dim] (row stride dim) . keys, for 64 keys as pairs rows
// [dim / 2][64][2]; dim a multiple of 32.
inline void scores(const bf16* q, const bf16* keys, float* s, int64_t dim) {
  constexpr int64_t K = 64, row = K * 2 * sizeof(bf16);
  zero_sums();
  for (int64_t d = 0; d < dim; d += 32) {
    _tile_loadd(4, q + d, dim * sizeof(bf16));
    const bf16* b = keys + d / 2 * K * 2;
    _tile_loadd(5, b, row);
    _tile_dpbf16ps(0, 4, 5);
    _tile_loadd(6, b + 32, row);
    _tile_dpbf16ps(1, 4, 6);
    _tile_loadd(7, b + 64, row);
    _tile_dpbf16ps(2, 4, 7);
    _tile_loadd(5, b + 96, row);
    _tile_dpbf16ps(3, 4, 5);
  }
  _tile_stored(0, s, K * sizeof(float));
  _tile_stored(1, s + 16, K * sizeof(float));
  _tile_stored(2, s + 32, K * sizeof(float));
  _tile_stored(3, s + 48, K * sizeof(float));
}

// out[16, dim] (row stride dim) = p[16, 64] . values, for 64 keys' values as pairs rows
// [32][dim][2]; dim a multiple of 32. p comes as two bf16 parts, high + low (p's float32 value to
// 16 bits of mantissa): probabilities rounded once to bf16 took the logits twice as far from float32's
// as stock SDPA's bf16 (tests/engine/test_models.py).
inline void values(const bf16* high, const bf16* low, const bf16* values, float* out, int64_t dim) {
  constexpr int64_t K = 64;
  const int64_t row = dim * 2 * sizeof(bf16);
  for (int64_t x0 = 0; x0 < dim; x0 += 64) {
    const bool four = dim - x0 >= 64;  // else two tiles of 16 columns
    zero_sums();
    for (int64_t k = 0; k < K; k += 32) {
      _tile_loadd(4, high + k, K * sizeof(bf16));
      _tile_loadd(5, low + k, K * sizeof(bf16));
      const bf16* b = values + (k / 2 * dim + x0) * 2;
      _tile_loadd(6, b, row);
      _tile_dpbf16ps(0, 4, 6);
      _tile_dpbf16ps(0, 5, 6);
      _tile_loadd(7, b + 32, row);
      _tile_dpbf16ps(1, 4, 7);
      _tile_dpbf16ps(1, 5, 7);
      if (four) {
        _tile_loadd(6, b + 64, row);
        _tile_dpbf16ps(2, 4, 6);
        _tile_dpbf16ps(2, 5, 6);
        _tile_loadd(7, b + 96, row);
        _tile_dpbf16ps(3, 4, 7);
        _tile_dpbf16ps(3, 5, 7);
      }
    }
    _tile_stored(0, out + x0, dim * sizeof(float));
    _tile_stored(1, out + x0 + 16, dim * sizeof(float));
    if (four) {
      _tile_stored(2, out + x0 + 32, dim * sizeof(float));
      _tile_stored(3, out + x0 + 48, dim * sizeof(float));
    }
  }
}

}  // namespace amx
#endif
