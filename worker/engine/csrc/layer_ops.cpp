// The decoder layer's small ops, each one pass over its rows instead of a chain of torch ops (eager
// mode: each op of a chain is a dispatch, an allocation and a pass over memory, and in bf16 a
// conversion to float and back). Each gives what transformers' module computes, with its roundings:
//   rms_norm:     weight * T(x * rsqrt(mean(x^2) + eps))        (LlamaRMSNorm: float sums)
//   silu_and_mul: T(silu(gate)) * up, for [gate | up] rows      (LlamaMLP's act_fn(gate) * up)
//   rotary:       T(T(x * cos) + T(rotate_half(x) * sin))      (apply_rotary_pos_emb, for q and k)
// in float for float32 (only the sum of squares adds up in another order), and rounded to T where
// the module's bf16 ops round. Each may write bf16 for float32 input (O): what the float32 activations of
// a bf16 model on the CPU feed its GEMMs and attention, which take them rounded to bf16 (linear.py); the
// kernel rounds them as it writes them, once, as the GEMM would have.
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

// round_to for an output of T, where the module's ops round; an output of another type (O) is float32's
// narrowed: nothing is rounded before the last write
template <typename T, typename O>
void round_as_module(float* f, O* out, int64_t n) {
  if constexpr (std::is_same_v<T, O>) round_to(f, out, n);
}

template <typename T, typename O>
void rms_norm_rows(const T* x, const T* weight, O* out, int64_t rows, int64_t n, float eps) {
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
      round_as_module<T>(f.data(), out + r * n, n);
      at::vec::map2([](Vec v, Vec g) { return g * v; }, f.data(), f.data(), w.data(), n);
      from_float(f.data(), out + r * n, n);
    }
  });
}

template <typename T, typename O>
void silu_and_mul_rows(const T* x, O* out, int64_t rows, int64_t n) {
  at::parallel_for(0, rows, kRowsPerTask, [&](int64_t begin, int64_t end) {
    std::vector<float> gate(n), up(n);
    for (int64_t r = begin; r < end; ++r) {
      to_float(x + r * 2 * n, gate.data(), n);
      to_float(x + r * 2 * n + n, up.data(), n);
      at::vec::map([](Vec g) { return g / (Vec(1.f) + g.neg().exp()); }, gate.data(), gate.data(), n);
      round_as_module<T>(gate.data(), out + r * n, n);
      at::vec::map2([](Vec s, Vec u) { return s * u; }, gate.data(), gate.data(), up.data(), n);
      from_float(gate.data(), out + r * n, n);
    }
  });
}

// Each token's q and k heads of the fused q/k/v GEMM's row, rotated by that token's cos and sin rows.
template <typename T, typename O>
void rotary_rows(const T* qkv, int64_t row_stride, const T* cos, const T* sin, O* q, O* k, int64_t tokens,
                 int64_t heads, int64_t kv_heads, int64_t d) {
  const int64_t half = d / 2;
  at::parallel_for(0, tokens, kRowsPerTask, [&](int64_t begin, int64_t end) {
    std::vector<float> c(d), s(d), x(d), rotated(d), sum(d);
    for (int64_t t = begin; t < end; ++t) {
      to_float(cos + t * d, c.data(), d);
      to_float(sin + t * d, s.data(), d);
      for (int64_t h = 0; h < heads + kv_heads; ++h) {
        O* out = h < heads ? q + (t * heads + h) * d : k + (t * kv_heads + h - heads) * d;
        to_float(qkv + t * row_stride + h * d, x.data(), d);
        for (int64_t i = 0; i < half; ++i) rotated[i] = -x[i + half], rotated[i + half] = x[i];
        // The products are rounded (and, in float32, stored) before they are added: no multiply-add.
        at::vec::map2([](Vec a, Vec b) { return a * b; }, sum.data(), x.data(), c.data(), d);
        round_as_module<T>(sum.data(), out, d);
        at::vec::map2([](Vec a, Vec b) { return a * b; }, rotated.data(), rotated.data(), s.data(), d);
        round_as_module<T>(rotated.data(), out, d);
        at::vec::map2([](Vec a, Vec b) { return a + b; }, sum.data(), sum.data(), rotated.data(), d);
        from_float(sum.data(), out, d);
      }
    }
  });
}

// The output's type: x's, or bf16 for float32 x.
at::ScalarType output_type(const torch::Tensor& x, std::optional<at::ScalarType> out_dtype, const char* op) {
  const auto type = out_dtype.value_or(x.scalar_type());
  TORCH_CHECK(type == x.scalar_type() || (x.scalar_type() == torch::kFloat && type == torch::kBFloat16), op,
              ": the output is of the input's type, or bfloat16 for float32 input");
  return type;
}

// Runs body<scalar_t, out_t>() for x's type and the output's (x's, or bf16 for float32 x).
template <typename Body>
void dispatch(const torch::Tensor& x, at::ScalarType out, Body body) {
  if (out != x.scalar_type()) return body(float(), c10::BFloat16());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "layer_ops", [&] { body(scalar_t(), scalar_t()); });
}

}  // namespace

// x [..., n] contiguous, weight [n] of x's type -> the norm of each row, x's shape, of x's type or out_dtype.
torch::Tensor rms_norm(torch::Tensor x, torch::Tensor weight, double eps, std::optional<at::ScalarType> out_dtype) {
  TORCH_CHECK(x.is_contiguous() && weight.is_contiguous() && weight.dim() == 1 && x.size(-1) == weight.size(0) &&
                  weight.scalar_type() == x.scalar_type(),
              "rms_norm: contiguous x [..., n] and weight [n] of its type");
  const auto type = output_type(x, out_dtype, "rms_norm");
  auto out = torch::empty_like(x, x.options().dtype(type));
  const int64_t n = weight.size(0);
  dispatch(x, type, [&](auto in, auto to) {
    using T = decltype(in);
    using O = decltype(to);
    rms_norm_rows<T, O>(x.data_ptr<T>(), weight.data_ptr<T>(), out.data_ptr<O>(), x.numel() / n, n,
                        static_cast<float>(eps));
  });
  return out;
}

// x [..., 2n] contiguous, each row [gate | up] -> [..., n]: silu(gate) * up, of x's type or out_dtype.
torch::Tensor silu_and_mul(torch::Tensor x, std::optional<at::ScalarType> out_dtype) {
  TORCH_CHECK(x.is_contiguous() && x.dim() >= 1 && x.size(-1) % 2 == 0, "silu_and_mul: contiguous x [..., 2n]");
  const auto type = output_type(x, out_dtype, "silu_and_mul");
  auto sizes = x.sizes().vec();
  const int64_t n = sizes.back() / 2;
  sizes.back() = n;
  auto out = torch::empty(sizes, x.options().dtype(type));
  dispatch(x, type, [&](auto in, auto to) {
    using T = decltype(in);
    using O = decltype(to);
    silu_and_mul_rows<T, O>(x.data_ptr<T>(), out.data_ptr<O>(), n ? x.numel() / (2 * n) : 0, n);
  });
  return out;
}

// qkv [tokens, (heads + 2 kv_heads) d] (rows may be strided), cos and sin [tokens, d] contiguous of its
// type -> the rotated q [tokens, heads, d] and k [tokens, kv_heads, d], contiguous, of qkv's type or out_dtype.
std::tuple<torch::Tensor, torch::Tensor> rotary(torch::Tensor qkv, torch::Tensor cos, torch::Tensor sin,
                                                int64_t heads, int64_t kv_heads,
                                                std::optional<at::ScalarType> out_dtype) {
  TORCH_CHECK(qkv.dim() == 2 && qkv.stride(1) == 1 && heads > 0 && kv_heads > 0 &&
                  qkv.size(1) % (heads + 2 * kv_heads) == 0,
              "rotary: qkv [tokens, (heads + 2 kv_heads) d] with contiguous rows");
  const int64_t tokens = qkv.size(0), d = qkv.size(1) / (heads + 2 * kv_heads);
  TORCH_CHECK(d % 2 == 0 && cos.is_contiguous() && sin.is_contiguous() && cos.sizes() == sin.sizes() &&
                  cos.dim() == 2 && cos.size(0) == tokens && cos.size(1) == d &&
                  cos.scalar_type() == qkv.scalar_type() && sin.scalar_type() == qkv.scalar_type(),
              "rotary: an even head size, and cos and sin [tokens, d] contiguous of qkv's type");
  const auto type = output_type(qkv, out_dtype, "rotary");
  auto q = torch::empty({tokens, heads, d}, qkv.options().dtype(type));
  auto k = torch::empty({tokens, kv_heads, d}, qkv.options().dtype(type));
  dispatch(qkv, type, [&](auto in, auto to) {
    using T = decltype(in);
    using O = decltype(to);
    rotary_rows<T, O>(qkv.data_ptr<T>(), qkv.stride(0), cos.data_ptr<T>(), sin.data_ptr<T>(), q.data_ptr<O>(),
                      k.data_ptr<O>(), tokens, heads, kv_heads, d);
  });
  return {q, k};
}
