// ISA-neutral part of the native products, shared by every engine: packing kinds and their layouts (linear.h says
// what each holds), the plan of one linear() call and its argument checks. No vector code here.
#pragma once

#include "common.h"

namespace dspark {
namespace lin {

// Packing kinds. Their values are defined once, on the Python side (runtime/native/__init__.py `Pack`), and reach
// the compiler as -DDSPARK_P_<NAME>=<value> flags of every build.
#if !defined(DSPARK_P_BF16) || !defined(DSPARK_P_F32) || !defined(DSPARK_P_I8P) || !defined(DSPARK_P_I8F) || \
    !defined(DSPARK_P_SQ) || !defined(DSPARK_P_I8Q)
#error "build through dspark_trt.runtime.native: it defines the packing kinds (-DDSPARK_P_*)"
#endif
enum Pack {
  P_BF16 = DSPARK_P_BF16, P_F32 = DSPARK_P_F32, P_I8P = DSPARK_P_I8P, P_I8F = DSPARK_P_I8F, P_SQ = DSPARK_P_SQ,
  P_I8Q = DSPARK_P_I8Q
};
inline bool known_kind(int64_t kind) {
  return kind == P_BF16 || kind == P_F32 || kind == P_I8P || kind == P_I8F || kind == P_SQ || kind == P_I8Q;
}
inline bool quads(int kind) { return kind == P_SQ || kind == P_I8Q; }  // int8 x int8 products on k-quads
inline int kgroup(int kind) { return quads(kind) ? 4 : (kind == P_BF16 || kind == P_I8P) ? 2 : 1; }
inline int64_t kalign(int kind) { return quads(kind) ? 64 : (kind == P_BF16 || kind == P_I8P) ? 32 : 1; }
constexpr int LIMBS = 2;                // P_I8Q: signed base-256 digits per activation element
constexpr int LIMB_BITS = 8 * LIMBS - 2;  // |v| < 2^LIMB_BITS (the top digit stays within [-64, 64])
constexpr int LIMB_ROWS = 16 / LIMBS;   // P_I8Q on AMX: activation rows per 16-row tile

struct LinearPlan {
  int64_t M = 0, K = 0, N = 0, Kp = 0, NB = 0;
  int kind = P_BF16;
  bool swiglu = false, bf16 = true, out_f32 = false, amx = false;
  const void* x = nullptr;  // staged activations, ldx elements per row (see stage_input)
  int64_t ldx = 0;
  const void* w = nullptr;  // packed weight
  const float* scale = nullptr;
  const int32_t* rowsum = nullptr;  // SQ / I8Q on the FMA engine: Σ_k w[n, k] (activations are stored +128)
  const double* limb_scale = nullptr;  // I8Q: per activation row, s = 2^(e - LIMB_BITS)
  const void* bias = nullptr;
  bool bias_f32 = false;
  const void* res = nullptr;
  void* out = nullptr;
};

// int8 x int8 products (SQ, I8Q): the AVX-512 engine needs VNNI and DQ; the AVX2 engine has them on vpmaddwd
#if defined(__AVX512F__) && !(defined(__AVX512VNNI__) && defined(__AVX512DQ__))
constexpr bool kInt8Products = false;
#else
constexpr bool kInt8Products = true;
#endif

// Checks linear()'s arguments and fills p (all but x / ldx / limb_scale: staging is the engine's) → the output
// tensor [M, Nout]. *pre = SmoothQuant's prequant scale or nullptr.
inline at::Tensor make_plan(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& rowsum, int64_t kind,
                            int64_t N, bool swiglu, const c10::optional<at::Tensor>& scale,
                            const c10::optional<at::Tensor>& bias, bool bias_f32,
                            const c10::optional<at::Tensor>& residual, const c10::optional<at::Tensor>& norm_weight,
                            const c10::optional<at::Tensor>& sq_pre, bool out_f32, bool amx, LinearPlan* pp,
                            const float** pre) {
  LinearPlan& p = *pp;
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1, "linear: x [M, K] with contiguous rows");
  const bool is_bf16 = x.scalar_type() == at::kBFloat16;
  TORCH_CHECK(is_bf16 || x.scalar_type() == at::kFloat, "linear: bf16 or fp32 activations");
  const bool pair = kind == P_BF16 || kind == P_I8P;
  *pre = nullptr;
  TORCH_CHECK(known_kind(kind), "linear: unknown kind");
  TORCH_CHECK(kind == P_SQ || (kind == P_I8Q ? is_bf16 : pair == is_bf16), "linear: packing does not match the activation dtype");
  p.M = x.size(0);
  p.K = x.size(1);
  p.N = N;
  p.kind = static_cast<int>(kind);
  p.swiglu = swiglu;
  p.bf16 = is_bf16;
  p.out_f32 = out_f32;
  p.NB = packed.size(0);
  p.Kp = packed.size(1) * packed.size(3);
  TORCH_CHECK(p.Kp >= p.K && p.Kp - p.K < kalign(p.kind), "linear: packed K does not match x");
  p.amx = (pair || quads(p.kind)) && amx;
  const int64_t nout = swiglu ? N / 2 : N;
  if (norm_weight.has_value()) {
    TORCH_CHECK(norm_weight->scalar_type() == x.scalar_type() && norm_weight->numel() == p.K &&
                norm_weight->is_contiguous(), "linear: norm weight [K] in x's dtype");
  }
  if (kind == P_SQ) {
    TORCH_CHECK(sq_pre.has_value() && sq_pre->scalar_type() == at::kFloat && sq_pre->numel() == p.K, "linear: sq_pre");
    *pre = sq_pre->data_ptr<float>();
    p.rowsum = rowsum.data_ptr<int32_t>();
  }
  if (kind == P_I8Q) p.rowsum = rowsum.data_ptr<int32_t>();
  p.w = packed.data_ptr();
  if (scale.has_value()) {
    TORCH_CHECK(scale->scalar_type() == at::kFloat && scale->numel() == N && scale->is_contiguous(), "linear: scale");
    p.scale = scale->data_ptr<float>();
  }
  if (bias.has_value()) {
    TORCH_CHECK(bias->numel() == N && bias->is_contiguous(), "linear: bias [N]");
    TORCH_CHECK(bias->scalar_type() == (bias_f32 ? at::kFloat : x.scalar_type()), "linear: bias dtype");
    p.bias = bias->data_ptr();
    p.bias_f32 = bias_f32;
  }
  if (residual.has_value()) {
    TORCH_CHECK(residual->scalar_type() == x.scalar_type() && residual->is_contiguous() && residual->dim() == 2 &&
                residual->size(0) == p.M && residual->size(1) == nout, "linear: residual [M, Nout]");
    p.res = residual->data_ptr();
  }
  at::Tensor out = at::empty({p.M, nout}, x.options().dtype(out_f32 ? at::kFloat : x.scalar_type()));
  p.out = out.data_ptr();
  return out;
}

// x staged by `stage()` (or its fp32 rows used in place), then `run(p, b0, b1)` over tasks of 4 weight blocks on the
// threads (even: SwiGLU keeps (up, fc) pairs together); tiny products run inline (no fork)
template <typename Stage, typename Run>
inline void execute(LinearPlan& p, const at::Tensor& x, bool in_place, Stage&& stage, Run&& run) {
  if (in_place) {
    p.x = x.data_ptr();
    p.ldx = x.stride(0);
  } else {
    p.x = stage();
    p.ldx = p.Kp;
  }
  const int64_t per_task = 4;
  const int64_t ntasks = (p.NB + per_task - 1) / per_task;
  const int64_t work = p.M * p.NB * 16 * p.Kp;
  const int64_t grain = work < (1 << 17) ? ntasks : 1;
  at::parallel_for(0, ntasks, grain, [&](int64_t t0, int64_t t1) { run(p, t0 * per_task, std::min(p.NB, t1 * per_task)); });
}

}  // namespace lin
}  // namespace dspark
