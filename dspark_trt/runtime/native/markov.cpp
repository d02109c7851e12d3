// The greedy DSpark Markov block on the CPU, in one call (ISA-neutral: every engine's build compiles it): for
// k = 1..γ, w1x = W1[x_{k-1}], bias = W2·w1x (the engine's row-invariant product, rounded to the param dtype, as
// fp32), i_k = argmax(U_k + bias) (the engine's argmax_sum: lowest index on ties, the first NaN, as torch.argmax),
// x_k = d2t[i_k]. The same arithmetic as kernels/block_draft/reference.py's greedy rows with runtime.dispatch's
// native bias, without γ round trips through Python and ATen.
#include "common.h"

namespace dspark {

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
