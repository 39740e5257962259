// What both attention kernels (paged_decode.cpp, prefill_attention.cpp) do tile by tile: read
// cache values as float32 (and write float32 back as the cache's type), and score query rows
// against a tile of keys.
#pragma once
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>

#include <algorithm>
#include <type_traits>

using Vec = at::vec::Vectorized<float>;

// dst[0 .. n) = src[0 .. n) as float, vectorized (a scalar loop here cost a bf16 decode step a
// third of its attention time)
template <typename T>
inline void to_float(const T* src, float* dst, int64_t n) {
  if constexpr (std::is_same_v<T, float>) {
    std::copy_n(src, n, dst);
  } else if constexpr (!c10::is_reduced_floating_point_v<T>) {  // double
    for (int64_t i = 0; i < n; ++i) dst[i] = float(src[i]);
  } else {
    using Narrow = at::vec::Vectorized<T>;
    int64_t i = 0;
    for (; i + Narrow::size() <= n; i += Narrow::size()) {
      const auto [low, high] = at::vec::convert_to_float<T>(Narrow::loadu(src + i));
      low.store(dst + i);
      high.store(dst + i + Vec::size());
    }
    for (; i < n; ++i) dst[i] = float(src[i]);
  }
}

// dst[0 .. n) = T(src[0 .. n)), rounded to nearest even as torch's conversions do
template <typename T>
inline void from_float(const float* src, T* dst, int64_t n) {
  if constexpr (std::is_same_v<T, float>) {
    std::copy_n(src, n, dst);
  } else if constexpr (c10::is_reduced_floating_point_v<T>) {
    int64_t i = 0;
    for (; i + 2 * Vec::size() <= n; i += 2 * Vec::size())
      at::vec::convert_from_float<T>(Vec::loadu(src + i), Vec::loadu(src + i + Vec::size())).store(dst + i);
    for (; i < n; ++i) dst[i] = T(src[i]);
  } else {
    for (int64_t i = 0; i < n; ++i) dst[i] = T(src[i]);
  }
}

// The first n (at most a vector's) values at src as float, the rest 0: a cache of a narrower type
// is widened in registers, so that a kernel reading each value once needs no float copy of it
template <typename T>
inline Vec load_float(const T* src, int64_t n = Vec::size()) {
  if constexpr (std::is_same_v<T, float>) {
    return Vec::loadu(src, n);
  } else {
    if constexpr (c10::is_reduced_floating_point_v<T>) {
      if (n == Vec::size()) {
        Vec out;
        at::vec::load_to_float(src, out);
        return out;
      }
    }
    __at_align__ float part[Vec::size()] = {};  // a partial vector (or double's values)
    for (int64_t i = 0; i < n; ++i) part[i] = float(src[i]);
    return Vec::loadu(part);
  }
}

// acc[h][j] += sum over t in [t0, t1) of a[h * a_stride + t] * b[t * b_stride + j * b_next ..] (lanes[j] of
// vector j, the rest 0; b_next: one vector on, or where another tile's vector lies): H x P independent
// accumulators held in registers, so that the FMA chains over t overlap, and each of b's vectors loaded (and
// widened, for a narrower T) once for all H rows of a.
template <int H, int P, typename T>
inline void outer_products(const float* a, int64_t a_stride, const T* b, int64_t b_stride, int64_t b_next,
                           int64_t t0, int64_t t1, const int64_t* lanes, Vec (&acc)[H][P]) {
  for (int64_t t = t0; t < t1; ++t) {
    Vec row[P];
#pragma GCC unroll 8
    for (int j = 0; j < P; ++j) row[j] = load_float(b + t * b_stride + j * b_next, lanes[j]);
#pragma GCC unroll 8
    for (int h = 0; h < H; ++h) {
      const Vec scalar(a[h * a_stride + t]);
#pragma GCC unroll 8
      for (int j = 0; j < P; ++j) acc[h][j] = at::vec::fmadd(scalar, row[j], acc[h][j]);
    }
  }
}

// acc[h * dim + x0 ..] (X vectors, lanes past dim left alone) += sum over rows j in [lo, hi) of
// weights[h * stride + j] * values[j * dim + x0 ..], for H rows of weights (query heads or positions that
// share the values): each row of values loaded once for all H.
template <int H, int X, typename T = float>
inline void tile_values(const float* weights, int64_t stride, const T* values, int64_t lo, int64_t hi, float* acc,
                        int64_t dim, int64_t x0) {
  int64_t lanes[X];
  Vec sum[H][X];
#pragma GCC unroll 8
  for (int i = 0; i < X; ++i) lanes[i] = std::clamp<int64_t>(dim - x0 - i * Vec::size(), 0, Vec::size());
#pragma GCC unroll 8
  for (int h = 0; h < H; ++h)
#pragma GCC unroll 8
    for (int i = 0; i < X; ++i) sum[h][i] = Vec::loadu(acc + h * dim + x0 + i * Vec::size(), lanes[i]);
  outer_products<H, X>(weights, stride, values + x0, dim, Vec::size(), lo, hi, lanes, sum);
#pragma GCC unroll 8
  for (int h = 0; h < H; ++h)
#pragma GCC unroll 8
    for (int i = 0; i < X; ++i) sum[h][i].store(acc + h * dim + x0 + i * Vec::size(), lanes[i]);
}

// scores[h * stride + p] = scale * q_h . key[p] for H query heads of one KV head (q: H rows of
// dim) and the positions p0 .. p0 + P * V of a transposed key tile [dim, block_size]: vectorized
// across positions (no horizontal sums).
template <int H, int P, typename T = float>
inline void tile_scores(const float* q, const T* tile, float* scores, int64_t stride, int64_t dim,
                        int64_t block_size, int64_t p0, float scale) {
  int64_t lanes[P];
  for (int j = 0; j < P; ++j) lanes[j] = std::clamp<int64_t>(block_size - p0 - j * Vec::size(), 0, Vec::size());
  Vec acc[H][P];
#pragma GCC unroll 8
  for (int h = 0; h < H; ++h)
#pragma GCC unroll 4
    for (int j = 0; j < P; ++j) acc[h][j] = Vec(0.f);
  outer_products<H, P>(q, dim, tile + p0, block_size, Vec::size(), 0, dim, lanes, acc);
  for (int h = 0; h < H; ++h)
    for (int j = 0; j < P; ++j)
      if (lanes[j] > 0) (acc[h][j] * Vec(scale)).store(scores + h * stride + p0 + j * Vec::size(), lanes[j]);
}
