// RoPE + KV-cache write and per-query attention, AVX2 + FMA engine: the same bits as ../attention.cpp (its
// AVX-512 twin) for every input. Each of the twin's 16-lane vectors is two 8-lane halves here (lo = lanes 0-7,
// hi = lanes 8-15) doing the same per-lane operations in the same order; only the order of independent work
// (which key or head is computed first) differs, never the operations that make one output.
//
// A query's attention output depends only on its own position, its q vector and the cached keys/values it may see:
// scores in fp32 over keys lo..p in order, softmax with simd256.h's exp, P·V accumulated in fp32 key by key.
#include "../simd256.h"
#include "../rope.h"
#include "../attend.h"

namespace dspark {

// RoPE + KV write (rope.h): this engine's vector rotation of one head.
at::Tensor rope_kv(const at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin, const at::Tensor& pos,
                   at::Tensor& ck, at::Tensor& cv, const at::Tensor& slots, int64_t H, int64_t Hkv) {
  const int64_t D = ck.size(3), half = D / 2;
  return rope_kv_with(qkv, cos, sin, pos, ck, cv, slots, H, Hkv, [&](auto* src, auto* c, auto* s, auto* dst) {
    using T_ = std::remove_const_t<std::remove_pointer_t<decltype(src)>>;
    if (half % 8 == 0) {  // 8 lanes at a time; the partner of chunk d is d ± half
      // half % 16 == 0 is the twin's vector path, which negates as 0 − x; otherwise its scalar path, −x (the two
      // differ in the sign of a zero and of a NaN)
      const bool sub0 = half % 16 == 0;
      for (int64_t d = 0; d < D; d += 8) {
        const bool first = d < half;
        const int64_t pd = first ? d + half : d - half;
        __m256 x, r, cv_, sv;
        if constexpr (std::is_same<T_, bf16>::value) {
          x = v8::load_bf16(reinterpret_cast<const uint16_t*>(src) + d);
          r = v8::load_bf16(reinterpret_cast<const uint16_t*>(src) + pd);
          cv_ = v8::load_bf16(reinterpret_cast<const uint16_t*>(c) + d);
          sv = v8::load_bf16(reinterpret_cast<const uint16_t*>(s) + d);
        } else {
          x = _mm256_loadu_ps(src + d);
          r = _mm256_loadu_ps(src + pd);
          cv_ = _mm256_loadu_ps(c + d);
          sv = _mm256_loadu_ps(s + d);
        }
        if (first) r = sub0 ? _mm256_sub_ps(_mm256_setzero_ps(), r) : _mm256_xor_ps(r, _mm256_set1_ps(-0.0f));
        if constexpr (std::is_same<T_, bf16>::value) {
          const __m256 y = v8::round_bf16(_mm256_add_ps(v8::round_bf16(_mm256_mul_ps(x, cv_)),
                                                        v8::round_bf16(_mm256_mul_ps(r, sv))));
          v8::store_bf16(reinterpret_cast<uint16_t*>(dst) + d, v8::bf16_bits(y));
        } else {
          _mm256_storeu_ps(dst + d, _mm256_add_ps(_mm256_mul_ps(x, cv_), _mm256_mul_ps(r, sv)));
        }
      }
      return true;
    }
    return false;
  });
}

namespace {

// 4 keys' dot products with q [D = 16·DV]: per key the twin's 16-lane chain acc = fma(q, k, acc) over the D/16
// chunks from acc = 0 (lo / hi halves), then the first three levels of the twin's hsum16 tree for that key:
// A = Q0 + Q2, B = Q1 + Q3 (quarters Q = lanes 4i..4i+3), C = A + B, then c0 + c2 and c1 + c3.
// → [k0: c0+c2, c1+c3, k2: c0+c2, c1+c3 | k1: …, k3: …]
template <int DV>
inline __m256 dot4(const float* q, const float* const* kr) {
  __m256 lo[4], hi[4];
  for (int i = 0; i < 4; ++i) lo[i] = hi[i] = _mm256_setzero_ps();
  for (int c = 0; c < DV; ++c) {
    const __m256 ql = _mm256_loadu_ps(q + 16 * c), qh = _mm256_loadu_ps(q + 16 * c + 8);
    for (int i = 0; i < 4; ++i) {
      lo[i] = _mm256_fmadd_ps(ql, _mm256_loadu_ps(kr[i] + 16 * c), lo[i]);
      hi[i] = _mm256_fmadd_ps(qh, _mm256_loadu_ps(kr[i] + 16 * c + 8), hi[i]);
    }
  }
  __m256 t[4];  // [A | B] per key
  for (int i = 0; i < 4; ++i) t[i] = _mm256_add_ps(lo[i], hi[i]);
  const __m256 c01 = _mm256_add_ps(_mm256_permute2f128_ps(t[0], t[1], 0x20), _mm256_permute2f128_ps(t[0], t[1], 0x31));
  const __m256 c23 = _mm256_add_ps(_mm256_permute2f128_ps(t[2], t[3], 0x20), _mm256_permute2f128_ps(t[2], t[3], 0x31));
  return _mm256_add_ps(_mm256_shuffle_ps(c01, c23, 0x44), _mm256_shuffle_ps(c01, c23, 0xEE));
}

// scores of the 8 keys kr[0..7] → s[0..7]: (c0 + c2) + (c1 + c3) (hsum16's last level), · scale
template <int DV>
inline void scores8(const float* q, const float* const* kr, __m256 sc, float* s) {
  const __m256 a = dot4<DV>(q, kr), b = dot4<DV>(q, kr + 4);
  const __m256 z = _mm256_add_ps(_mm256_shuffle_ps(a, b, 0x88), _mm256_shuffle_ps(a, b, 0xDD));  // [k0 k2 k4 k6 | k1 k3 k5 k7]
  _mm256_storeu_ps(s, _mm256_mul_ps(_mm256_permutevar8x32_ps(z, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)), sc));
}

// softmax numerators of n scores s [n, padded to 16] in place, → their sum. The twin's 16 lanes as lo / hi: the
// lane-wise maximum (strict >, so a NaN score is skipped), std::max across the 16 lanes in order, exp(s − max)
// (zeros past n), the sum per lane l of the keys j ≡ l (mod 16) in order, reduced by reduce_add16's tree.
inline float softmax_num(float* s, int64_t n) {
  __m256 mlo = _mm256_set1_ps(-INFINITY), mhi = mlo;
  for (int64_t j = 0; j < n; j += 16) {
    const __m256 xl = _mm256_loadu_ps(s + j), xh = _mm256_loadu_ps(s + j + 8);
    const __m256 gl = _mm256_and_ps(_mm256_cmp_ps(xl, mlo, _CMP_GT_OQ), _mm256_castsi256_ps(v8::lanes(n - j)));
    const __m256 gh = _mm256_and_ps(_mm256_cmp_ps(xh, mhi, _CMP_GT_OQ), _mm256_castsi256_ps(v8::lanes(n - j - 8)));
    mlo = _mm256_blendv_ps(mlo, xl, gl);
    mhi = _mm256_blendv_ps(mhi, xh, gh);
  }
  alignas(32) float lanes[16];
  _mm256_store_ps(lanes, mlo);
  _mm256_store_ps(lanes + 8, mhi);
  float mx = -INFINITY;
  for (int i = 0; i < 16; ++i) mx = std::max(mx, lanes[i]);
  const __m256 mv = _mm256_set1_ps(mx);
  __m256 llo = _mm256_setzero_ps(), lhi = llo;
  for (int64_t j = 0; j < n; j += 16) {
    const __m256 el = _mm256_and_ps(v8::exp(_mm256_sub_ps(_mm256_loadu_ps(s + j), mv)), _mm256_castsi256_ps(v8::lanes(n - j)));
    const __m256 eh = _mm256_and_ps(v8::exp(_mm256_sub_ps(_mm256_loadu_ps(s + j + 8), mv)),
                                    _mm256_castsi256_ps(v8::lanes(n - j - 8)));
    _mm256_storeu_ps(s + j, el);
    _mm256_storeu_ps(s + j + 8, eh);
    llo = _mm256_add_ps(llo, el);
    lhi = _mm256_add_ps(lhi, eh);
  }
  return v8::reduce_add16(llo, lhi);
}

// P·V of NH query heads (numerators p + h·np, sums lsum[h]) over value columns [col, col + 8·CW), CW ≤ D / 8:
// o = fma(p_j, v_j, o) key by key, then o / lsum, stored to out rows off + h·D
template <bool BF16, int NH, int CW>
void pv_tile(const float* p, int64_t np, const float* V, int64_t D, int64_t n, int64_t col, const float* lsum,
             char* out, int64_t off) {
  __m256 o[NH][CW];
  for (int h = 0; h < NH; ++h)
    for (int c = 0; c < CW; ++c) o[h][c] = _mm256_setzero_ps();
  for (int64_t j = 0; j < n; ++j) {
    const float* vr = V + j * D + col;
    __m256 vv[CW];
    for (int c = 0; c < CW; ++c) vv[c] = _mm256_loadu_ps(vr + 8 * c);
    for (int h = 0; h < NH; ++h) {
      const __m256 pj = _mm256_set1_ps(p[h * np + j]);
      for (int c = 0; c < CW; ++c) o[h][c] = _mm256_fmadd_ps(pj, vv[c], o[h][c]);
    }
  }
  for (int h = 0; h < NH; ++h) {
    const __m256 lv = _mm256_set1_ps(lsum[h]);
    const int64_t at = off + h * D + col;
    for (int c = 0; c < CW; ++c) {
      const __m256 y = _mm256_div_ps(o[h][c], lv);
      if constexpr (BF16) v8::store_bf16(reinterpret_cast<uint16_t*>(out) + at + 8 * c, v8::f2b(y));
      else _mm256_storeu_ps(reinterpret_cast<float*>(out) + at + 8 * c, y);
    }
  }
}

template <bool BF16, int NH, int CW>
void pv_heads(const float* p, int64_t np, const float* V, int64_t D, int64_t n, const float* lsum, char* out,
              int64_t off) {
  for (int64_t col = 0; col < D; col += 8 * CW) pv_tile<BF16, NH, CW>(p, np, V, D, n, col, lsum, out, off);
}

// One (request b, kv head g, queries t0..t1-1) unit: each real query t of the range, its G query heads over keys
// lo..p. The keys and values the range can see are widened to fp32 once (scratch kf / vf) and shared by its queries
// and heads; each block of 8 keys is scored for all G heads while it is in L1.
template <bool BF16, int DV>
void attend_unit(const AttnArgs& a, int64_t b, int64_t g, int64_t t0, int64_t t1, std::vector<float>& kf,
                 std::vector<float>& vf, std::vector<float>& sbuf, std::vector<float>& qf) {
  constexpr int64_t D = 16 * DV, C8 = 2 * DV;  // C8: 8-lane chunks in a row
  const int64_t nq = a.lengths[b], G = a.G, H = a.H;
  t1 = std::min(t1, nq);
  if (t0 >= t1) return;
  // the keys queries t0..t1-1 can see: from the first one's window start to the last one's position
  const int64_t p_first = a.starts[b] + (a.bidir ? 0 : t0), p_last = a.starts[b] + (a.bidir ? nq : t1) - 1;
  const int64_t lo0 = a.window > 0 ? std::max<int64_t>(0, p_first - a.window + 1) : 0;
  const int64_t nk = p_last - lo0 + 1;
  const int64_t kv_off = ((a.slots[b] * a.Hkv + g) * a.MS + lo0) * D;  // element offset of key lo0
  const float *K, *V;
  if constexpr (BF16) {
    if (static_cast<int64_t>(kf.size()) < nk * D) kf.resize(nk * D);  // scratch kept per thread: no refill
    if (static_cast<int64_t>(vf.size()) < nk * D) vf.resize(nk * D);
    float* kd = kf.data();
    float* vd = vf.data();
    const uint16_t* ks = reinterpret_cast<const uint16_t*>(a.k) + kv_off;
    const uint16_t* vs = reinterpret_cast<const uint16_t*>(a.v) + kv_off;
    for (int64_t e = 0; e < nk * D; e += 8) {  // keys lo0..p_last are contiguous rows of D
      _mm256_storeu_ps(kd + e, v8::load_bf16(ks + e));
      _mm256_storeu_ps(vd + e, v8::load_bf16(vs + e));
    }
    K = kd;
    V = vd;
  } else {
    K = reinterpret_cast<const float*>(a.k) + kv_off;
    V = reinterpret_cast<const float*>(a.v) + kv_off;
  }
  if (static_cast<int64_t>(qf.size()) < G * D) qf.resize(G * D);
  const __m256 sc = _mm256_set1_ps(a.scale);
  for (int64_t t = t0; t < t1; ++t) {
    const int64_t m = a.row0(b) + t, p = a.bidir ? p_last : a.starts[b] + t;
    const int64_t lo = a.window > 0 ? std::max<int64_t>(0, p - a.window + 1) : 0;
    const int64_t n = p - lo + 1, np = (n + 15) / 16 * 16, j_off = lo - lo0;
    const int64_t qoff = m * H * D + g * G * D;  // element offset of the group's first query head
    if (static_cast<int64_t>(sbuf.size()) < G * np) sbuf.resize(G * np);
    for (int64_t e = 0; e < G * D; e += 8) {  // the group's q rows as fp32 [G, D]
      if constexpr (BF16) _mm256_storeu_ps(qf.data() + e, v8::load_bf16(reinterpret_cast<const uint16_t*>(a.q) + qoff + e));
      else _mm256_storeu_ps(qf.data() + e, _mm256_loadu_ps(reinterpret_cast<const float*>(a.q) + qoff + e));
    }
    for (int64_t j0 = 0; j0 < n; j0 += 8) {  // scores [G, np], keys in blocks of 8 (a last partial block repeats
      const int64_t nb = std::min<int64_t>(8, n - j0);  // its last key; scores past n are never read)
      const float* kb = K + (j_off + j0) * D;
      const float* kr[8];
      for (int i = 0; i < 8; ++i) kr[i] = kb + std::min<int64_t>(i, nb - 1) * D;
      for (int64_t hh = 0; hh < G; ++hh) scores8<DV>(qf.data() + hh * D, kr, sc, sbuf.data() + hh * np + j0);
    }
    alignas(64) float lsum[64];  // per query head: Σ of its softmax numerators
    for (int64_t hh = 0; hh < G; ++hh) lsum[hh] = softmax_num(sbuf.data() + hh * np, n);
    // P·V: query heads in groups of 4, 2, 1 sharing each value row, 8 accumulators a column tile
    const float* s = sbuf.data();
    const int64_t vo = j_off * D;
    for (int64_t h0 = 0; h0 < G;) {
      const int64_t left = G - h0;
      const float* ph = s + h0 * np;
      const int64_t off = qoff + h0 * D;
      if (left >= 4) {
        pv_heads<BF16, 4, 2>(ph, np, V + vo, D, n, lsum + h0, a.out, off);
        h0 += 4;
      } else if (left >= 2) {
        pv_heads<BF16, 2, (C8 >= 4 ? 4 : 2)>(ph, np, V + vo, D, n, lsum + h0, a.out, off);
        h0 += 2;
      } else {
        pv_heads<BF16, 1, (C8 >= 8 ? 8 : C8)>(ph, np, V + vo, D, n, lsum + h0, a.out, off);
        h0 += 1;
      }
    }
  }
}

template <bool BF16>
void attend_unit_d(const AttnArgs& a, int64_t DV, int64_t b, int64_t g, int64_t t0, int64_t t1, std::vector<float>& kf,
                   std::vector<float>& vf, std::vector<float>& sbuf, std::vector<float>& qf) {
  switch (DV) {
    case 1: return attend_unit<BF16, 1>(a, b, g, t0, t1, kf, vf, sbuf, qf);
    case 2: return attend_unit<BF16, 2>(a, b, g, t0, t1, kf, vf, sbuf, qf);
    case 4: return attend_unit<BF16, 4>(a, b, g, t0, t1, kf, vf, sbuf, qf);
    case 8: return attend_unit<BF16, 8>(a, b, g, t0, t1, kf, vf, sbuf, qf);
    default: return attend_unit<BF16, 16>(a, b, g, t0, t1, kf, vf, sbuf, qf);
  }
}

}  // namespace

// attend (attend.h): this engine's per-unit kernel, with per-thread scratch kept between calls.
at::Tensor attend(const at::Tensor& q, const at::Tensor& ck, const at::Tensor& cv, const at::Tensor& slots,
                  const at::Tensor& starts, const at::Tensor& lengths, int64_t H, int64_t window, double scale,
                  bool bidir, const c10::optional<at::Tensor>& offsets) {
  return attend_with(q, ck, cv, slots, starts, lengths, H, window, scale, bidir, offsets,
                     [](const AttnArgs& a, bool is_bf16, int64_t DV, int64_t b, int64_t g, int64_t t0, int64_t t1) {
                       thread_local std::vector<float> kf, vf, sbuf, qf;
                       if (is_bf16) attend_unit_d<true>(a, DV, b, g, t0, t1, kf, vf, sbuf, qf);
                       else attend_unit_d<false>(a, DV, b, g, t0, t1, kf, vf, sbuf, qf);
                     });
}

}  // namespace dspark
