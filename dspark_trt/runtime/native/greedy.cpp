// Greedy acceptance statistics on the CPU (ISA-neutral: every engine's build compiles it): per verify row, the
// target's argmax (lowest index on ties, torch.argmax's rule) and the confidence signals of spec_decode.accept —
// top-1 probability 1/Σexp(l − max) and top-1 − top-2 margin — from two passes over the logits (the engine's
// top2_row and sumexp_row), instead of ATen's softmax + topk + argmax over [B, K+1, V]. Rows past a request's k
// are skipped (argmax 0, statistics 0). Rows are independent: batch-invariant by construction.
#include "common.h"

namespace dspark {

void top2_lanes(const float* best, const float* second, const int32_t* idx, int lanes, int64_t* arg, float* m1,
                float* m2) {
  float mx = -INFINITY;
  for (int i = 0; i < lanes; ++i) mx = std::max(mx, best[i]);
  int at = -1;
  for (int i = 0; i < lanes; ++i)
    if (best[i] == mx && (at < 0 || idx[i] < idx[at])) at = i;
  float run = -INFINITY;  // the largest element other than the argmax: its lane's runner-up, every other lane's best
  for (int i = 0; i < lanes; ++i) run = std::max(run, i == at ? second[i] : best[i]);
  *arg = at < 0 ? 0 : idx[at];
  *m1 = mx;
  *m2 = run;
}

std::vector<at::Tensor> greedy_stats(const at::Tensor& logits, const at::Tensor& k) {
  TORCH_CHECK(logits.dim() == 3 && logits.scalar_type() == at::kFloat && logits.is_contiguous(),
              "greedy_stats: logits [B, K+1, V] contiguous float32");
  TORCH_CHECK(k.dim() == 1 && k.scalar_type() == at::kLong && k.size(0) == logits.size(0), "greedy_stats: k [B] int64");
  const int64_t B = logits.size(0), P = logits.size(1), V = logits.size(2);
  at::Tensor arg = at::zeros({B, P}, k.options());
  at::Tensor top1 = at::zeros({B, P}, logits.options()), margin = at::zeros({B, P}, logits.options());
  at::Tensor ok = at::ones({B * P}, at::TensorOptions().dtype(at::kBool));
  const float* x = logits.data_ptr<float>();
  const int64_t* kp = k.data_ptr<int64_t>();
  int64_t* ap = arg.data_ptr<int64_t>();
  float* t1 = top1.data_ptr<float>();
  float* mg = margin.data_ptr<float>();
  bool* okp = ok.data_ptr<bool>();
  at::parallel_for(0, B * P, 1, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      if (r % P > kp[r / P]) continue;  // past this request's k: ignored, as in spec_decode.accept
      float m1, m2;
      if (!top2_row(x + r * V, V, ap + r, &m1, &m2) || m1 == -INFINITY) {  // NaN or all −inf: torch's rules
        okp[r] = false;
        continue;
      }
      const float s = sumexp_row(x + r * V, V, m1);
      t1[r] = 1.0f / s;
      mg[r] = t1[r] - std::exp(m2 - m1) / s;
    }
  });
  return {arg, top1, margin, ok};
}

}  // namespace dspark
