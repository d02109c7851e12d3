// Python bindings of the dspark_trt native kernels (runtime/native/__init__.py loads this extension).
#include <torch/extension.h>

#include "common.h"

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("pack_weight", &dspark::pack_weight, "pack a [N, K] weight into 16-row lane blocks");
  m.def("linear", &dspark::linear, "row-invariant product with fused norm / bias / residual / SwiGLU");
  m.def("rope_kv", &dspark::rope_kv, "RoPE on q, k; k and v written to the cache");
  m.def("attend", &dspark::attend, "per-query attention over the slot cache");
  m.def("markov_greedy", &dspark::markov_greedy, "greedy DSpark Markov block: γ steps of bias, add, argmax");
  m.def("greedy_stats", &dspark::greedy_stats, "per verify row: argmax, top-1 probability, top-1 − top-2 margin");
  m.def("amx_active", &dspark::amx_active, "whether products run on AMX tiles");
  m.def("set_amx", &dspark::set_amx, "allow (default) or forbid AMX tiles");
  m.def("build_info", &dspark::build_info);
}
