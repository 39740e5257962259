// New keys and values into their slots of the paged cache, in one call per layer: two
// index_put calls cost ~100 us a layer in dispatch for the handful of tokens of a decode step.
#include <torch/extension.h>
#include <ATen/Parallel.h>

// A decode step's tokens on every thread: each key's column touches a cache line per value (head_dim lines a
// head), misses that threads wait on together rather than one after the other.
constexpr int64_t kTokensPerTask = 16;

// k_cache [num_blocks, kv_heads, dim, block_size], v_cache [num_blocks, kv_heads, block_size, dim];
// slots [T] int64 (block * block_size + offset); key / value [T, kv_heads, dim], any strides.
void write_kv(torch::Tensor k_cache, torch::Tensor v_cache, torch::Tensor slots, torch::Tensor key,
              torch::Tensor value) {
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous() && slots.is_contiguous(), "write_kv: contiguous caches");
  TORCH_CHECK(slots.scalar_type() == torch::kLong && key.dim() == 3 && key.sizes() == value.sizes(), "write_kv: shapes");
  TORCH_CHECK(key.scalar_type() == k_cache.scalar_type() && value.scalar_type() == v_cache.scalar_type(), "write_kv: dtypes");
  const int64_t tokens = key.size(0), heads = key.size(1), dim = key.size(2), block_size = v_cache.size(2);
  TORCH_CHECK(k_cache.size(1) == heads && k_cache.size(2) == dim && k_cache.size(3) == block_size, "write_kv: cache shape");
  const int64_t* slot = slots.data_ptr<int64_t>();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, key.scalar_type(), "write_kv", [&] {
    const scalar_t* k = key.data_ptr<scalar_t>();
    const scalar_t* v = value.data_ptr<scalar_t>();
    scalar_t* kc = k_cache.data_ptr<scalar_t>();
    scalar_t* vc = v_cache.data_ptr<scalar_t>();
    const auto ks = key.strides(), vs = value.strides();
    at::parallel_for(0, tokens, kTokensPerTask, [&](int64_t begin, int64_t end) {
      for (int64_t t = begin; t < end; ++t) {
        const int64_t block = slot[t] / block_size, offset = slot[t] % block_size;
        for (int64_t h = 0; h < heads; ++h) {
          scalar_t* kt = kc + ((block * heads + h) * dim) * block_size + offset;  // column `offset` of a key tile
          scalar_t* vt = vc + ((block * heads + h) * block_size + offset) * dim;  // row `offset` of a value tile
          for (int64_t x = 0; x < dim; ++x) {
            kt[x * block_size] = k[t * ks[0] + h * ks[1] + x * ks[2]];
            vt[x] = v[t * vs[0] + h * vs[1] + x * vs[2]];
          }
        }
      }
    });
  });
}
