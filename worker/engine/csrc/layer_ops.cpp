// The decoder layer's small ops, each one pass over its rows instead of a chain of torch ops (eager
// mode: each op of a chain is a dispatch, an allocation and a pass over memory, and in bf16 a
// conversion to float and back). Each gives what transformers' module computes, with its roundings:
//   rms_norm:     weight * T(x * rsqrt(mean(x^2) + eps))        (LlamaRMSNorm: float sums)
//   silu_and_mul: T(silu(gate)) * up, for [gate | up] rows      (LlamaMLP's act_fn(gate) * up)
// in float for float32 (only the sum of squares adds up in another order), and rounded to T where
// the module's bf16 ops round.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>

#include <cmath>
#include <type_traits>
#include <vector>

#include "attention_tiles.h"

namespace {

constexpr int64_t kRowsPerTask = 8;

// f[0 .. n) = float(T(f)): the rounding of an intermediate that the module's op keeps in T
template <typename T>
void round_to(float* f, T* scratch, int64_t n) {
  if constexpr (!std::is_same_v<T, float>) {
    from_float(f, scratch, n);
    to_float(scratch, f, n);
  }
}

template <typename T>
void rms_norm_rows(const T* x, const T* weight, T* out, int64_t rows, int64_t n, float eps) {
  std::vector<float> w(n);
  to_float(weight, w.data(), n);
  at::parallel_for(0, rows, kRowsPerTask, [&](int64_t begin, int64_t end) {
    std::vector<float> f(n);
    for (int64_t r = begin; r < end; ++r) {
      to_float(x + r * n, f.data(), n);
      const float squares = at::vec::map_reduce_all<float>([](Vec v) { return v * v; },
                                                           [](Vec a, Vec b) { return a + b; }, f.data(), n);
      const float scale = 1.f / std::sqrt(squares / float(n) + eps);
      at::vec::map([scale](Vec v) { return v * Vec(scale); }, f.data(), f.data(), n);
      round_to(f.data(), out + r * n, n);
      at::vec::map2([](Vec v, Vec g) { return g * v; }, f.data(), f.data(), w.data(), n);
      from_float(f.data(), out + r * n, n);
    }
  });
}

template <typename T>
void silu_and_mul_rows(const T* x, T* out, int64_t rows, int64_t n) {
  at::parallel_for(0, rows, kRowsPerTask, [&](int64_t begin, int64_t end) {
    std::vector<float> gate(n), up(n);
    for (int64_t r = begin; r < end; ++r) {
      to_float(x + r * 2 * n, gate.data(), n);
      to_float(x + r * 2 * n + n, up.data(), n);
      at::vec::map([](Vec g) { return g / (Vec(1.f) + g.neg().exp()); }, gate.data(), gate.data(), n);
      round_to(gate.data(), out + r * n, n);
      at::vec::map2([](Vec s, Vec u) { return s * u; }, gate.data(), gate.data(), up.data(), n);
      from_float(gate.data(), out + r * n, n);
    }
  });
}

}  // namespace

// x [..., n] contiguous, weight [n] of x's type -> the norm of each row, x's shape and type.
torch::Tensor rms_norm(torch::Tensor x, torch::Tensor weight, double eps) {
  TORCH_CHECK(x.is_contiguous() && weight.is_contiguous() && weight.dim() == 1 && x.size(-1) == weight.size(0) &&
                  weight.scalar_type() == x.scalar_type(),
              "rms_norm: contiguous x [..., n] and weight [n] of its type");
  auto out = torch::empty_like(x);
  const int64_t n = weight.size(0);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "rms_norm", [&] {
    rms_norm_rows<scalar_t>(x.data_ptr<scalar_t>(), weight.data_ptr<scalar_t>(), out.data_ptr<scalar_t>(),
                            x.numel() / n, n, static_cast<float>(eps));
  });
  return out;
}

// x [..., 2n] contiguous, each row [gate | up] -> [..., n]: silu(gate) * up.
torch::Tensor silu_and_mul(torch::Tensor x) {
  TORCH_CHECK(x.is_contiguous() && x.dim() >= 1 && x.size(-1) % 2 == 0, "silu_and_mul: contiguous x [..., 2n]");
  auto sizes = x.sizes().vec();
  const int64_t n = sizes.back() / 2;
  sizes.back() = n;
  auto out = torch::empty(sizes, x.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "silu_and_mul", [&] {
    silu_and_mul_rows<scalar_t>(x.data_ptr<scalar_t>(), out.data_ptr<scalar_t>(), n ? x.numel() / (2 * n) : 0, n);
  });
  return out;
}
