// The greedy DSpark Markov block on the CPU, AVX2 + FMA engine: the same indices as ../draft.cpp (its AVX-512 twin)
// for every input. For k = 1..γ, w1x = W1[x_{k-1}], bias = W2·w1x (the runtime's row-invariant product, rounded to
// the param dtype, as fp32), i_k = argmax(U_k + bias) (lowest index on ties, as torch.argmax), x_k = d2t[i_k].
#include "../simd256.h"

namespace dspark {
namespace {

// argmax_v (u[v] + b[v]) over n fp32 values: the first index of the maximum. Each lane keeps its first maximum
// (strict >), the lanes equal to the overall maximum give the lowest index: the twin's result, which does not
// depend on the lane count. A NaN sum is never greater, so it is skipped, as in the twin (whose `at == 0` branch
// cannot be reached: the maximum lane always equals the maximum); all sums NaN or −inf give 0, as there.
int64_t argmax_sum(const float* u, const float* b, int64_t n) {
  const __m256 ninf = _mm256_set1_ps(-INFINITY);
  __m256 best = ninf;
  __m256i bidx = _mm256_setzero_si256(), idx = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  const __m256i step = _mm256_set1_epi32(8);
  for (int64_t v = 0; v < n; v += 8) {
    __m256 l;
    if (n - v >= 8) {
      l = _mm256_add_ps(_mm256_loadu_ps(u + v), _mm256_loadu_ps(b + v));
    } else {  // lanes past n: −inf
      l = _mm256_blendv_ps(ninf, _mm256_add_ps(v8::maskz_load(n - v, u + v), v8::maskz_load(n - v, b + v)),
                           _mm256_castsi256_ps(v8::lanes(n - v)));
    }
    const __m256 gt = _mm256_cmp_ps(l, best, _CMP_GT_OQ);
    best = _mm256_blendv_ps(best, l, gt);
    bidx = _mm256_blendv_epi8(bidx, idx, _mm256_castps_si256(gt));
    idx = _mm256_add_epi32(idx, step);
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

}  // namespace

at::Tensor markov_greedy(const at::Tensor& U, const at::Tensor& anchor, const at::Tensor& w1, const at::Tensor& w2p,
                         const at::Tensor& rowsum, int64_t kind, int64_t vd, const c10::optional<at::Tensor>& d2t) {
  TORCH_CHECK(U.dim() == 3 && U.scalar_type() == at::kFloat && U.is_contiguous() && U.size(2) == vd,
              "markov_greedy: U [B, γ, Vd] contiguous float32");
  TORCH_CHECK(w1.dim() == 2 && w1.is_contiguous(), "markov_greedy: W1 [Vt, r] contiguous");
  TORCH_CHECK(anchor.dim() == 1 && anchor.size(0) == U.size(0) && anchor.scalar_type() == at::kLong,
              "markov_greedy: anchor [B] int64");
  const int64_t B = U.size(0), G = U.size(1), r = w1.size(1), vt = w1.size(0);
  const int64_t* map = nullptr;
  if (d2t.has_value()) {
    TORCH_CHECK(d2t->scalar_type() == at::kLong && d2t->is_contiguous() && d2t->numel() == vd, "markov_greedy: d2t [Vd]");
    map = d2t->data_ptr<int64_t>();
  }
  at::Tensor out = at::empty({2, B, G}, anchor.options());  // [0]: draft-vocab ids, [1]: target ids
  int64_t* ids = out.data_ptr<int64_t>();
  int64_t* toks = ids + B * G;
  std::vector<int64_t> prev(anchor.data_ptr<int64_t>(), anchor.data_ptr<int64_t>() + B);
  at::Tensor x = at::empty({B, r}, w1.options());  // [B, r] W1 rows of the previous tokens
  const int64_t row_bytes = r * w1.element_size();
  const float* u = U.data_ptr<float>();
  for (int64_t k = 0; k < G; ++k) {
    for (int64_t b = 0; b < B; ++b) {
      TORCH_CHECK(prev[b] >= 0 && prev[b] < vt, "markov_greedy: token id outside W1");
      std::memcpy(static_cast<char*>(x.data_ptr()) + b * row_bytes,
                  static_cast<const char*>(w1.data_ptr()) + prev[b] * row_bytes, row_bytes);
    }
    const at::Tensor bias = linear(x, w2p, rowsum, kind, vd, false, c10::nullopt, c10::nullopt, false, c10::nullopt,
                                   c10::nullopt, 0.0, c10::nullopt, 0.0, true);  // [B, Vd] fp32
    const float* bp = bias.data_ptr<float>();
    for (int64_t b = 0; b < B; ++b) {
      const int64_t i = argmax_sum(u + (b * G + k) * vd, bp + b * vd, vd);
      ids[b * G + k] = i;
      prev[b] = map ? map[i] : i;
      toks[b * G + k] = prev[b];
    }
  }
  return out;
}

}  // namespace dspark
