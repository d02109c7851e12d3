// argmax of the Markov block on the AVX2 + FMA engine (markov.cpp calls it): the index ../draft.cpp (its AVX-512
// twin) gives for every input — the first index of the maximum of u + b, or of the first NaN (torch.argmax).
#include "../simd256.h"

namespace dspark {

// Each lane keeps its first maximum (strict >); of the lanes equal to the overall maximum the lowest index wins,
// which does not depend on the lane count; lanes past n are −inf; all sums −inf give 0.
int64_t argmax_sum(const float* u, const float* b, int64_t n) {
  const __m256 ninf = _mm256_set1_ps(-INFINITY);
  __m256 best = ninf;
  __m256i bidx = _mm256_setzero_si256(), idx = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  const __m256i step = _mm256_set1_epi32(8);
  __m256 nan = _mm256_setzero_ps();
  for (int64_t v = 0; v < n; v += 8) {
    __m256 l;
    if (n - v >= 8) {
      l = _mm256_add_ps(_mm256_loadu_ps(u + v), _mm256_loadu_ps(b + v));
    } else {  // lanes past n: −inf
      l = _mm256_blendv_ps(ninf, _mm256_add_ps(v8::maskz_load(n - v, u + v), v8::maskz_load(n - v, b + v)),
                           _mm256_castsi256_ps(v8::lanes(n - v)));
    }
    nan = _mm256_or_ps(nan, _mm256_cmp_ps(l, l, _CMP_UNORD_Q));
    const __m256 gt = _mm256_cmp_ps(l, best, _CMP_GT_OQ);
    best = _mm256_blendv_ps(best, l, gt);
    bidx = _mm256_blendv_epi8(bidx, idx, _mm256_castps_si256(gt));
    idx = _mm256_add_epi32(idx, step);
  }
  if (_mm256_movemask_ps(nan)) {  // torch.argmax returns the first NaN
    for (int64_t v = 0; v < n; ++v)
      if (std::isnan(u[v] + b[v])) return v;
  }
  const float mx = v8::reduce_max(best);
  alignas(32) float bl[8];
  alignas(32) int32_t il[8];
  _mm256_store_ps(bl, best);
  _mm256_store_si256(reinterpret_cast<__m256i*>(il), bidx);
  int64_t first = INT64_MAX;
  for (int i = 0; i < 8; ++i)
    if (bl[i] == mx) first = std::min<int64_t>(first, il[i]);
  return first;
}

}  // namespace dspark

namespace dspark {

// Greedy acceptance statistics of one logits row on the AVX2 engine: ../draft.cpp's values for every input. The 16
// lanes of the AVX-512 engine are two registers here (lo = lanes 0-7, hi = 8-15), each lane fed in the same order.
bool top2_row(const float* x, int64_t n, int64_t* arg, float* m1, float* m2) {
  const __m256 ninf = _mm256_set1_ps(-INFINITY);
  __m256 best[2] = {ninf, ninf}, second[2] = {ninf, ninf}, nan = _mm256_setzero_ps();
  __m256i bidx[2] = {_mm256_setzero_si256(), _mm256_setzero_si256()};
  __m256i idx[2] = {_mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7), _mm256_setr_epi32(8, 9, 10, 11, 12, 13, 14, 15)};
  const __m256i step = _mm256_set1_epi32(16);
  for (int64_t v = 0; v < n; v += 16) {
    for (int h = 0; h < 2; ++h) {
      const int64_t left = n - v - 8 * h;
      const __m256 l = left >= 8 ? _mm256_loadu_ps(x + v + 8 * h)
                                 : _mm256_blendv_ps(ninf, v8::maskz_load(left, x + v + 8 * h),
                                                    _mm256_castsi256_ps(v8::lanes(left)));
      nan = _mm256_or_ps(nan, _mm256_cmp_ps(l, l, _CMP_UNORD_Q));
      second[h] = _mm256_max_ps(second[h], _mm256_min_ps(l, best[h]));
      const __m256 gt = _mm256_cmp_ps(l, best[h], _CMP_GT_OQ);
      best[h] = _mm256_blendv_ps(best[h], l, gt);
      bidx[h] = _mm256_blendv_epi8(bidx[h], idx[h], _mm256_castps_si256(gt));
      idx[h] = _mm256_add_epi32(idx[h], step);
    }
  }
  if (_mm256_movemask_ps(nan)) return false;
  alignas(32) float bl[16], sl[16];
  alignas(32) int32_t il[16];
  for (int h = 0; h < 2; ++h) {
    _mm256_store_ps(bl + 8 * h, best[h]);
    _mm256_store_ps(sl + 8 * h, second[h]);
    _mm256_store_si256(reinterpret_cast<__m256i*>(il + 8 * h), bidx[h]);
  }
  top2_lanes(bl, sl, il, 16, arg, m1, m2);
  return true;
}

float sumexp_row(const float* x, int64_t n, float m) {  // ../draft.cpp sumexp_row, lane for lane
  __m256 lo = _mm256_setzero_ps(), hi = _mm256_setzero_ps();
  const __m256 mv = _mm256_set1_ps(m);
  for (int64_t v = 0; v < n; v += 16) {
    const int64_t a = n - v, b = n - v - 8;
    const __m256 ea = _mm256_and_ps(v8::exp(_mm256_sub_ps(v8::maskz_load(a, x + v), mv)), _mm256_castsi256_ps(v8::lanes(a)));
    const __m256 eb = _mm256_and_ps(v8::exp(_mm256_sub_ps(v8::maskz_load(b, x + v + 8), mv)), _mm256_castsi256_ps(v8::lanes(b)));
    lo = _mm256_add_ps(lo, ea);
    hi = _mm256_add_ps(hi, eb);
  }
  return v8::reduce_add16(lo, hi);
}

}  // namespace dspark
