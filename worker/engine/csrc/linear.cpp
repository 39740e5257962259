// y = x W^T + b in float32, with W packed once into column panels: [panels, K, NR] holds
// NR output columns (two SIMD vectors) for every k, so the inner loop reads one contiguous
// line of weights per k and broadcasts one input value per row into 2 x rows accumulators.
// W may be bfloat16: widened to float32 in registers (for CPUs without bf16 instructions,
// where oneDNN's bf16 GEMM ran at 17 GFLOP/s here), half the bytes of float32 weights to read.
// Where the build has avx512_bf16 (BF16_DOT), bfloat16 weights are packed in pairs of k instead
// ([panels, K / 2, NR, 2]) and multiplied by the input rounded to bfloat16 with vdpbf16ps, which
// does two k per instruction into float32 accumulators: twice the arithmetic of an FMA.
// Where the CPU also has AMX, the same pairs feed its tiles (amx_micro): 16 rows of 32 k by 16
// columns per TDPBF16PS, into float32 sums that are the output as they are (never rounded to bf16,
// as oneDNN's bf16 GEMM's output is).
//
// Why our own: decode steps multiply a few rows (1-64) by every weight of the model, and
// oneDNN's packed GEMM spends there up to twice the time its FLOPs need (SmolLM2's 30 layers,
// 16 rows, AVX2: 50-59 -> 32-34 ms); for prefill-sized inputs (128-2048 rows) the two are on par.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>

#include <algorithm>
#include <vector>

#include "amx_tiles.h"

#if defined(CPU_CAPABILITY_AVX512) && defined(__AVX512BF16__)
#include <immintrin.h>
#define BF16_DOT 1
constexpr bool kBf16Dot = true;
#else
constexpr bool kBf16Dot = false;
#endif

namespace {

using Vec = at::vec::Vectorized<float>;
constexpr int64_t V = Vec::size();
constexpr int64_t NR = 2 * V;  // output columns per panel
// rows per micro-kernel: 2 * MR accumulators + 2 weight vectors + 1 broadcast fit the
// register file (16 registers with AVX2, 32 with AVX-512)
constexpr int64_t MR = V == 16 ? 12 : 6;
constexpr int64_t ROWS_IN_CACHE = 256 * 1024;  // bytes of input rows kept in L2 while the panels stream by
constexpr int64_t LINE = 64;

// A share of the next panel to pull into L2 while a micro-kernel works on this one: `per_k` bytes from
// `next` on at each of its k (none when `next` is null). A panel's own loads leave the hardware
// prefetcher no time to run ahead of them (it also stops at each 4 KiB page). Every tile of a panel
// takes an equal share, so the memory streams while all of them compute: when the first tile fetched
// the whole next panel, the others ran with the memory idle (SmolLM2's layers at 8-64 rows: 1.05-1.19x on a
// Xeon; on par on an EPYC, where 16 rows already take longer to compute than to stream).
struct Prefetch {
  const char* next;
  int64_t per_k;

  inline void at(int64_t k) const {
    if (next)
      for (int64_t b = 0; b < per_k; b += LINE) __builtin_prefetch(next + k * per_k + b, 0, 2);
  }
};

// One k's NR weights of a panel as two float vectors.
inline void load_weights(const float* w, Vec& w0, Vec& w1) {
  w0 = Vec::loadu(w);
  w1 = Vec::loadu(w + V);
}
inline void load_weights(const c10::BFloat16* w, Vec& w0, Vec& w1) {
  static_assert(at::vec::Vectorized<c10::BFloat16>::size() == NR, "one bf16 vector holds a panel row");
  std::tie(w0, w1) = at::vec::convert_to_float<c10::BFloat16>(at::vec::Vectorized<c10::BFloat16>::loadu(w));
}

// y[R rows, NR] = x[R rows, K] . panel[K, NR] + bias, while `ahead`'s share is pulled into L2.
// The row loops are unrolled by request: left to itself GCC kept a copy of the
// accumulators on the stack, written back on every k (2-3x slower).
template <int R, typename W>
inline void micro(const float* x, int64_t K, const W* panel, Prefetch ahead, const float* bias, float* y,
                  int64_t ldy) {
  Vec acc0[R], acc1[R];
  const Vec b0 = bias ? Vec::loadu(bias) : Vec(0.f), b1 = bias ? Vec::loadu(bias + V) : Vec(0.f);
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r) {
    acc0[r] = b0;
    acc1[r] = b1;
  }
  for (int64_t k = 0; k < K; ++k) {
    ahead.at(k);
    Vec w0, w1;
    load_weights(panel + k * NR, w0, w1);
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

#ifdef BF16_DOT
// micro with bfloat16 input rows and a panel packed in pairs of k: each step of the loop takes
// two k, one broadcast pair of inputs per row against NR pairs of weights.
template <int R>
inline void micro(const c10::BFloat16* x, int64_t K, const c10::BFloat16* panel, Prefetch ahead,
                  const float* bias, float* y, int64_t ldy) {
  __m512 acc0[R], acc1[R];
  const __m512 b0 = bias ? _mm512_loadu_ps(bias) : _mm512_setzero_ps();
  const __m512 b1 = bias ? _mm512_loadu_ps(bias + V) : _mm512_setzero_ps();
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r) {
    acc0[r] = b0;
    acc1[r] = b1;
  }
  const auto* pairs = reinterpret_cast<const int32_t*>(x);  // row r's k-pair j at r * K / 2 + j
  for (int64_t j = 0; j < K / 2; ++j) {
    ahead.at(j);
    const auto w0 = (__m512bh)_mm512_loadu_si512(panel + j * 2 * NR);
    const auto w1 = (__m512bh)_mm512_loadu_si512(panel + j * 2 * NR + NR);
#pragma GCC unroll 16
    for (int r = 0; r < R; ++r) {
      const auto a = (__m512bh)_mm512_set1_epi32(pairs[r * K / 2 + j]);
      acc0[r] = _mm512_dpbf16_ps(acc0[r], a, w0);
      acc1[r] = _mm512_dpbf16_ps(acc1[r], a, w1);
    }
  }
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r) {
    _mm512_storeu_ps(y + r * ldy, acc0[r]);
    _mm512_storeu_ps(y + r * ldy + V, acc1[r]);
  }
}
#endif

// Rows of an AMX tile: a micro-kernel on AMX takes one or two of them.
constexpr int64_t AMX_ROWS = 16;

#ifdef STREAMBATCH_AMX
// y[16 * B rows, NR] = x[16 * B rows, K] . panel (pairs of k, [K / 2][NR][2]) on AMX, K a multiple of 32:
// tiles 0-3 the sums (row block b, column half h: tile 2b + h), 4-5 the input rows, 6-7 the weights,
// each tile of weights loaded once for both row blocks. The input rows are streamed in (TILELOADDT1), so the
// panel's weights stay in L1 for the next row blocks: 1.1-1.15x on SmolLM2's shapes at 2,048 rows. The tiles
// configured by amx::configure.
template <int B>
inline void amx_micro(const c10::BFloat16* x, int64_t K, const c10::BFloat16* panel, Prefetch ahead, float* y,
                      int64_t ldy) {
  constexpr int64_t pair_row = 2 * NR * sizeof(c10::BFloat16);  // one pair of k's NR columns
  const int64_t x_row = K * sizeof(c10::BFloat16), y_row = ldy * sizeof(float);
  _tile_zero(0);
  _tile_zero(1);
  if constexpr (B == 2) {
    _tile_zero(2);
    _tile_zero(3);
  }
  for (int64_t k = 0; k < K; k += 32) {
    ahead.at(k / 32);
    const c10::BFloat16* w = panel + k * NR;  // pair k / 2
    _tile_stream_loadd(4, x + k, x_row);
    _tile_loadd(6, w, pair_row);
    _tile_dpbf16ps(0, 4, 6);
    _tile_loadd(7, w + NR, pair_row);  // columns 16-31
    _tile_dpbf16ps(1, 4, 7);
    if constexpr (B == 2) {
      _tile_stream_loadd(5, x + AMX_ROWS * K + k, x_row);
      _tile_dpbf16ps(2, 5, 6);
      _tile_dpbf16ps(3, 5, 7);
    }
  }
  _tile_stored(0, y, y_row);
  _tile_stored(1, y + AMX_ROWS, y_row);
  if constexpr (B == 2) {
    _tile_stored(2, y + AMX_ROWS * ldy, y_row);
    _tile_stored(3, y + AMX_ROWS * ldy + AMX_ROWS, y_row);
  }
}

#endif

// micro<rows> with the row count known at run time (1 .. MR)
template <typename X, typename W, int R = MR>
inline void micro_rows(int64_t rows, const X* x, int64_t K, const W* panel, Prefetch ahead, const float* bias,
                       float* y, int64_t ldy) {
  if constexpr (R > 0) {
    if (rows == R) return micro<R>(x, K, panel, ahead, bias, y, ldy);
    micro_rows<X, W, R - 1>(rows, x, K, panel, ahead, bias, y, ldy);
  }
}

// y [M, N] = x [M, K] . W^T + bias, W packed in panels of NR columns (K even for bfloat16 x). `amx`: on AMX
// tiles (bfloat16 x and weights in pairs, M a multiple of 16 and K of 32), else by the vector micro-kernels.
template <typename X, typename W>
void gemm(const X* xs, const W* ws, const float* bs, float* ys, int64_t M, int64_t N, int64_t K, int64_t panels,
          bool amx = false) {
  // Rows in chunks that stay in L2 while every panel streams past once; the threads split the panels.
  const int64_t tile_rows = amx ? 2 * AMX_ROWS : MR;
  const int64_t chunk = std::max<int64_t>(tile_rows, ROWS_IN_CACHE / (K * sizeof(X)) / tile_rows * tile_rows);
  const int64_t panel_bytes = K * NR * sizeof(W);
  // steps of a micro-kernel's loop over k: pairs of k for bf16 x, 32 k on AMX
  const int64_t K_steps = amx ? K / 32 : std::is_same_v<X, c10::BFloat16> ? K / 2 : K;
  for (int64_t m0 = 0; m0 < M; m0 += chunk) {
    const int64_t rows = std::min(chunk, M - m0), tiles = (rows + tile_rows - 1) / tile_rows;
    at::parallel_for(0, panels, 1, [&](int64_t begin, int64_t end) {
#ifdef STREAMBATCH_AMX
      if (amx) amx::configure();  // each thread's tiles, before its first tile instruction
#endif
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
        // accumulators to hide the FMA latency. Each tile prefetches its share of this thread's next
        // panel (all of them find this one in L2).
        const char* next = p + 1 < end ? reinterpret_cast<const char*>(ws + (p + 1) * K * NR) : nullptr;
        // shares rounded up: a tile's last k may reach into the next tile's share
        const int64_t per_k = (panel_bytes / tiles + K_steps - 1) / K_steps;
        for (int64_t t = 0, r0 = 0; t < tiles; ++t) {
          const int64_t height = amx ? std::min(tile_rows, rows - r0) : rows / tiles + (t < rows % tiles);
          const Prefetch ahead{next ? next + t * panel_bytes / tiles : nullptr, per_k};
#ifdef STREAMBATCH_AMX
          if constexpr (std::is_same_v<X, c10::BFloat16>) {
            if (amx) {
              if (height == 2 * AMX_ROWS)
                amx_micro<2>(xs + (m0 + r0) * K, K, ws + p * K * NR, ahead, out + r0 * ldo, ldo);
              else
                amx_micro<1>(xs + (m0 + r0) * K, K, ws + p * K * NR, ahead, out + r0 * ldo, ldo);
              r0 += height;
              continue;
            }
          }
#endif
          micro_rows(height, xs + (m0 + r0) * K, K, ws + p * K * NR, ahead, panel_bias, out + r0 * ldo, ldo);
          r0 += height;
        }
        if (amx && panel_bias) {  // the tiles' sums start from zero
          const Vec b0 = Vec::loadu(panel_bias), b1 = Vec::loadu(panel_bias + V);
          for (int64_t r = 0; r < rows; ++r) {
            (Vec::loadu(out + r * ldo) + b0).store(out + r * ldo);
            (Vec::loadu(out + r * ldo + V) + b1).store(out + r * ldo + V);
          }
        }
        if (cols < NR)
          for (int64_t i = 0; i < rows; ++i) std::copy_n(edge.data() + i * NR, cols, ys + (m0 + i) * N + n0);
      }
#ifdef STREAMBATCH_AMX
      if (amx) _tile_release();  // tile state left in use costs every context switch its 8 KiB
#endif
    });
  }
}

}  // namespace

bool bf16_dot_products() { return kBf16Dot; }

// Weights in pairs of k multiply on AMX tiles: the build has AMX, Linux lets this process use it, and K
// (padded to even) is whole tiles of 32.
bool on_amx(int64_t K) {
#ifdef STREAMBATCH_AMX
  return K % 32 == 0 && amx::permitted();
#else
  return false;
#endif
}

// w [N, K] float32 or bfloat16 -> [ceil(N / NR), K, NR] of the same type, the columns past N zero;
// with `pairs` (bfloat16 weights, a BF16_DOT build) [ceil(N / NR), ceil(K / 2), 2 * NR]: each column's
// two k side by side, K padded with a zero.
torch::Tensor pack_linear_weight(torch::Tensor w, bool pairs) {
  TORCH_CHECK(w.dim() == 2 && (w.scalar_type() == torch::kFloat || w.scalar_type() == torch::kBFloat16),
              "pack_linear_weight: a 2-D float32 or bfloat16 weight");
  TORCH_CHECK(!pairs || (kBf16Dot && w.scalar_type() == torch::kBFloat16),
              "pack_linear_weight: pairs of k need bfloat16 weights and a build with avx512_bf16");
  const int64_t N = w.size(0), K = w.size(1), panels = (N + NR - 1) / NR;
  if (pairs) {
    const int64_t halves = (K + 1) / 2;
    auto padded = torch::zeros({panels * NR, 2 * halves}, w.options());
    padded.narrow(0, 0, N).narrow(1, 0, K).copy_(w);
    return padded.view({panels, NR, halves, 2}).permute({0, 2, 1, 3}).contiguous().view({panels, halves, 2 * NR});
  }
  auto padded = torch::zeros({panels * NR, K}, w.options());
  padded.narrow(0, 0, N).copy_(w);
  return padded.view({panels, NR, K}).transpose(1, 2).contiguous();
}

// x [M, K] (rounded to bfloat16 for weights in pairs of k, else float32), packed from pack_linear_weight,
// bias [N] float32 or undefined -> [M, N], the float32 sums as they are
torch::Tensor packed_linear(torch::Tensor input, torch::Tensor packed, c10::optional<torch::Tensor> bias, int64_t N) {
  TORCH_CHECK(input.dim() >= 1, "packed_linear: input [..., K]");
  TORCH_CHECK(packed.scalar_type() == torch::kFloat || packed.scalar_type() == torch::kBFloat16,
              "packed_linear: float32 or bfloat16 weights");
  const bool pairs = packed.dim() == 3 && packed.size(2) == 2 * NR;  // packed in pairs of k
  TORCH_CHECK(!pairs || (kBf16Dot && packed.scalar_type() == torch::kBFloat16),
              "packed_linear: weights in pairs of k are bfloat16, for a build with avx512_bf16");
  // no copy when the input already is of that type and contiguous
  auto x = input.reshape({-1, input.size(-1)}).to(pairs ? torch::kBFloat16 : torch::kFloat).contiguous();
  const int64_t K = x.size(1);
  if (pairs && K % 2) x = torch::constant_pad_nd(x, {0, 1});  // the weights' zero k
  TORCH_CHECK(packed.dim() == 3 && packed.size(1) == (pairs ? (K + 1) / 2 : K) &&
                  packed.size(2) == (pairs ? 2 * NR : NR) && packed.size(0) * NR >= N,
              "packed_linear: the weight was not packed for this input size");
  const int64_t M = x.size(0), panels = packed.size(0);
  // On AMX the rows go in whole tiles: x padded with zero rows, whose sums are dropped.
  const bool amx = pairs && on_amx(x.size(1));
  const int64_t padded_rows = amx ? (M + AMX_ROWS - 1) / AMX_ROWS * AMX_ROWS : M;
  if (padded_rows > M) x = torch::constant_pad_nd(x, {0, 0, 0, padded_rows - M});
  auto y = torch::empty({padded_rows, N}, x.options().dtype(torch::kFloat));
  const bool has_bias = bias && bias->defined();
  TORCH_CHECK(!has_bias || (bias->dim() == 1 && bias->size(0) == N && bias->is_contiguous() &&
                            bias->scalar_type() == torch::kFloat), "packed_linear: bias [N] float32");
  const float* bs = has_bias ? bias->data_ptr<float>() : nullptr;
  float* ys = y.data_ptr<float>();
#ifdef BF16_DOT
  if (pairs)
    gemm(x.data_ptr<c10::BFloat16>(), packed.data_ptr<c10::BFloat16>(), bs, ys, padded_rows, N, x.size(1), panels,
         amx);
  else
#endif
  if (packed.scalar_type() == torch::kBFloat16)
    gemm(x.data_ptr<float>(), packed.data_ptr<c10::BFloat16>(), bs, ys, M, N, K, panels);
  else
    gemm(x.data_ptr<float>(), packed.data_ptr<float>(), bs, ys, M, N, K, panels);
  if (padded_rows > M) y = y.narrow(0, 0, M);
  auto sizes = input.sizes().vec();
  sizes.back() = N;
  return y.view(sizes);
}
