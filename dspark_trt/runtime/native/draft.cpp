// argmax of the Markov block on the AVX-512 engine (markov.cpp calls it): the first index of the maximum of
// u + b, or of the first NaN (torch.argmax's rules). avx2/draft.cpp computes the same index.
#include "simd512.h"

namespace dspark {

int64_t argmax_sum(const float* u, const float* b, int64_t n) {
  const __m512 ninf = _mm512_set1_ps(-INFINITY);
  __m512 best = ninf;
  __m512i bidx = _mm512_setzero_si512(), idx = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  const __m512i step = _mm512_set1_epi32(16);
  __mmask16 nan = 0;
  for (int64_t v = 0; v < n; v += 16) {
    const __mmask16 mk = tail16(n - v);
    const __m512 l = _mm512_mask_add_ps(ninf, mk, _mm512_maskz_loadu_ps(mk, u + v), _mm512_maskz_loadu_ps(mk, b + v));
    nan |= _mm512_cmp_ps_mask(l, l, _CMP_UNORD_Q);
    const __mmask16 gt = _mm512_cmp_ps_mask(l, best, _CMP_GT_OQ);  // strict: a lane keeps its first maximum
    best = _mm512_mask_mov_ps(best, gt, l);
    bidx = _mm512_mask_mov_epi32(bidx, gt, idx);
    idx = _mm512_add_epi32(idx, step);
  }
  if (nan) {  // torch.argmax returns the first NaN
    for (int64_t v = 0; v < n; ++v)
      if (std::isnan(u[v] + b[v])) return v;
  }
  const float mx = _mm512_reduce_max_ps(best);
  const __mmask16 at = _mm512_cmp_ps_mask(best, _mm512_set1_ps(mx), _CMP_EQ_OQ);
  return _mm512_mask_reduce_min_epi32(at, bidx);
}

}  // namespace dspark

namespace dspark {

// Greedy acceptance statistics of one logits row on the AVX-512 engine (greedy.cpp calls them); avx2/draft.cpp
// computes the same values. Lane i of 16 sees elements v ≡ i (mod 16), in order.
// top2_row: the maximum, its first index (lowest on ties) and the largest other element (= the maximum when it
// occurs twice); false when the row holds a NaN (the caller falls back to torch).
bool top2_row(const float* x, int64_t n, int64_t* arg, float* m1, float* m2) {
  const __m512 ninf = _mm512_set1_ps(-INFINITY);
  __m512 best = ninf, second = ninf;
  __m512i bidx = _mm512_setzero_si512(), idx = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  const __m512i step = _mm512_set1_epi32(16);
  __mmask16 nan = 0;
  for (int64_t v = 0; v < n; v += 16) {
    const __mmask16 mk = tail16(n - v);
    const __m512 l = _mm512_mask_loadu_ps(ninf, mk, x + v);
    nan |= _mm512_cmp_ps_mask(l, l, _CMP_UNORD_Q);
    second = _mm512_max_ps(second, _mm512_min_ps(l, best));  // the lane's runner-up (a tie with best included)
    const __mmask16 gt = _mm512_cmp_ps_mask(l, best, _CMP_GT_OQ);  // strict: a lane keeps its first maximum
    best = _mm512_mask_mov_ps(best, gt, l);
    bidx = _mm512_mask_mov_epi32(bidx, gt, idx);
    idx = _mm512_add_epi32(idx, step);
  }
  if (nan) return false;
  alignas(64) float bl[16], sl[16];
  alignas(64) int32_t il[16];
  _mm512_store_ps(bl, best);
  _mm512_store_ps(sl, second);
  _mm512_store_si512(il, bidx);
  top2_lanes(bl, sl, il, 16, arg, m1, m2);
  return true;
}

// Σ exp(x − m) over the row: 16 lane sums (exp_x16), reduced by reduce_add_x16's tree
float sumexp_row(const float* x, int64_t n, float m) {
  __m512 acc = _mm512_setzero_ps();
  const __m512 mv = _mm512_set1_ps(m);
  for (int64_t v = 0; v < n; v += 16) {
    const __mmask16 mk = tail16(n - v);
    acc = _mm512_add_ps(acc, _mm512_maskz_mov_ps(mk, exp_x16(_mm512_sub_ps(_mm512_maskz_loadu_ps(mk, x + v), mv))));
  }
  return reduce_add_x16(acc);
}

}  // namespace dspark
