// AVX2 + FMA vector helpers of the dspark_trt native kernels (the AVX2 build, x86-64-v3): 8 fp32 lanes per register.
// Every helper computes, lane for lane, the same bits as its simd512.h twin (bf16 conversions, exp, SiLU, the
// 16-lane sum tree), so the AVX2 engine's outputs equal the AVX-512 / AMX engines' wherever those are exact.
// Masks are lane counts (the first n lanes), as maskload / maskstore take them.
#pragma once
#include "common.h"

#if !defined(__AVX2__) || !defined(__FMA__)
#error "the AVX2 engine needs AVX2 and FMA (x86-64-v3)"
#endif

namespace dspark {
namespace v8 {

// lanes [0, n) all ones, the rest zero (n clamped to [0, 8])
inline __m256i lanes(int64_t n) {
  const int64_t k = std::max<int64_t>(0, std::min<int64_t>(8, n));
  return _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(k)), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}
inline __m256 loadu(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 maskz_load(int64_t n, const float* p) {  // first n lanes from p, zeros after (no read past them)
  return n >= 8 ? _mm256_loadu_ps(p) : _mm256_maskload_ps(p, lanes(n));
}
inline void mask_store(int64_t n, float* p, __m256 v) {
  if (n >= 8) _mm256_storeu_ps(p, v); else _mm256_maskstore_ps(p, lanes(n), v);
}
inline __m256 load_bf16(const uint16_t* p) {  // 8 bf16 -> fp32
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i*)p)), 16));
}
inline __m256 maskz_load_bf16(int64_t n, const uint16_t* p) {
  if (n >= 8) return load_bf16(p);
  alignas(16) uint16_t tmp[8] = {};
  if (n > 0) std::memcpy(tmp, p, static_cast<size_t>(n) * 2);
  return load_bf16(tmp);
}
// fp32 -> bf16 bits in the low 16 of each 32-bit lane, round to nearest even, NaN -> 0x7FC0 (c10::BFloat16)
inline __m256i f2b_lanes(__m256 v) {
  const __m256i u = _mm256_castps_si256(v);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
  __m256i r = _mm256_srli_epi32(_mm256_add_epi32(u, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7FFF))), 16);
  const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q));
  return _mm256_blendv_epi8(r, _mm256_set1_epi32(0x7FC0), nan);
}
inline __m128i pack_lanes16(__m256i r) {  // 8 lanes' low 16 bits -> 8 uint16 (values < 2^16: no saturation issue)
  return _mm_packus_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1));
}
inline __m128i f2b(__m256 v) { return pack_lanes16(f2b_lanes(v)); }
inline __m256 round_bf16(__m256 v) {  // fp32 rounded through bf16: the same bits as via f2b
  const __m256i u = _mm256_castps_si256(v);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
  __m256i r = _mm256_and_si256(_mm256_add_epi32(u, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7FFF))),
                               _mm256_set1_epi32(static_cast<int>(0xFFFF0000u)));
  r = _mm256_blendv_epi8(r, _mm256_set1_epi32(0x7FC00000), _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q)));
  return _mm256_castsi256_ps(r);
}
inline __m128i bf16_bits(__m256 v) {  // the bf16 of a value already rounded through bf16 (its top half)
  return pack_lanes16(_mm256_srli_epi32(_mm256_castps_si256(v), 16));
}
inline void store_bf16(uint16_t* p, __m128i b) { _mm_storeu_si128((__m128i*)p, b); }
inline void mask_store_bf16(int64_t n, uint16_t* p, __m128i b) {
  if (n >= 8) return store_bf16(p, b);
  alignas(16) uint16_t tmp[8];
  _mm_store_si128((__m128i*)tmp, b);
  if (n > 0) std::memcpy(p, tmp, static_cast<size_t>(n) * 2);
}

// y · 2^n for integral n in [-127, 128]: _mm512_scalef_ps's result (one rounding) for simd512.h's exp. The factor
// is split in two powers of two that are normal floats; the first product is exact (y in [0.5, 2]), the second
// rounds once.
inline __m256 scale2(__m256 y, __m256 n) {
  const __m256i ni = _mm256_cvtps_epi32(n);
  const __m256i a = _mm256_srai_epi32(ni, 1), b = _mm256_sub_epi32(ni, a);
  const __m256 pa = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(a, _mm256_set1_epi32(127)), 23));
  const __m256 pb = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(b, _mm256_set1_epi32(127)), 23));
  return _mm256_mul_ps(_mm256_mul_ps(y, pa), pb);
}
// exp(x): simd512.h's exp_x16 lane for lane (same clamp, Cephes polynomial, FMA chain, scaling)
inline __m256 exp(__m256 x) {
  x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.33654f)), _mm256_set1_ps(88.37626f));
  const __m256 fx = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                    _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  x = _mm256_fnmadd_ps(fx, _mm256_set1_ps(0.693359375f), x);
  x = _mm256_fnmadd_ps(fx, _mm256_set1_ps(-2.12194440e-4f), x);
  __m256 y = _mm256_set1_ps(1.9875691500E-4f);
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.3981999507E-3f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(8.3334519073E-3f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(4.1665795894E-2f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.6666665459E-1f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(5.0000001201E-1f));
  const __m256 x2 = _mm256_mul_ps(x, x);
  y = _mm256_fmadd_ps(y, x2, _mm256_add_ps(x, _mm256_set1_ps(1.0f)));
  return scale2(y, fx);
}
inline __m256 silu(__m256 v) {  // v / (1 + exp(-v)), torch's formula
  return _mm256_div_ps(v, _mm256_add_ps(_mm256_set1_ps(1.0f), exp(_mm256_sub_ps(_mm256_setzero_ps(), v))));
}
// Σ of 16 lanes held as lo = lanes 0-7, hi = lanes 8-15, by simd512.h reduce_add_x16's tree
inline float reduce_add16(__m256 lo, __m256 hi) {
  const __m256 t = _mm256_add_ps(hi, lo);
  const __m128 u = _mm_add_ps(_mm256_extractf128_ps(t, 1), _mm256_castps256_ps128(t));
  const __m128 w = _mm_add_ps(u, _mm_shuffle_ps(u, u, _MM_SHUFFLE(1, 0, 3, 2)));
  return _mm_cvtss_f32(_mm_add_ss(w, _mm_shuffle_ps(w, w, _MM_SHUFFLE(1, 1, 1, 1))));
}
inline float reduce_max(__m256 v) {  // max of 8 lanes (callers pass no NaN lanes)
  const __m128 a = _mm_max_ps(_mm256_extractf128_ps(v, 1), _mm256_castps256_ps128(v));
  const __m128 b = _mm_max_ps(a, _mm_shuffle_ps(a, a, _MM_SHUFFLE(1, 0, 3, 2)));
  return _mm_cvtss_f32(_mm_max_ss(b, _mm_shuffle_ps(b, b, _MM_SHUFFLE(1, 1, 1, 1))));
}

}  // namespace v8
}  // namespace dspark
