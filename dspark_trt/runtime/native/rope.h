// RoPE + KV-cache write, shared by the engines' attention.cpp (ISA-neutral scaffolding): the checks, the scalar
// rotation of one head, the loop over tokens and heads. Each engine passes its vector rotation of one head,
// `vec(src, c, s, dst) → bool` (false: the head dim is not one it covers, and the scalar rotation runs).
//
// qkv [M = B·T, (H + 2·Hkv)·D] → q [M, H·D] with RoPE; k (RoPE'd) and v written to ck/cv [S, Hkv, max_seq, D] at
// (slots[b], :, pos[b, t]). cos/sin [P, D] in the model dtype. RoPE numerics as torch: x·cos and rot·sin rounded,
// then their sum rounded (bf16); rot = [-x2, x1].
#pragma once
#include "common.h"

namespace dspark {

template <typename Vec>
at::Tensor rope_kv_with(const at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin, const at::Tensor& pos,
                        at::Tensor& ck, at::Tensor& cv, const at::Tensor& slots, int64_t H, int64_t Hkv, Vec&& vec) {
  TORCH_CHECK(qkv.is_contiguous() && cos.is_contiguous() && sin.is_contiguous() && ck.is_contiguous() &&
              cv.is_contiguous(), "rope_kv: contiguous tensors");
  const bool is_bf16 = qkv.scalar_type() == at::kBFloat16;
  const int64_t D = ck.size(3), MS = ck.size(2), B = slots.size(0);
  const int64_t M = qkv.size(0), T = M / B, half = D / 2;
  TORCH_CHECK(qkv.size(1) == (H + 2 * Hkv) * D && pos.numel() == M, "rope_kv: shapes");
  at::Tensor q = at::empty({M, H * D}, qkv.options());
  const int64_t* ps = pos.data_ptr<int64_t>();
  const int64_t* sl = slots.data_ptr<int64_t>();
  const int64_t W = qkv.size(1);
  auto rot = [&](auto* src, auto* c, auto* s, auto* dst) {  // one head
    using T_ = std::remove_const_t<std::remove_pointer_t<decltype(src)>>;
    if (vec(src, c, s, dst)) return;
    for (int64_t d = 0; d < D; ++d) {
      const float x = static_cast<float>(src[d]);
      const float r = d < half ? -static_cast<float>(src[d + half]) : static_cast<float>(src[d - half]);
      if constexpr (std::is_same<T_, bf16>::value) {
        dst[d] = bf16(rb(x * static_cast<float>(c[d])) + rb(r * static_cast<float>(s[d])));
      } else {
        dst[d] = x * c[d] + r * s[d];
      }
    }
  };
  auto body = [&](auto tag) {
    using T_ = decltype(tag);
    const T_* src = static_cast<const T_*>(qkv.data_ptr());
    const T_* C = static_cast<const T_*>(cos.data_ptr());
    const T_* S = static_cast<const T_*>(sin.data_ptr());
    T_* qo = static_cast<T_*>(q.data_ptr());
    T_* K_ = static_cast<T_*>(ck.data_ptr());
    T_* V_ = static_cast<T_*>(cv.data_ptr());
    for (int64_t m = 0; m < M; ++m) {
      const int64_t p = ps[m], slot = sl[m / T];
      TORCH_CHECK(p >= 0 && p < MS && p < cos.size(0), "rope_kv: position out of range");
      const T_* row = src + m * W;
      for (int64_t h = 0; h < H; ++h) rot(row + h * D, C + p * D, S + p * D, qo + m * H * D + h * D);
      for (int64_t g = 0; g < Hkv; ++g) {
        T_* kd = K_ + ((slot * Hkv + g) * MS + p) * D;
        rot(row + (H + g) * D, C + p * D, S + p * D, kd);
        std::memcpy(V_ + ((slot * Hkv + g) * MS + p) * D, row + (H + Hkv + g) * D, D * sizeof(T_));
      }
    }
  };
  if (is_bf16) body(bf16()); else body(float());
  return q;
}

}  // namespace dspark
