// RoPE + KV-cache write and per-query attention of the dspark_trt native kernels.
//
// A query's attention output depends only on its own position, its q vector and the cached keys/values it may see:
// scores in fp32 over keys lo..p in order, softmax with common.h's exp, P·V accumulated in fp32 key by key. No span
// padding, no batching across queries, so decode, verify and batched rows all give the same bits.
#include "common.h"

namespace dspark {

// qkv [M = B·T, (H + 2·Hkv)·D] → q [M, H·D] with RoPE; k (RoPE'd) and v written to ck/cv [S, Hkv, max_seq, D] at
// (slots[b], :, pos[b, t]). cos/sin [P, D] in the model dtype. RoPE numerics as torch: x·cos and rot·sin rounded,
// then their sum rounded (bf16); rot = [-x2, x1].
at::Tensor rope_kv(const at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin, const at::Tensor& pos,
                   at::Tensor& ck, at::Tensor& cv, const at::Tensor& slots, int64_t H, int64_t Hkv) {
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
    if (half % 16 == 0) {  // 16 lanes at a time; the partner of chunk d is d ± half
      for (int64_t d = 0; d < D; d += 16) {
        const bool first = d < half;
        const int64_t pd = first ? d + half : d - half;
        __m512 x, r, cv_, sv;
        if constexpr (std::is_same<T_, bf16>::value) {
          x = load_bf16x16(reinterpret_cast<const uint16_t*>(src) + d);
          r = load_bf16x16(reinterpret_cast<const uint16_t*>(src) + pd);
          cv_ = load_bf16x16(reinterpret_cast<const uint16_t*>(c) + d);
          sv = load_bf16x16(reinterpret_cast<const uint16_t*>(s) + d);
        } else {
          x = _mm512_loadu_ps(src + d);
          r = _mm512_loadu_ps(src + pd);
          cv_ = _mm512_loadu_ps(c + d);
          sv = _mm512_loadu_ps(s + d);
        }
        if (first) r = _mm512_sub_ps(_mm512_setzero_ps(), r);
        if constexpr (std::is_same<T_, bf16>::value) {
          const __m512 y = round_bf16_x16(_mm512_add_ps(round_bf16_x16(_mm512_mul_ps(x, cv_)), round_bf16_x16(_mm512_mul_ps(r, sv))));
          _mm256_storeu_si256(reinterpret_cast<__m256i*>(reinterpret_cast<uint16_t*>(dst) + d), f2b_x16(y));
        } else {
          _mm512_storeu_ps(dst + d, _mm512_add_ps(_mm512_mul_ps(x, cv_), _mm512_mul_ps(r, sv)));
        }
      }
      return;
    }
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

namespace {

// 16 vectors → one vector of their 16 horizontal sums (lane i = Σ v[i]), by a fixed tree: halves, then quarters,
// then pairs, then neighbours. Every input is summed in the same pattern whatever its index, so a key's score does
// not depend on which other keys share its block of 16.
inline __m512 hsum16(const __m512* v) {
  __m512 t[8], u[4], w[2];
  for (int i = 0; i < 8; ++i) {
    t[i] = _mm512_add_ps(_mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], 0x44), _mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], 0xEE));
  }
  for (int i = 0; i < 4; ++i) {
    u[i] = _mm512_add_ps(_mm512_shuffle_f32x4(t[2 * i], t[2 * i + 1], 0x88), _mm512_shuffle_f32x4(t[2 * i], t[2 * i + 1], 0xDD));
  }
  for (int i = 0; i < 2; ++i) {
    w[i] = _mm512_add_ps(_mm512_shuffle_ps(u[2 * i], u[2 * i + 1], 0x44), _mm512_shuffle_ps(u[2 * i], u[2 * i + 1], 0xEE));
  }
  const __m512 z = _mm512_add_ps(_mm512_shuffle_ps(w[0], w[1], 0x88), _mm512_shuffle_ps(w[0], w[1], 0xDD));
  // key i ended in lane (i % 4) * 4 + i / 4
  return _mm512_permutexvar_ps(_mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15), z);
}

}  // namespace

namespace {

struct AttnArgs {
  const char *q, *k, *v;
  char* out;
  const int64_t *slots, *starts, *lengths;
  int64_t H, Hkv, G, MS, T;
  int64_t window;
  float scale;
  bool bidir;  // every query of a row sees the row's whole span (starts + lengths − 1), not just keys ≤ its own
};

template <bool BF16>
inline __m512 ld16(const char* base, int64_t idx) {  // 16 elements of a bf16 / fp32 row, as fp32
  if constexpr (BF16) return load_bf16x16(reinterpret_cast<const uint16_t*>(base) + idx);
  else return _mm512_loadu_ps(reinterpret_cast<const float*>(base) + idx);
}

// One (request b, kv head g) unit: every real query t of row b, its G query heads over keys lo..p. The keys and
// values the row can see are widened to fp32 once (scratch kf / vf) and shared by all its queries and heads.
template <bool BF16, int DV>
void attend_unit(const AttnArgs& a, int64_t b, int64_t g, std::vector<float>& kf, std::vector<float>& vf,
                 std::vector<float>& sbuf) {
  constexpr int64_t D = 16 * DV;
  const int64_t nq = a.lengths[b], G = a.G, H = a.H;
  if (nq <= 0) return;
  const int64_t p_first = a.starts[b], p_last = a.starts[b] + nq - 1;
  const int64_t lo0 = a.window > 0 ? std::max<int64_t>(0, p_first - a.window + 1) : 0;
  const int64_t nk = p_last - lo0 + 1, nkp = (nk + 15) / 16 * 16;
  const int64_t kv_off = ((a.slots[b] * a.Hkv + g) * a.MS + lo0) * D;  // element offset of key lo0
  const float *K, *V;
  if constexpr (BF16) {
    kf.resize(nkp * D);
    vf.resize(nk * D);
    for (int64_t j = 0; j < nk; ++j)
      for (int c = 0; c < DV; ++c) {
        _mm512_storeu_ps(kf.data() + j * D + 16 * c, ld16<true>(a.k, kv_off + j * D + 16 * c));
        _mm512_storeu_ps(vf.data() + j * D + 16 * c, ld16<true>(a.v, kv_off + j * D + 16 * c));
      }
    K = kf.data();
    V = vf.data();
  } else {
    K = reinterpret_cast<const float*>(a.k) + kv_off;
    V = reinterpret_cast<const float*>(a.v) + kv_off;
  }
  const __m512 sc = _mm512_set1_ps(a.scale);
  for (int64_t t = 0; t < nq; ++t) {
    const int64_t m = b * a.T + t, p = a.bidir ? p_last : p_first + t;
    const int64_t lo = a.window > 0 ? std::max<int64_t>(0, p - a.window + 1) : 0;
    const int64_t n = p - lo + 1, np = (n + 15) / 16 * 16, j_off = lo - lo0;
    sbuf.assign(np, 0.0f);
    for (int64_t hh = 0; hh < G; ++hh) {
      __m512 qv[DV];
      for (int c = 0; c < DV; ++c) qv[c] = ld16<BF16>(a.q, m * H * D + (g * G + hh) * D + 16 * c);
      for (int64_t j0 = 0; j0 < n; j0 += 16) {  // scores, keys in blocks of 16 (missing keys: zeros)
        const int64_t nb = std::min<int64_t>(16, n - j0);
        __m512 acc[16];
        for (int i = 0; i < 16; ++i) {
          acc[i] = _mm512_setzero_ps();
          if (i < nb) {
            const float* kr = K + (j_off + j0 + i) * D;
            for (int c = 0; c < DV; ++c) acc[i] = _mm512_fmadd_ps(qv[c], _mm512_loadu_ps(kr + 16 * c), acc[i]);
          }
        }
        _mm512_storeu_ps(sbuf.data() + j0, _mm512_mul_ps(hsum16(acc), sc));
      }
      float* s = sbuf.data();  // softmax numerators in place
      float mx = -INFINITY;
      for (int64_t j = 0; j < n; ++j) mx = std::max(mx, s[j]);
      const __m512 mv = _mm512_set1_ps(mx);
      __m512 lacc = _mm512_setzero_ps();
      for (int64_t j = 0; j < n; j += 16) {
        const __m512 e = _mm512_maskz_mov_ps(tail16(n - j), exp_x16(_mm512_sub_ps(_mm512_loadu_ps(s + j), mv)));
        _mm512_storeu_ps(s + j, e);
        lacc = _mm512_add_ps(lacc, e);
      }
      const __m512 lv = _mm512_set1_ps(_mm512_reduce_add_ps(lacc));
      __m512 o[DV];
      for (int c = 0; c < DV; ++c) o[c] = _mm512_setzero_ps();
      for (int64_t j = 0; j < n; ++j) {  // P·V, key by key
        const __m512 pj = _mm512_set1_ps(s[j]);
        const float* vr = V + (j_off + j) * D;
        for (int c = 0; c < DV; ++c) o[c] = _mm512_fmadd_ps(pj, _mm512_loadu_ps(vr + 16 * c), o[c]);
      }
      const int64_t off = m * H * D + (g * G + hh) * D;
      for (int c = 0; c < DV; ++c) {
        const __m512 y = _mm512_div_ps(o[c], lv);
        if constexpr (BF16) {
          _mm256_storeu_si256(reinterpret_cast<__m256i*>(reinterpret_cast<uint16_t*>(a.out) + off + 16 * c), f2b_x16(y));
        } else {
          _mm512_storeu_ps(reinterpret_cast<float*>(a.out) + off + 16 * c, y);
        }
      }
    }
  }
}

template <bool BF16>
void attend_unit_d(const AttnArgs& a, int64_t DV, int64_t b, int64_t g, std::vector<float>& kf, std::vector<float>& vf,
                   std::vector<float>& sbuf) {
  switch (DV) {
    case 1: return attend_unit<BF16, 1>(a, b, g, kf, vf, sbuf);
    case 2: return attend_unit<BF16, 2>(a, b, g, kf, vf, sbuf);
    case 4: return attend_unit<BF16, 4>(a, b, g, kf, vf, sbuf);
    case 8: return attend_unit<BF16, 8>(a, b, g, kf, vf, sbuf);
    default: return attend_unit<BF16, 16>(a, b, g, kf, vf, sbuf);
  }
}

}  // namespace

// q [M = B·T, H·D]; ck/cv [S, Hkv, max_seq, D] holding this step's keys → out [M, H·D]. Query (b, t) at position
// p = starts[b] + t attends keys lo..p of slot slots[b] (lo = p − window + 1 with a sliding window, else 0); rows
// t ≥ lengths[b] get zeros. Scores fp32 (per key a fixed FMA chain over D, then hsum16 by blocks of 16 keys),
// softmax with common.h's exp, P·V accumulated in fp32 key by key.
// bidir: every query of row b attends keys lo..starts[b] + lengths[b] − 1 (a block that sees itself whole).
at::Tensor attend(const at::Tensor& q, const at::Tensor& ck, const at::Tensor& cv, const at::Tensor& slots,
                  const at::Tensor& starts, const at::Tensor& lengths, int64_t H, int64_t window, double scale,
                  bool bidir) {
  TORCH_CHECK(q.is_contiguous() && ck.is_contiguous() && cv.is_contiguous(), "attend: contiguous tensors");
  const bool is_bf16 = q.scalar_type() == at::kBFloat16;
  TORCH_CHECK(ck.scalar_type() == q.scalar_type() && cv.scalar_type() == q.scalar_type(), "attend: dtypes");
  const int64_t Hkv = ck.size(1), D = ck.size(3), B = slots.size(0), M = q.size(0);
  const int64_t DV = D / 16;
  TORCH_CHECK(q.size(1) == H * D && D % 16 == 0 && (DV & (DV - 1)) == 0 && DV <= 16,
              "attend: head_dim must be 16, 32, 64, 128 or 256");
  TORCH_CHECK(H % Hkv == 0 && H / Hkv <= 64, "attend: heads must be a multiple of kv heads (≤ 64 per group)");
  at::Tensor out = at::zeros({M, H * D}, q.options());
  AttnArgs a{static_cast<const char*>(q.data_ptr()), static_cast<const char*>(ck.data_ptr()),
             static_cast<const char*>(cv.data_ptr()), static_cast<char*>(out.data_ptr()), slots.data_ptr<int64_t>(),
             starts.data_ptr<int64_t>(), lengths.data_ptr<int64_t>(), H, Hkv, H / Hkv, ck.size(2), M / B, window,
             static_cast<float>(scale), bidir};
  int64_t total = 0;
  for (int64_t b = 0; b < B; ++b) total += a.lengths[b] * (a.starts[b] + a.lengths[b]);
  const int64_t units = B * Hkv;
  const int64_t grain = total * H * D < (1 << 16) ? units : 1;
  at::parallel_for(0, units, grain, [&](int64_t u0, int64_t u1) {
    std::vector<float> kf, vf, sbuf;
    for (int64_t u = u0; u < u1; ++u) {
      if (is_bf16) attend_unit_d<true>(a, DV, u / Hkv, u % Hkv, kf, vf, sbuf);
      else attend_unit_d<false>(a, DV, u / Hkv, u % Hkv, kf, vf, sbuf);
    }
  });
  return out;
}

}  // namespace dspark
