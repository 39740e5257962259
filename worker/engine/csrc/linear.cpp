// y = x W^T + b for float32, with W packed once into column panels: [panels, K, NR] holds
// NR output columns (two SIMD vectors) for every k, so the inner loop reads one contiguous
// line of weights per k and broadcasts one input value per row into 2 x rows accumulators.
//
// Why our own: decode steps multiply a few rows (1-64) by every weight of the model, and
// oneDNN's packed GEMM spends there up to twice the time its FLOPs need (SmolLM2's 30 layers,
// 16 rows, AVX2: 50-59 -> 32-34 ms); for prefill-sized inputs (128-2048 rows) the two are on par.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/vec.h>

#include <algorithm>
#include <vector>

namespace {

using Vec = at::vec::Vectorized<float>;
constexpr int64_t V = Vec::size();
constexpr int64_t NR = 2 * V;  // output columns per panel
// rows per micro-kernel: 2 * MR accumulators + 2 weight vectors + 1 broadcast fit the
// register file (16 registers with AVX2, 32 with AVX-512)
constexpr int64_t MR = V == 16 ? 12 : 6;
constexpr int64_t ROWS_IN_CACHE = 256 * 1024;  // bytes of input rows kept in L2 while the panels stream by

// y[R rows, NR] = x[R rows, K] . panel[K, NR] + bias. The row loops are unrolled by
// request: left to itself GCC kept a copy of the accumulators on the stack, written back on
// every k (2-3x slower).
template <int R>
inline void micro(const float* x, int64_t K, const float* panel, const float* bias, float* y, int64_t ldy) {
  Vec acc0[R], acc1[R];
  const Vec b0 = bias ? Vec::loadu(bias) : Vec(0.f), b1 = bias ? Vec::loadu(bias + V) : Vec(0.f);
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r) {
    acc0[r] = b0;
    acc1[r] = b1;
  }
  for (int64_t k = 0; k < K; ++k) {
    const Vec w0 = Vec::loadu(panel + k * NR), w1 = Vec::loadu(panel + k * NR + V);
#pragma GCC unroll 16
    for (int r = 0; r < R; ++r) {
      const Vec a(x[r * K + k]);
      acc0[r] = at::vec::fmadd(a, w0, acc0[r]);
      acc1[r] = at::vec::fmadd(a, w1, acc1[r]);
    }
  }
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r) {
    acc0[r].store(y + r * ldy);
    acc1[r].store(y + r * ldy + V);
  }
}

// micro<rows> with the row count known at run time (1 .. MR)
template <int R = MR>
inline void micro_rows(int64_t rows, const float* x, int64_t K, const float* panel, const float* bias, float* y,
                       int64_t ldy) {
  if constexpr (R > 0) {
    if (rows == R) return micro<R>(x, K, panel, bias, y, ldy);
    micro_rows<R - 1>(rows, x, K, panel, bias, y, ldy);
  }
}

}  // namespace

// w [N, K] float -> [ceil(N / NR), K, NR], the columns past N zero
torch::Tensor pack_linear_weight(torch::Tensor w) {
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == torch::kFloat, "pack_linear_weight: a 2-D float32 weight");
  const int64_t N = w.size(0), K = w.size(1), panels = (N + NR - 1) / NR;
  auto padded = torch::zeros({panels * NR, K}, w.options());
  padded.narrow(0, 0, N).copy_(w);
  return padded.view({panels, NR, K}).transpose(1, 2).contiguous();
}

// x [M, K] float contiguous, packed from pack_linear_weight, bias [N] or undefined -> [M, N]
torch::Tensor packed_linear(torch::Tensor x, torch::Tensor packed, c10::optional<torch::Tensor> bias, int64_t N) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && x.scalar_type() == torch::kFloat, "packed_linear: x [M, K] float32");
  TORCH_CHECK(packed.dim() == 3 && packed.size(1) == x.size(1) && packed.size(2) == NR && packed.size(0) * NR >= N,
              "packed_linear: the weight was not packed for this input size");
  const int64_t M = x.size(0), K = x.size(1), panels = packed.size(0);
  auto y = torch::empty({M, N}, x.options());
  const bool has_bias = bias && bias->defined();
  TORCH_CHECK(!has_bias || (bias->dim() == 1 && bias->size(0) == N && bias->is_contiguous() &&
                            bias->scalar_type() == torch::kFloat), "packed_linear: bias [N] float32");
  const float* xs = x.data_ptr<float>();
  const float* ws = packed.data_ptr<float>();
  const float* bs = has_bias ? bias->data_ptr<float>() : nullptr;
  float* ys = y.data_ptr<float>();
  // Rows in chunks that stay in L2 while every panel streams past once; the threads split the panels.
  const int64_t chunk = std::max<int64_t>(MR, ROWS_IN_CACHE / (K * 4) / MR * MR);
  for (int64_t m0 = 0; m0 < M; m0 += chunk) {
    const int64_t rows = std::min(chunk, M - m0), tiles = (rows + MR - 1) / MR;
    at::parallel_for(0, panels, 1, [&](int64_t begin, int64_t end) {
      std::vector<float> edge;  // the last panel's output and bias when N is not a multiple of NR
      float edge_bias[NR];
      for (int64_t p = begin; p < end; ++p) {
        const int64_t n0 = p * NR, cols = std::min(NR, N - n0);
        float* out = ys + m0 * N + n0;
        int64_t ldo = N;
        const float* panel_bias = bs ? bs + n0 : nullptr;
        if (cols < NR) {
          edge.resize(rows * NR), out = edge.data(), ldo = NR;
          if (bs) std::fill_n(edge_bias, NR, 0.f), std::copy_n(bs + n0, cols, edge_bias), panel_bias = edge_bias;
        }
        // Tiles of balanced heights (16 rows: 6, 5, 5): a short last tile has too few
        // accumulators to hide the FMA latency.
        for (int64_t t = 0, r0 = 0; t < tiles; ++t) {
          const int64_t height = rows / tiles + (t < rows % tiles);
          micro_rows(height, xs + (m0 + r0) * K, K, ws + p * K * NR, panel_bias, out + r0 * ldo, ldo);
          r0 += height;
        }
        if (cols < NR)
          for (int64_t i = 0; i < rows; ++i) std::copy_n(edge.data() + i * NR, cols, ys + (m0 + i) * N + n0);
      }
    });
  }
  return y;
}
