// Decode attention straight from the paged KV cache: one query token per sequence, its
// keys and values read block by block through the block table, never gathered into a
// padded copy. Work items are (sequence, KV head); the query heads of a GQA group share
// each K/V read. Scores are kept whole per item (contexts are at most the model length),
// then a max-subtracted softmax and the weighted sum of V, accumulated in float.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <vector>

template <typename T>
static void decode(const T* q, const T* k_cache, const T* v_cache, const int64_t* tables,
                   const int64_t* lens, T* out, int64_t num_seqs, int64_t heads, int64_t kv_heads,
                   int64_t dim, int64_t block_size, int64_t max_blocks, float scale, int64_t window) {
  const int64_t group = heads / kv_heads;
  at::parallel_for(0, num_seqs * kv_heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores, acc(group * dim), query(group * dim);
    for (int64_t item = begin; item < end; ++item) {
      const int64_t seq = item / kv_heads, head = item % kv_heads, len = lens[seq];
      const int64_t first = window > 0 ? std::max<int64_t>(0, len - window) : 0, n = len - first;
      for (int64_t x = 0; x < group * dim; ++x) query[x] = float(q[(seq * heads + head * group) * dim + x]);
      scores.resize(group * n);
      for (int64_t p = first; p < len; ++p) {
        const int64_t slot = tables[seq * max_blocks + p / block_size] * block_size + p % block_size;
        const T* key = k_cache + (slot * kv_heads + head) * dim;
        for (int64_t g = 0; g < group; ++g) {
          const float* qg = query.data() + g * dim;
          float dot = 0.f;
#pragma omp simd reduction(+ : dot)
          for (int64_t x = 0; x < dim; ++x) dot += qg[x] * float(key[x]);
          scores[g * n + (p - first)] = dot * scale;
        }
      }
      for (int64_t g = 0; g < group; ++g) {
        float* s = scores.data() + g * n;
        const float top = *std::max_element(s, s + n);
        float total = 0.f;
        for (int64_t j = 0; j < n; ++j) total += (s[j] = std::exp(s[j] - top));
        for (int64_t j = 0; j < n; ++j) s[j] /= total;
      }
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t p = first; p < len; ++p) {
        const int64_t slot = tables[seq * max_blocks + p / block_size] * block_size + p % block_size;
        const T* value = v_cache + (slot * kv_heads + head) * dim;
        for (int64_t g = 0; g < group; ++g) {
          const float w = scores[g * n + (p - first)];
          float* a = acc.data() + g * dim;
#pragma omp simd
          for (int64_t x = 0; x < dim; ++x) a[x] += w * float(value[x]);
        }
      }
      for (int64_t x = 0; x < group * dim; ++x) out[(seq * heads + head * group) * dim + x] = T(acc[x]);
    }
  });
}

// q [num_seqs, heads, dim]; caches [num_blocks, block_size, kv_heads, dim]; tables
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
                     q.size(0), q.size(1), k_cache.size(2), q.size(2), k_cache.size(1), tables.size(1),
                     static_cast<float>(scale), window);
  });
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) { m.def("paged_decode", &paged_decode); }
