// Prefill attention straight from the paged KV cache: a chunk of new tokens of one sequence (their
// keys and values already written to the cache) against every position each may see: the cached
// prefix, and the chunk itself up to its own position (within the sliding window, if any).
//
// Flash attention's order (Dao et al.): query rows in tiles, keys in tiles, a running maximum and
// sum per row, so no score matrix larger than a tile is ever made, and no tile past the causal
// line is computed. torch's CPU flash kernel, given the explicit mask that a chunk after a cached
// prefix needs, computes every masked score as well (about half of them), and SDPA needs the
// chunk's keys and values gathered out of the blocks first.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>

#include <algorithm>
#include <limits>
#include <optional>
#include <vector>

#include "amx_tiles.h"
#include "attention_tiles.h"

namespace {

constexpr int64_t V = Vec::size();
constexpr int64_t QT = 16;      // query positions per work item; times the KV head's query heads: its rows
constexpr int64_t KV4 = 4;      // vectors of keys per tile, and of head_dim per pass of the value sums
constexpr int64_t KT = KV4 * V;  // keys per tile
// rows per micro-kernel pass: RB x 4 accumulators + 4 loaded vectors + 1 broadcast fit the
// register file (16 registers with AVX2, 32 with AVX-512)
constexpr int RB = V == 16 ? 4 : 2;
constexpr float kMasked = -std::numeric_limits<float>::infinity();

// The micro-kernels over `rows` rows, RB at a time (the last pass with fewer); scores: s[r, 0 .. KT)
// = scale * q[r] . keys[:, 0 .. KT) for rows of q [rows, dim], keys transposed [dim, KT].
template <int R = RB>
inline void scores_rows(int64_t rows, const float* q, int64_t dim, const float* keys, float* s, float scale) {
  if constexpr (R > 0) {
    if (rows == R) return tile_scores<R, KV4>(q, keys, s, KT, dim, KT, 0, scale);
    scores_rows<R - 1>(rows, q, dim, keys, s, scale);
  }
}
template <int R = RB>
inline void values_rows(int64_t rows, const float* p, const float* values, int64_t n, int64_t dim, int64_t x0,
                        float* acc) {
  if constexpr (R > 0) {
    if (rows == R) return tile_values<R, KV4>(p, KT, values, 0, n, acc, dim, x0);
    values_rows<R - 1>(rows, p, values, n, dim, x0, acc);
  }
}

// One row's scores of a key tile -> their exp against the row's running maximum, folded into
// its running sum and (rescaled) accumulator. Keys outside [lo, hi) are masked (weight 0).
inline void online_softmax(float* s, int64_t lo, int64_t hi, float& top, float& total, float* acc, int64_t dim) {
  std::fill(s, s + lo, 0.f);
  std::fill(s + hi, s + KT, 0.f);
  if (hi <= lo) return;
  const float tile_top =
      at::vec::reduce_all<float>([](Vec& l, Vec& r) { return at::vec::maximum(l, r); }, s + lo, hi - lo);
  const float new_top = std::max(top, tile_top);
  at::vec::map([new_top](Vec x) { return (x - Vec(new_top)).exp_u20(); }, s + lo, s + lo, hi - lo);
  const float sum = at::vec::reduce_all<float>([](Vec& l, Vec& r) { return l + r; }, s + lo, hi - lo);
  if (new_top > top) {  // also the first tile seen (top = -inf): the accumulator is zero then
    const float shrink = std::exp(top - new_top);
    at::vec::map([shrink](Vec x) { return x * Vec(shrink); }, acc, acc, dim);
    total *= shrink;
    top = new_top;
  }
  total += sum;
}

#ifdef STREAMBATCH_AMX
static_assert(KT == 64, "amx_tiles.h takes key tiles of 64");

// f[0 .. n) as high + low, each bf16: high = bf16(f), low = bf16(f - high)
inline void split(const float* f, amx::bf16* high, amx::bf16* low, int64_t n) {
  using Narrow = at::vec::Vectorized<amx::bf16>;
  for (int64_t i = 0; i < n; i += 2 * V) {  // n: rows times KT, a multiple of 2 * V
    const Vec a = Vec::loadu(f + i), b = Vec::loadu(f + i + V);
    const Narrow top = at::vec::convert_from_float<amx::bf16>(a, b);
    top.store(high + i);
    const auto [top_a, top_b] = at::vec::convert_to_float<amx::bf16>(top);
    at::vec::convert_from_float<amx::bf16>(a - top_a, b - top_b).store(low + i);
  }
}

// The keys and values of every key tile that the chunk sees, per KV head, as amx_tiles.h's pairs
// rows: gathered once per call, since each query tile reads every key tile up to its own (a
// gather per query tile and key tile cost a quarter of the kernel's time).
struct PairedContext {
  int64_t first_tile, tiles, dim;
  std::vector<amx::bf16> keys, values;  // [kv head][tile]: keys [dim / 2][KT][2], values [KT / 2][dim][2]

  PairedContext(int64_t first_key, int64_t end, int64_t kv_heads, int64_t dim)
      : first_tile(first_key / KT), tiles((end + KT - 1) / KT - first_key / KT), dim(dim),
        keys(kv_heads * tiles * dim * KT), values(kv_heads * tiles * dim * KT) {}

  const amx::bf16* keys_at(int64_t kv, int64_t k0) const { return keys.data() + offset(kv, k0); }
  const amx::bf16* values_at(int64_t kv, int64_t k0) const { return values.data() + offset(kv, k0); }
  int64_t offset(int64_t kv, int64_t k0) const { return (kv * tiles + k0 / KT - first_tile) * dim * KT; }

  // Key tile `index` of KV head kv, positions before `end`, from caches per block and KV head (keys
  // [dim, block_size], values [block_size, dim]); the pairs past `end` stay zero.
  void gather(int64_t kv, int64_t index, const amx::bf16* k_cache, const amx::bf16* v_cache, const int64_t* blocks,
              int64_t block_size, int64_t kv_heads, int64_t end) {
    const int64_t k0 = (first_tile + index) * KT, tile = dim * block_size, run = kv_heads * tile;
    amx::bf16* paired_keys = keys.data() + offset(kv, k0);
    amx::bf16* paired_values = values.data() + offset(kv, k0);
    for (int64_t p = k0; p < std::min(k0 + KT, end);) {  // block by block
      const int64_t block = blocks[p / block_size], offset = p % block_size, n = std::min(block_size - offset, end - p);
      const amx::bf16* key_tile = k_cache + block * run + kv * tile;
      for (int64_t x = 0; x < dim; x += 2)
        for (int64_t i = 0; i < n; i += 16)
          amx::interleave(key_tile + x * block_size + offset + i, key_tile + (x + 1) * block_size + offset + i,
                          paired_keys + (x / 2 * KT + p - k0 + i) * 2, std::min<int64_t>(16, n - i));
      // block sizes are even and tiles start at multiples of KT: a pair of positions shares a block
      const amx::bf16* value_rows = v_cache + block * run + kv * tile + offset * dim;
      for (int64_t j = 0; j < n; j += 2)
        for (int64_t x = 0; x < dim; x += 16)
          amx::interleave(value_rows + j * dim + x, j + 1 < n ? value_rows + (j + 1) * dim + x : nullptr,
                          paired_values + ((p - k0 + j) / 2 * dim + x) * 2, 16);
      p += n;
    }
  }
};
#endif

// q and out [tokens, heads, dim]; caches per block and KV head: keys as a [dim, block_size] tile,
// values [block_size, dim]; blocks: the sequence's block table; computed: its positions before the chunk.
// bf16 on a CPU with AMX (and head_dim a multiple of 32): both products on AMX tiles, the
// probabilities as two bf16 parts for the second; else float32 FMAs.
template <typename T>
void prefill(const T* q, const T* k_cache, const T* v_cache, const int64_t* blocks, T* out, int64_t tokens,
             int64_t heads, int64_t kv_heads, int64_t dim, int64_t block_size, int64_t computed, float scale,
             int64_t window) {
  const int64_t group = heads / kv_heads, tiles = (tokens + QT - 1) / QT, tile = dim * block_size;
  const int64_t run = kv_heads * tile, most_rows = QT * group;
#ifdef STREAMBATCH_AMX
  constexpr bool bf16 = std::is_same_v<T, c10::BFloat16>;
  const bool on_amx = bf16 && dim % 32 == 0 && block_size % 2 == 0 && amx::permitted();
  std::optional<PairedContext> context;
  if (on_amx) context.emplace(window > 0 ? std::max<int64_t>(0, computed - window + 1) : 0, computed + tokens, kv_heads, dim);
#else
  constexpr bool on_amx = false;
#endif
#pragma omp parallel num_threads(at::get_num_threads())
  {
    std::vector<float> query(most_rows * dim), acc(most_rows * dim), s(most_rows * KT), keys(dim * KT),
        values(KT * dim), top(most_rows), total(most_rows);
#ifdef STREAMBATCH_AMX
    std::vector<amx::bf16> query_bf16, high, low;  // [most_rows, dim]; the probabilities' parts [most_rows, KT]
    std::vector<float> products;  // [16, dim]
    if constexpr (bf16) {
      if (on_amx) {
        query_bf16.resize(most_rows * dim), high.resize(most_rows * KT), low.resize(most_rows * KT);
        products.resize(16 * dim);
        amx::configure();
#pragma omp for schedule(dynamic, 1)
        for (int64_t item = 0; item < kv_heads * context->tiles; ++item)
          context->gather(item % kv_heads, item / kv_heads, k_cache, v_cache, blocks, block_size, kv_heads,
                          computed + tokens);
      }
    }
#endif
    // One work item per query tile and KV head, the latest tiles (the most keys) first, handed
    // out one at a time: the threads end together although the items' work differs.
#pragma omp for schedule(dynamic, 1)
    for (int64_t item = 0; item < tiles * kv_heads; ++item) {
      const int64_t t0 = (tiles - 1 - item / kv_heads) * QT, kv = item % kv_heads;
      const int64_t rows = std::min(QT, tokens - t0) * group;  // row r: position computed + t0 + r / group
      for (int64_t r = 0; r < rows; ++r) {
        const T* row = q + ((t0 + r / group) * heads + kv * group + r % group) * dim;
#ifdef STREAMBATCH_AMX
        if constexpr (bf16) {
          if (on_amx) {
            std::copy_n(row, dim, query_bf16.data() + r * dim);
            continue;
          }
        }
#endif
        to_float(row, query.data() + r * dim, dim);
      }
      std::fill(acc.begin(), acc.end(), 0.f);
      std::fill(top.begin(), top.end(), kMasked);
      std::fill(total.begin(), total.end(), 0.f);
      const int64_t first = computed + t0, last = first + rows / group - 1;  // the tile's query positions
      const int64_t seen = window > 0 ? std::max<int64_t>(0, first - window + 1) : 0;  // the first key any row sees
      for (int64_t k0 = seen - seen % KT; k0 <= last; k0 += KT) {
        const int64_t keys_in_tile = std::min(KT, last + 1 - k0);
        for (int64_t p = k0; !on_amx && p < k0 + keys_in_tile;) {  // the tile's keys and values, block by block
          const int64_t block = blocks[p / block_size], offset = p % block_size;
          const int64_t n = std::min(block_size - offset, k0 + keys_in_tile - p);
          const T* key_tile = k_cache + block * run + kv * tile;
          for (int64_t x = 0; x < dim; ++x) to_float(key_tile + x * block_size + offset, keys.data() + x * KT + p - k0, n);
          to_float(v_cache + block * run + kv * tile + offset * dim, values.data() + (p - k0) * dim, n * dim);
          p += n;
        }
#ifdef STREAMBATCH_AMX
        if constexpr (bf16) {
          if (on_amx) {
            for (int64_t r0 = 0; r0 < rows; r0 += 16)
              amx::scores(query_bf16.data() + r0 * dim, context->keys_at(kv, k0), s.data() + r0 * KT, dim);
            at::vec::map([scale](Vec x) { return x * Vec(scale); }, s.data(), s.data(), rows * KT);
          }
        }
#endif
        if (!on_amx)
          for (int64_t r0 = 0; r0 < rows; r0 += RB)
            scores_rows(std::min<int64_t>(RB, rows - r0), query.data() + r0 * dim, dim, keys.data(), s.data() + r0 * KT,
                        scale);
        for (int64_t r = 0; r < rows; ++r) {
          const int64_t position = first + r / group;
          const int64_t hi = std::clamp<int64_t>(position + 1 - k0, 0, keys_in_tile);
          const int64_t lo = window > 0 ? std::clamp<int64_t>(position - window + 1 - k0, 0, hi) : 0;
          online_softmax(s.data() + r * KT, lo, hi, top[r], total[r], acc.data() + r * dim, dim);
        }
#ifdef STREAMBATCH_AMX
        if constexpr (bf16) {
          if (on_amx) {
            split(s.data(), high.data(), low.data(), rows * KT);
            for (int64_t r0 = 0; r0 < rows; r0 += 16) {
              amx::values(high.data() + r0 * KT, low.data() + r0 * KT, context->values_at(kv, k0), products.data(),
                          dim);
              const int64_t n = std::min<int64_t>(16, rows - r0) * dim;
              at::vec::map2([](Vec a, Vec b) { return a + b; }, acc.data() + r0 * dim, acc.data() + r0 * dim,
                            products.data(), n);
            }
            continue;
          }
        }
#endif
        for (int64_t x0 = 0; x0 < dim; x0 += KV4 * V)
          for (int64_t r0 = 0; r0 < rows; r0 += RB)
            values_rows(std::min<int64_t>(RB, rows - r0), s.data() + r0 * KT, values.data(), keys_in_tile, dim, x0,
                        acc.data() + r0 * dim);
      }
      for (int64_t r = 0; r < rows; ++r) {
        T* row = out + ((t0 + r / group) * heads + kv * group + r % group) * dim;
        for (int64_t x = 0; x < dim; ++x) row[x] = T(acc[r * dim + x] / total[r]);
      }
    }
#ifdef STREAMBATCH_AMX
    if (on_amx) _tile_release();
#endif
  }
}

}  // namespace

// q and out [tokens, heads, dim], contiguous, of the caches' type; k_cache [num_blocks, kv_heads,
// dim, block_size], v_cache [num_blocks, kv_heads, block_size, dim]; blocks int64 [>= ceil((computed
// + tokens) / block_size)]; window 0 for none. Writes out.
void prefill_attention(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache, torch::Tensor blocks,
                       int64_t computed, double scale, int64_t window, torch::Tensor out) {
  TORCH_CHECK(q.is_contiguous() && out.is_contiguous() && k_cache.is_contiguous() && v_cache.is_contiguous() &&
                  blocks.is_contiguous(), "prefill_attention needs contiguous tensors");
  TORCH_CHECK(q.dim() == 3 && out.sizes() == q.sizes() && out.scalar_type() == q.scalar_type() &&
                  k_cache.scalar_type() == q.scalar_type() && v_cache.scalar_type() == q.scalar_type(),
              "prefill_attention: q and out [tokens, heads, dim] of the caches' type");
  TORCH_CHECK(blocks.scalar_type() == torch::kLong, "prefill_attention: int64 blocks");
  const int64_t tokens = q.size(0), block_size = v_cache.size(2);
  TORCH_CHECK(blocks.numel() * block_size >= computed + tokens, "prefill_attention: too few blocks for the positions");
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "prefill_attention", [&] {
    prefill<scalar_t>(q.data_ptr<scalar_t>(), k_cache.data_ptr<scalar_t>(), v_cache.data_ptr<scalar_t>(),
                      blocks.data_ptr<int64_t>(), out.data_ptr<scalar_t>(), tokens, q.size(1), v_cache.size(1),
                      q.size(2), block_size, computed, static_cast<float>(scale), window);
  });
}
