// Decode attention straight from the paged KV cache: one query token per sequence, its
// keys and values read block by block through the block table, never gathered into a
// padded copy. Scores are kept whole per sequence (contexts are at most the model length),
// then a max-subtracted softmax and the weighted sum of V, accumulated in float.
//
// Walking whole blocks keeps integer division out of the inner loops, and ATen's
// Vectorized<float> (AVX2/AVX-512, chosen by the build's CPU_CAPABILITY define) does the
// scores, exp and weighted sums: the kernel's 30 layers of a 16-row SmolLM2 decode step
// went 52 -> 12 ms (AVX-512) from the scalar per-position version. Scores of all query heads
// of a KV head at once and values in independent register accumulators: 21.6-23 -> 19.7-20 ms
// on AVX2 (16 sequences of 250-350 tokens, cold caches). Each next block prefetched: 1.1-1.2x on a
// Zen 5 (16 sequences of 600-1,800 tokens, 64 of 100-600; float32 and bf16; alternating builds). A bf16 cache's keys and
// values widened in registers as they are read, not copied into a float tile first: 1.08-1.18x on
// an AMX Xeon (and float32 1.10-1.15x, the same loops without that copy's branch), same shapes.
// Prefetching into L2 two blocks ahead, a head's tile at a time (see prefetch_ahead): on a Zen 4, 1.33-1.68x
// with a sequence's blocks in order or scattered, float32 and bf16, same shapes (python -m
// ops.bench_decode_attention measures it against the read bandwidth). That was only where the table
// jumps; every block since: on an AMX Xeon, blocks in order 1.13-1.23x (alternating runs), scattered on par.
// The values of a block read once for all the query heads of their KV head (a bf16 cache's widened once, not
// once per head), the sums in registers: on the AMX Xeon, bf16 1.08-1.37x (medians of three alternating runs
// each), float32 within the runs' spread; each head's sum adds up in the same order as before.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>

#include <algorithm>
#include <vector>

#include "attention_tiles.h"

// Sums held in registers at once: with the row's X vectors and a broadcast, within the register file
// (16 vectors with AVX2, 32 with AVX-512).
constexpr int kSums = Vec::size() == 16 ? 16 : 8;

// tile_values over the whole head dimension, X vectors at a time (X = 1 .. kSums / H).
template <int H, typename T, int X = kSums / H>
static inline void heads_values(const float* weights, int64_t stride, const T* values, int64_t lo, int64_t hi,
                                float* acc, int64_t dim, int64_t x0) {
  if constexpr (X > 0) {
    const int64_t left = (dim - x0 + Vec::size() - 1) / Vec::size();
    if (left >= X) {
      tile_values<H, X>(weights, stride, values, lo, hi, acc, dim, x0);
      if (left > X) heads_values<H, T>(weights, stride, values, lo, hi, acc, dim, x0 + X * Vec::size());
    } else {
      heads_values<H, T, X - 1>(weights, stride, values, lo, hi, acc, dim, x0);
    }
  }
}

// The block's values into the sums of `heads` query heads (any number) that share them, up to 4 at a time.
template <typename T>
static inline void block_values(const float* weights, int64_t stride, const T* values, int64_t lo, int64_t hi,
                                float* acc, int64_t heads, int64_t dim) {
  for (int64_t h = 0; h < heads; h += 4) {
    const float* w = weights + h * stride;
    float* a = acc + h * dim;
    switch (std::min<int64_t>(4, heads - h)) {
      case 1: heads_values<1, T>(w, stride, values, lo, hi, a, dim, 0); break;
      case 2: heads_values<2, T>(w, stride, values, lo, hi, a, dim, 0); break;
      case 3: heads_values<3, T>(w, stride, values, lo, hi, a, dim, 0); break;
      default: heads_values<4, T>(w, stride, values, lo, hi, a, dim, 0); break;
    }
  }
}

// Softmax in place over n scores.
static inline void softmax(float* s, int64_t n) {
  const float top = at::vec::reduce_all<float>([](Vec& l, Vec& r) { return at::vec::maximum(l, r); }, s, n);
  at::vec::map([top](Vec x) { return (x - Vec(top)).exp_u20(); }, s, s, n);
  const float total = at::vec::reduce_all<float>([](Vec& l, Vec& r) { return l + r; }, s, n);
  at::vec::map([total](Vec x) { return x / Vec(total); }, s, s, n);
}

// tile_scores for `heads` query heads (any number) over a whole block.
template <typename T>
static inline void block_scores(const float* q, int64_t heads, const T* tile, float* scores, int64_t stride,
                                int64_t dim, int64_t block_size, float scale) {
  constexpr int64_t P = 2;  // position vectors per pass: two, or one where a block fits one vector
  for (int64_t p0 = 0; p0 < block_size; p0 += P * Vec::size()) {
    const bool two = block_size - p0 > Vec::size();
    for (int64_t h = 0; h < heads; h += 4) {
      const float* qh = q + h * dim;
      float* out = scores + h * stride;
      switch (std::min<int64_t>(4, heads - h) * 2 + two) {
        case 2: tile_scores<1, 1, T>(qh, tile, out, stride, dim, block_size, p0, scale); break;
        case 3: tile_scores<1, 2, T>(qh, tile, out, stride, dim, block_size, p0, scale); break;
        case 4: tile_scores<2, 1, T>(qh, tile, out, stride, dim, block_size, p0, scale); break;
        case 5: tile_scores<2, 2, T>(qh, tile, out, stride, dim, block_size, p0, scale); break;
        case 6: tile_scores<3, 1, T>(qh, tile, out, stride, dim, block_size, p0, scale); break;
        case 7: tile_scores<3, 2, T>(qh, tile, out, stride, dim, block_size, p0, scale); break;
        case 8: tile_scores<4, 1, T>(qh, tile, out, stride, dim, block_size, p0, scale); break;
        default: tile_scores<4, 2, T>(qh, tile, out, stride, dim, block_size, p0, scale); break;
      }
    }
  }
}

// Scores of H query heads against two blocks' key tiles of one vector of positions each (a block of 16 with
// AVX-512): two blocks' chains of FMAs interleaved, where one block alone leaves H chains waiting on the FMA
// latency. Each score adds up over the head dimension in tile_scores' order (outer_products), so the scores are
// the same.
// A bf16 cache on a Zen 4, python -m ops.bench_decode_attention in alternating builds, medians of three:
// 1.09-1.22x (16 sequences of 600-1,800 tokens, 64 of 100-600; blocks in order and scattered).
template <int H, typename T>
static inline void pair_scores(const float* q, int64_t dim, const T* tile0, const T* tile1, float* out0, float* out1,
                               int64_t stride, float scale) {
  const int64_t lanes[2] = {Vec::size(), Vec::size()};
  Vec acc[H][2];
#pragma GCC unroll 8
  for (int h = 0; h < H; ++h) acc[h][0] = Vec(0.f), acc[h][1] = Vec(0.f);
  outer_products<H, 2>(q, dim, tile0, Vec::size(), tile1 - tile0, 0, dim, lanes, acc);
#pragma GCC unroll 8
  for (int h = 0; h < H; ++h) {
    (acc[h][0] * Vec(scale)).store(out0 + h * stride);
    (acc[h][1] * Vec(scale)).store(out1 + h * stride);
  }
}

// pair_scores for `heads` query heads (any number), up to 4 at a time.
template <typename T>
static inline void block_pair_scores(const float* q, int64_t heads, const T* tile0, const T* tile1, float* scores0,
                                     float* scores1, int64_t stride, int64_t dim, float scale) {
  for (int64_t h = 0; h < heads; h += 4) {
    const float* qh = q + h * dim;
    const int64_t at = h * stride;
    switch (std::min<int64_t>(4, heads - h)) {
      case 1: pair_scores<1, T>(qh, dim, tile0, tile1, scores0 + at, scores1 + at, stride, scale); break;
      case 2: pair_scores<2, T>(qh, dim, tile0, tile1, scores0 + at, scores1 + at, stride, scale); break;
      case 3: pair_scores<3, T>(qh, dim, tile0, tile1, scores0 + at, scores1 + at, stride, scale); break;
      default: pair_scores<4, T>(qh, dim, tile0, tile1, scores0 + at, scores1 + at, stride, scale); break;
    }
  }
}

// Blocks ahead of the one being read whose tiles are prefetched.
constexpr int64_t kPrefetchAhead = 2;

// Ask for one KV head's tile of block b + kPrefetchAhead to be brought into L2: where the table jumps the
// hardware prefetcher cannot guess it, and where blocks follow each other in memory an Intel core's stops at
// every 4 KiB boundary (a float32 tile of SmolLM2's is 4 KiB). Into L2, not L1, and a tile per head's work rather
// than a block at once: a burst of L1 prefetches fills the core's miss buffers and stalls the loads the
// scores need (prefetching every next block into L1 was 1.3-1.6x slower on a Zen 4).
template <typename T>
static inline void prefetch_ahead(const T* cache, const int64_t* table, int64_t b, int64_t num_blocks, int64_t run,
                                  int64_t offset, int64_t n) {
  const int64_t ahead = b + kPrefetchAhead;
  if (ahead >= num_blocks) return;
  const char* bytes = reinterpret_cast<const char*>(cache + table[ahead] * run + offset);
  for (int64_t i = 0; i < n * int64_t(sizeof(T)); i += 64) __builtin_prefetch(bytes + i, 0, 2);
}

// Caches are per block and KV head: keys as a [dim, block_size] tile, values [block_size, dim].
template <typename T>
static void decode(const T* q, const T* k_cache, const T* v_cache, const int64_t* tables,
                   const int64_t* lens, T* out, int64_t num_seqs, int64_t heads, int64_t kv_heads,
                   int64_t dim, int64_t block_size, int64_t max_blocks, float scale, int64_t window) {
  const int64_t group = heads / kv_heads, tile = dim * block_size;
  // One work item per sequence, all its heads: a block of every head is one contiguous run
  // (kv_heads tiles), which streams from memory faster than one head's tiles alone.
  // Sequences differ in length: hand them out one at a time (torch's own OpenMP pool) rather
  // than in equal contiguous ranges.
#pragma omp parallel num_threads(at::get_num_threads())
  {
    std::vector<float> scores, acc(heads * dim), query(heads * dim);
#pragma omp for schedule(dynamic, 1)
    for (int64_t seq = 0; seq < num_seqs; ++seq) {
      const int64_t len = lens[seq], first = window > 0 ? std::max<int64_t>(0, len - window) : 0;
      const int64_t base = first - first % block_size, padded = (len - base + block_size - 1) / block_size * block_size;
      const int64_t* table = tables + seq * max_blocks + base / block_size;
      const int64_t num_blocks = padded / block_size, skip = first - base, n = len - first, run = kv_heads * tile;
      for (int64_t x = 0; x < heads * dim; ++x) query[x] = float(q[seq * heads * dim + x]);
      // scores[h * padded + j]: query head h, position base + j (whole blocks; only skip .. skip + n - 1 count)
      scores.resize(heads * padded);
      // A narrower cache's blocks of one vector of positions two at a time (pair_scores), the rest one by one:
      // widening its keys makes the scores wait on the FMAs, where float32's wait on memory (paired, 0.9-0.95x).
      const int64_t step = block_size == Vec::size() && !std::is_same_v<T, float> ? 2 : 1;
      for (int64_t b = 0; b < num_blocks; b += step) {
        const bool pair = step == 2 && b + 1 < num_blocks;
        for (int64_t kv = 0; kv < kv_heads; ++kv) {
          const float* qkv = query.data() + kv * group * dim;
          float* kv_scores = scores.data() + kv * group * padded + b * block_size;
          prefetch_ahead(k_cache, table, b, num_blocks, run, kv * tile, tile);
          if (pair) {
            prefetch_ahead(k_cache, table, b + 1, num_blocks, run, kv * tile, tile);
            const T* keys = k_cache + kv * tile;
            block_pair_scores(qkv, group, keys + table[b] * run, keys + table[b + 1] * run, kv_scores,
                              kv_scores + block_size, padded, dim, scale);
          } else {
            block_scores(qkv, group, k_cache + table[b] * run + kv * tile, kv_scores, padded, dim, block_size, scale);
          }
        }
      }
      for (int64_t h = 0; h < heads; ++h) softmax(scores.data() + h * padded + skip, n);
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t b = 0; b < num_blocks; ++b) {
        const int64_t start = b * block_size;
        const int64_t lo = std::max(skip, start) - start, hi = std::min(skip + n, start + block_size) - start;
        for (int64_t kv = 0; kv < kv_heads; ++kv) {
          const T* values = v_cache + table[b] * run + kv * tile;
          prefetch_ahead(v_cache, table, b, num_blocks, run, kv * tile, tile);
          block_values(scores.data() + kv * group * padded + start, padded, values, lo, hi,
                       acc.data() + kv * group * dim, group, dim);
        }
      }
      for (int64_t x = 0; x < heads * dim; ++x) out[seq * heads * dim + x] = T(acc[x]);
    }
  }
}

// q [num_seqs, heads, dim]; k_cache [num_blocks, kv_heads, dim, block_size], v_cache
// [num_blocks, kv_heads, block_size, dim]; tables
// [num_seqs, max_blocks] int64; lens [num_seqs] int64 (context length incl. the new token).
torch::Tensor paged_decode(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                           torch::Tensor tables, torch::Tensor lens, double scale, int64_t window) {
  TORCH_CHECK(q.is_contiguous() && k_cache.is_contiguous() && v_cache.is_contiguous() &&
              tables.is_contiguous() && lens.is_contiguous(), "paged_decode needs contiguous tensors");
  TORCH_CHECK(tables.scalar_type() == torch::kLong && lens.scalar_type() == torch::kLong, "int64 tables and lens");
  auto out = torch::empty_like(q);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "paged_decode", [&] {
    decode<scalar_t>(q.data_ptr<scalar_t>(), k_cache.data_ptr<scalar_t>(), v_cache.data_ptr<scalar_t>(),
                     tables.data_ptr<int64_t>(), lens.data_ptr<int64_t>(), out.data_ptr<scalar_t>(),
                     q.size(0), q.size(1), v_cache.size(1), q.size(2), v_cache.size(2), tables.size(1),
                     static_cast<float>(scale), window);
  });
  return out;
}
