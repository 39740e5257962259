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

// scores[h * stride + p] = scale * q_h . key[p] for H query heads of one KV head (q: H rows of
// dim) and the positions p0 .. p0 + P * V of a transposed key tile [dim, block_size]: vectorized
// across positions (no horizontal sums), H x P independent accumulators so that the FMA chains
// over dim overlap, and each key vector loaded once for all H heads.
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
  for (int64_t x = 0; x < dim; ++x) {
    Vec keys[P];
#pragma GCC unroll 4
    for (int j = 0; j < P; ++j) keys[j] = load_float(tile + x * block_size + p0 + j * Vec::size(), lanes[j]);
#pragma GCC unroll 8
    for (int h = 0; h < H; ++h) {
      const Vec query(q[h * dim + x]);
#pragma GCC unroll 4
      for (int j = 0; j < P; ++j) acc[h][j] = at::vec::fmadd(query, keys[j], acc[h][j]);
    }
  }
  for (int h = 0; h < H; ++h)
    for (int j = 0; j < P; ++j)
      if (lanes[j] > 0) (acc[h][j] * Vec(scale)).store(scores + h * stride + p0 + j * Vec::size(), lanes[j]);
}
