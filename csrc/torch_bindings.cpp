// The vbatch:: op schemas; CPU and CUDA kernels register against them with TORCH_LIBRARY_IMPL.
#include <torch/library.h>

TORCH_LIBRARY(vbatch, m) {
  // NOTE: the fake (meta) kernels live in Python; this makes torch name the module to import.
  m.set_python_module("vbatch.layers.native");
  m.def(
      "paged_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor query_start_loc, "
      "Tensor seq_lens, Tensor block_tables, float scale, int sliding_window=0, "
      "float softcap=0.0, Tensor? prompt_chunks=None) -> Tensor");
  m.def(
      "reshape_and_cache(Tensor k, Tensor v, Tensor(a!) k_cache, Tensor(b!) v_cache, "
      "Tensor slot_mapping) -> ()");
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
  m.def("gelu_erf_(Tensor(a!) x) -> ()");
  m.def("silu_mul(Tensor gate, Tensor up) -> Tensor");
  m.def("fused_add_rms_norm(Tensor(a!) x, Tensor(b!) residual, Tensor weight, float eps) -> ()");
  m.def(
      "rotary_embedding(Tensor positions, Tensor(a!) qk, Tensor cos, Tensor sin) -> ()");
}
