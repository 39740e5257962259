// The native kernels (one extension, one build): a Python module, and the GEMM also as the
// operator torch.ops.streambatch.packed_linear, so that torch.compile can put it in its graph.
#include <torch/extension.h>

torch::Tensor paged_decode(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache, torch::Tensor tables,
                           torch::Tensor lens, double scale, int64_t window);
void prefill_attention(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache, torch::Tensor blocks,
                       int64_t computed, double scale, int64_t window, torch::Tensor out);
void write_kv(torch::Tensor k_cache, torch::Tensor v_cache, torch::Tensor slots, torch::Tensor key,
              torch::Tensor value);
bool bf16_dot_products();
torch::Tensor pack_linear_weight(torch::Tensor w, bool pairs);
torch::Tensor packed_linear(torch::Tensor x, torch::Tensor packed, c10::optional<torch::Tensor> bias, int64_t N);
torch::Tensor rms_norm(torch::Tensor x, torch::Tensor weight, double eps, std::optional<at::ScalarType> out_dtype);
torch::Tensor silu_and_mul(torch::Tensor x, std::optional<at::ScalarType> out_dtype);
std::tuple<torch::Tensor, torch::Tensor> rotary(torch::Tensor qkv, torch::Tensor cos, torch::Tensor sin,
                                                int64_t heads, int64_t kv_heads,
                                                std::optional<at::ScalarType> out_dtype);
torch::Tensor argmax_rows(torch::Tensor x);

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_decode", &paged_decode);
  m.def("prefill_attention", &prefill_attention);
  m.def("write_kv", &write_kv);
  m.def("bf16_dot_products", &bf16_dot_products);
  m.def("pack_linear_weight", &pack_linear_weight);
  m.def("rms_norm", &rms_norm);
  m.def("silu_and_mul", &silu_and_mul);
  m.def("rotary", &rotary);
  m.def("argmax_rows", &argmax_rows);
}

TORCH_LIBRARY(streambatch, m) {
  m.def("packed_linear(Tensor x, Tensor packed, Tensor? bias, int out_features) -> Tensor");
}

TORCH_LIBRARY_IMPL(streambatch, CPU, m) {
  m.impl("packed_linear", &packed_linear);
}
