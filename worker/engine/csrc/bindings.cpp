// The Python module of the native kernels (one extension, one build).
#include <torch/extension.h>

torch::Tensor paged_decode(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache, torch::Tensor tables,
                           torch::Tensor lens, double scale, int64_t window);
void write_kv(torch::Tensor k_cache, torch::Tensor v_cache, torch::Tensor slots, torch::Tensor key,
              torch::Tensor value);
torch::Tensor pack_linear_weight(torch::Tensor w);
torch::Tensor packed_linear(torch::Tensor x, torch::Tensor packed, c10::optional<torch::Tensor> bias, int64_t N);

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_decode", &paged_decode);
  m.def("write_kv", &write_kv);
  m.def("pack_linear_weight", &pack_linear_weight);
  m.def("packed_linear", &packed_linear);
}
