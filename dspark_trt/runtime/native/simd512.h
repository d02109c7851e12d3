// AVX-512 vector helpers of the dspark_trt native kernels (the AVX-512 / AMX build): 16 fp32 lanes per register.
// Conversions match c10::BFloat16 bit for bit; exp is one fixed instruction sequence, so results never depend on
// where or how often it is called. simd256.h computes the same bits on AVX2 (two 8-lane halves per 16 lanes).
#pragma once
#include "common.h"

#if !defined(__AVX512F__) || !defined(__AVX512BW__)
#error "the AVX-512 engine needs AVX-512F/BW (the Python side builds it only where the CPU has it)"
#endif

namespace dspark {

// ------------------------------------------------------------------------------------------------ vector helpers
inline __m512 load_bf16x16(const uint16_t* p) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)p)), 16));
}
inline __m512 maskz_load_bf16x16(__mmask16 m, const uint16_t* p) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m, p)), 16));
}
// fp32 -> bf16, round to nearest even, NaN -> 0x7FC0: bit-for-bit c10::BFloat16(float)
inline __m256i f2b_x16(__m512 v) {
  __m512i u = _mm512_castps_si512(v);
  __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  __m512i r = _mm512_srli_epi32(_mm512_add_epi32(u, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7FFF))), 16);
  __mmask16 nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
  r = _mm512_mask_mov_epi32(r, nan, _mm512_set1_epi32(0x7FC0));
  return _mm512_cvtepi32_epi16(r);
}
inline __m512 round_bf16_x16(__m512 v) {  // fp32 value rounded through bf16: the same bits as via f2b_x16
  const __m512i u = _mm512_castps_si512(v);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  __m512i r = _mm512_and_si512(_mm512_add_epi32(u, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7FFF))),
                               _mm512_set1_epi32(static_cast<int>(0xFFFF0000u)));
  r = _mm512_mask_mov_epi32(r, _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q), _mm512_set1_epi32(0x7FC00000));
  return _mm512_castsi512_ps(r);
}
inline __m256i bf16_bits_x16(__m512 v) {  // the bf16 of a value already rounded through bf16 (its top half)
  return _mm512_cvtepi32_epi16(_mm512_srli_epi32(_mm512_castps_si512(v), 16));
}

// exp(x) for x <= 0 mostly (softmax) and SiLU; Cephes polynomial, ~1 ulp; fixed instruction sequence.
inline __m512 exp_x16(__m512 x) {
  x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-87.33654f)), _mm512_set1_ps(88.37626f));
  __m512 fx = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  x = _mm512_fnmadd_ps(fx, _mm512_set1_ps(0.693359375f), x);
  x = _mm512_fnmadd_ps(fx, _mm512_set1_ps(-2.12194440e-4f), x);
  __m512 y = _mm512_set1_ps(1.9875691500E-4f);
  y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(1.3981999507E-3f));
  y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(8.3334519073E-3f));
  y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(4.1665795894E-2f));
  y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(1.6666665459E-1f));
  y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(5.0000001201E-1f));
  __m512 x2 = _mm512_mul_ps(x, x);
  y = _mm512_fmadd_ps(y, x2, _mm512_add_ps(x, _mm512_set1_ps(1.0f)));
  return _mm512_scalef_ps(y, fx);
}
inline __mmask16 tail16(int64_t n) { return n >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << n) - 1); }
inline __m512 silu_x16(__m512 v) {  // v / (1 + exp(-v)), torch's formula
  return _mm512_div_ps(v, _mm512_add_ps(_mm512_set1_ps(1.0f), exp_x16(_mm512_sub_ps(_mm512_setzero_ps(), v))));
}

// Σ of the 16 lanes by a fixed tree (GCC's _mm512_reduce_add_ps order, written out so no compiler changes it):
// t_i = l_i + l_{i+8}, u_j = t_j + t_{j+4}, (u_0 + u_2) + (u_1 + u_3). simd256.h's reduce_add16 is the same tree.
inline float reduce_add_x16(__m512 v) {
  const __m256 t = _mm256_add_ps(_mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1)), _mm512_castps512_ps256(v));
  const __m128 u = _mm_add_ps(_mm256_extractf128_ps(t, 1), _mm256_castps256_ps128(t));
  const __m128 w = _mm_add_ps(u, _mm_shuffle_ps(u, u, _MM_SHUFFLE(1, 0, 3, 2)));
  return _mm_cvtss_f32(_mm_add_ss(w, _mm_shuffle_ps(w, w, _MM_SHUFFLE(1, 1, 1, 1))));
}

}  // namespace dspark
