// ISA-neutral part of the dspark_trt native kernels: scalar bf16 <-> fp32 conversions (bit for bit c10::BFloat16:
// round to nearest even, NaN -> 0x7FC0) and the kernel entry points every engine's build defines (module.cpp binds
// them). The vector helpers are per engine: simd512.h (AVX-512 / AMX build), simd256.h (AVX2 + FMA build); both
// compute the same bits lane for lane, so the engines agree.
#pragma once
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

namespace dspark {

using bf16 = c10::BFloat16;

// ------------------------------------------------------------------------------------------------ scalar helpers
inline float b2f(uint16_t h) {
  uint32_t u = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
inline uint16_t f2b(float f) { return c10::BFloat16(f).x; }  // round to nearest even, as torch
inline float rb(float f) { return b2f(f2b(f)); }              // round through bf16

// tensors (declared here, defined per engine in linear / attention / draft and in pack.cpp / markov.cpp, bound in module.cpp)
std::vector<at::Tensor> pack_weight(const at::Tensor& w, int64_t kind, bool swiglu);
at::Tensor linear(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& rowsum, int64_t kind, int64_t N,
                  bool swiglu, const c10::optional<at::Tensor>& scale, const c10::optional<at::Tensor>& bias,
                  bool bias_f32, const c10::optional<at::Tensor>& residual, const c10::optional<at::Tensor>& norm_weight,
                  double eps, const c10::optional<at::Tensor>& sq_pre, double sq_act, bool out_f32);
at::Tensor rope_kv(const at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin, const at::Tensor& pos,
                   at::Tensor& ck, at::Tensor& cv, const at::Tensor& slots, int64_t H, int64_t Hkv);
at::Tensor attend(const at::Tensor& q, const at::Tensor& ck, const at::Tensor& cv, const at::Tensor& slots,
                  const at::Tensor& starts, const at::Tensor& lengths, int64_t H, int64_t window, double scale,
                  bool bidir, const c10::optional<at::Tensor>& offsets);
int64_t argmax_sum(const float* u, const float* b, int64_t n);  // the engine's (draft.cpp), for markov.cpp
bool top2_row(const float* x, int64_t n, int64_t* arg, float* m1, float* m2);  // the engine's (draft.cpp), for greedy.cpp
float sumexp_row(const float* x, int64_t n, float m);                           // the engine's (draft.cpp), for greedy.cpp
void top2_lanes(const float* best, const float* second, const int32_t* idx, int lanes, int64_t* arg, float* m1,
                float* m2);  // greedy.cpp: the lanes' maxima → row maximum, first index, runner-up
std::vector<at::Tensor> greedy_stats(const at::Tensor& logits, const at::Tensor& k);
at::Tensor markov_greedy(const at::Tensor& U, const at::Tensor& anchor, const at::Tensor& w1, const at::Tensor& w2p,
                         const at::Tensor& rowsum, int64_t kind, int64_t vd, const c10::optional<at::Tensor>& d2t);
bool amx_active();
void set_amx(bool on);
std::string build_info();

}  // namespace dspark
