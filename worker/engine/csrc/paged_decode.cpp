// Decode attention straight from the paged KV cache: one query token per sequence, its
// keys and values read block by block through the block table, never gathered into a
// padded copy. The query heads of a GQA group share each K/V read. Scores are kept whole per item (contexts are at most the model length),
// then a max-subtracted softmax and the weighted sum of V, accumulated in float.
//
// Walking whole blocks keeps integer division out of the inner loops, and ATen's
// Vectorized<float> (AVX2/AVX-512, chosen by the build's CPU_CAPABILITY define) does the
// dot products, exp and axpy: the scalar version of this loop was 5x slower.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>

#include <algorithm>
#include <vector>

using Vec = at::vec::Vectorized<float>;

static inline float dot(const float* a, const float* b, int64_t n) {
  Vec acc(0.f);
  int64_t x = 0;
  for (; x + Vec::size() <= n; x += Vec::size()) acc = at::vec::fmadd(Vec::loadu(a + x), Vec::loadu(b + x), acc);
  float sum = at::vec::vec_reduce_all<float>([](Vec& l, Vec& r) { return l + r; }, acc);
  for (; x < n; ++x) sum += a[x] * b[x];
  return sum;
}

static inline void axpy(float w, const float* x, float* y, int64_t n) {  // y += w * x
  int64_t i = 0;
  for (; i + Vec::size() <= n; i += Vec::size()) at::vec::fmadd(Vec(w), Vec::loadu(x + i), Vec::loadu(y + i)).store(y + i);
  for (; i < n; ++i) y[i] += w * x[i];
}

// Softmax in place over n scores.
static inline void softmax(float* s, int64_t n) {
  const float top = at::vec::reduce_all<float>([](Vec& l, Vec& r) { return at::vec::maximum(l, r); }, s, n);
  at::vec::map([top](Vec x) { return (x - Vec(top)).exp_u20(); }, s, s, n);
  const float total = at::vec::reduce_all<float>([](Vec& l, Vec& r) { return l + r; }, s, n);
  at::vec::map([total](Vec x) { return x / Vec(total); }, s, s, n);
}

// A cache row as float: the row itself for float caches, else converted into `buffer`.
template <typename T>
static inline const float* as_float(const T* row, float* buffer, int64_t n) {
  if constexpr (std::is_same_v<T, float>) {
    return row;
  } else {
    for (int64_t x = 0; x < n; ++x) buffer[x] = float(row[x]);
    return buffer;
  }
}

template <typename T>
static void decode(const T* q, const T* k_cache, const T* v_cache, const int64_t* tables,
                   const int64_t* lens, T* out, int64_t num_seqs, int64_t heads, int64_t kv_heads,
                   int64_t dim, int64_t block_size, int64_t max_blocks, float scale, int64_t window) {
  const int64_t group = heads / kv_heads, row_stride = kv_heads * dim;
  // One work item per sequence: all its KV heads together, so that each block is read as one
  // contiguous run (block_size x kv_heads x dim), which streams from memory at full speed.
  at::parallel_for(0, num_seqs, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores, acc(heads * dim), query(heads * dim), row(row_stride);
    for (int64_t seq = begin; seq < end; ++seq) {
      const int64_t len = lens[seq], first = window > 0 ? std::max<int64_t>(0, len - window) : 0, n = len - first;
      const int64_t* table = tables + seq * max_blocks;
      for (int64_t x = 0; x < heads * dim; ++x) query[x] = float(q[seq * heads * dim + x]);
      scores.resize(heads * n);
      // Visit positions first .. len-1 block by block: fn(index from first, that position's row of all heads).
      auto for_each_row = [&](const T* cache, auto&& fn) {
        for (int64_t start = first - first % block_size; start < len; start += block_size) {
          const T* block = cache + table[start / block_size] * block_size * row_stride;
          if (start + block_size < len)  // the next block is elsewhere in memory: ask for it early
            __builtin_prefetch(cache + table[start / block_size + 1] * block_size * row_stride);
          for (int64_t p = std::max(start, first), stop = std::min(start + block_size, len); p < stop; ++p)
            fn(p - first, as_float(block + (p - start) * row_stride, row.data(), row_stride));
        }
      };
      for_each_row(k_cache, [&](int64_t j, const float* keys) {
        for (int64_t h = 0; h < heads; ++h)
          scores[h * n + j] = dot(query.data() + h * dim, keys + (h / group) * dim, dim) * scale;
      });
      for (int64_t h = 0; h < heads; ++h) softmax(scores.data() + h * n, n);
      std::fill(acc.begin(), acc.end(), 0.f);
      for_each_row(v_cache, [&](int64_t j, const float* values) {
        for (int64_t h = 0; h < heads; ++h) axpy(scores[h * n + j], values + (h / group) * dim, acc.data() + h * dim, dim);
      });
      for (int64_t x = 0; x < heads * dim; ++x) out[seq * heads * dim + x] = T(acc[x]);
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
