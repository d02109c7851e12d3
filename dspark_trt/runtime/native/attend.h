// Per-query attention scaffolding shared by the engines' attention.cpp (ISA-neutral): the arguments, their checks,
// zeros for queries past a row's length, and the split into (row, kv head, query chunk) units over the threads.
// Each engine passes `unit(a, is_bf16, DV, b, g, t0, t1)`: its kernel for queries t0..t1-1 of row b, kv head g
// (D = 16·DV); a query's bits depend on its own position, q and keys only, never on the unit split.
//
// q [M = B·T, H·D]; ck/cv [S, Hkv, max_seq, D] holding this step's keys → out [M, H·D]; or packed (offsets [B]: row
// b's queries are rows offsets[b] .. offsets[b] + lengths[b] − 1 of q and out, M = Σ lengths, no padding rows — a
// ragged verify or prefill without copies to and from the padded layout; each query's bits are the same). Query (b, t) at position
// p = starts[b] + t attends keys lo..p of slot slots[b] (lo = p − window + 1 with a sliding window, else 0); rows
// t ≥ lengths[b] get zeros. bidir: every query of row b attends keys lo..starts[b] + lengths[b] − 1 (a block that
// sees itself whole).
#pragma once
#include "common.h"

namespace dspark {

struct AttnArgs {
  const char *q, *k, *v;
  char* out;
  const int64_t *slots, *starts, *lengths;
  int64_t H, Hkv, G, MS, T;
  int64_t window;
  float scale;
  bool bidir;  // every query of a row sees the row's whole span (starts + lengths − 1), not just keys ≤ its own
  const int64_t* offsets;  // packed layout: row b's first query row (nullptr: the padded layout, b · T)
  int64_t row0(int64_t b) const { return offsets != nullptr ? offsets[b] : b * T; }
};

template <typename Unit>
at::Tensor attend_with(const at::Tensor& q, const at::Tensor& ck, const at::Tensor& cv, const at::Tensor& slots,
                       const at::Tensor& starts, const at::Tensor& lengths, int64_t H, int64_t window, double scale,
                       bool bidir, const c10::optional<at::Tensor>& offsets, Unit&& unit) {
  TORCH_CHECK(q.is_contiguous() && ck.is_contiguous() && cv.is_contiguous(), "attend: contiguous tensors");
  const bool is_bf16 = q.scalar_type() == at::kBFloat16;
  TORCH_CHECK(ck.scalar_type() == q.scalar_type() && cv.scalar_type() == q.scalar_type(), "attend: dtypes");
  const int64_t Hkv = ck.size(1), D = ck.size(3), B = slots.size(0), M = q.size(0);
  const int64_t DV = D / 16;
  TORCH_CHECK(q.size(1) == H * D && D % 16 == 0 && (DV & (DV - 1)) == 0 && DV <= 16,
              "attend: head_dim must be 16, 32, 64, 128 or 256");
  TORCH_CHECK(H % Hkv == 0 && H / Hkv <= 64, "attend: heads must be a multiple of kv heads (≤ 64 per group)");
  at::Tensor out = at::empty({M, H * D}, q.options());
  const bool packed = offsets.has_value() && offsets->defined();
  const int64_t* lens = lengths.data_ptr<int64_t>();
  int64_t T = B > 0 ? M / B : 0;
  if (packed) {
    TORCH_CHECK(offsets->scalar_type() == at::kLong && offsets->is_contiguous() && offsets->numel() == B,
                "attend: offsets must be [B] contiguous int64");
    const int64_t* off = offsets->data_ptr<int64_t>();
    T = 0;
    for (int64_t b = 0; b < B; ++b) {
      TORCH_CHECK(lens[b] >= 0 && off[b] >= 0 && off[b] + lens[b] <= M, "attend: packed rows out of q's range");
      T = std::max(T, lens[b]);
    }
  }
  AttnArgs a{static_cast<const char*>(q.data_ptr()), static_cast<const char*>(ck.data_ptr()),
             static_cast<const char*>(cv.data_ptr()), static_cast<char*>(out.data_ptr()), slots.data_ptr<int64_t>(),
             starts.data_ptr<int64_t>(), lens, H, Hkv, H / Hkv, ck.size(2), T, window,
             static_cast<float>(scale), bidir, packed ? offsets->data_ptr<int64_t>() : nullptr};
  int64_t total = 0;
  for (int64_t b = 0; b < B; ++b) {
    total += a.lengths[b] * (a.starts[b] + a.lengths[b]);
    const int64_t real = std::max<int64_t>(0, std::min<int64_t>(a.lengths[b], a.T));
    if (!packed && real < a.T)  // queries past the row's length: zeros
      std::memset(static_cast<char*>(out.data_ptr()) + (b * a.T + real) * H * D * q.element_size(), 0,
                  (a.T - real) * H * D * q.element_size());
  }
  // units: (row, kv head, query chunk). Causal with fewer (row, kv head) pairs than 2 per thread (verify of one
  // request): queries in chunks of ≥ 4, so the threads share the work evenly (each chunk widens its keys once more).
  const int64_t pairs = B * Hkv, nth = at::get_num_threads();
  const int64_t chunks = (bidir || pairs >= 2 * nth) ? 1 : std::max<int64_t>(1, std::min((2 * nth + pairs - 1) / pairs, a.T / 4));
  const int64_t tq = (a.T + chunks - 1) / chunks;
  const int64_t units = pairs * chunks;
  const int64_t grain = total * H * D < (1 << 16) ? units : 1;
  at::parallel_for(0, units, grain, [&](int64_t u0, int64_t u1) {
    for (int64_t u = u0; u < u1; ++u) {
      const int64_t pr = u / chunks, t0 = (u % chunks) * tq;
      unit(a, is_bf16, DV, pr / Hkv, pr % Hkv, t0, t0 + tq);
    }
  });
  return out;
}

}  // namespace dspark
