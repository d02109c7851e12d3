// RoPE + KV-cache write and per-query attention of the dspark_trt native kernels.
//
// A query's attention output depends only on its own position, its q vector and the cached keys/values it may see:
// scores in fp32 over keys lo..p in order, softmax with simd512.h's exp, P·V accumulated in fp32 key by key. No span
// padding, no batching across queries, so decode, verify and batched rows all give the same bits.
#include "simd512.h"
#include "rope.h"
#include "attend.h"

namespace dspark {

// RoPE + KV write (rope.h): this engine's vector rotation of one head.
at::Tensor rope_kv(const at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin, const at::Tensor& pos,
                   at::Tensor& ck, at::Tensor& cv, const at::Tensor& slots, int64_t H, int64_t Hkv) {
  const int64_t D = ck.size(3), half = D / 2;
  return rope_kv_with(qkv, cos, sin, pos, ck, cv, slots, H, Hkv, [&](auto* src, auto* c, auto* s, auto* dst) {
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
          _mm256_storeu_si256(reinterpret_cast<__m256i*>(reinterpret_cast<uint16_t*>(dst) + d), bf16_bits_x16(y));
        } else {
          _mm512_storeu_ps(dst + d, _mm512_add_ps(_mm512_mul_ps(x, cv_), _mm512_mul_ps(r, sv)));
        }
      }
      return true;
    }
    return false;
  });
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

template <bool BF16>
inline __m512 ld16(const char* base, int64_t idx) {  // 16 elements of a bf16 / fp32 row, as fp32
  if constexpr (BF16) return load_bf16x16(reinterpret_cast<const uint16_t*>(base) + idx);
  else return _mm512_loadu_ps(reinterpret_cast<const float*>(base) + idx);
}

// One (request b, kv head g, queries t0..t1-1) unit: each real query t of the range, its G query heads over keys
// lo..p. The keys and values the range can see are widened to fp32 once (scratch kf / vf) and shared by its queries
// and heads.
template <bool BF16, int DV>
void attend_unit(const AttnArgs& a, int64_t b, int64_t g, int64_t t0, int64_t t1, std::vector<float>& kf,
                 std::vector<float>& vf, std::vector<float>& sbuf) {
  constexpr int64_t D = 16 * DV;
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
    for (int64_t e = 0; e < nk * D; e += 16) {  // keys lo0..p_last are contiguous rows of D
      _mm512_storeu_ps(kd + e, load_bf16x16(ks + e));
      _mm512_storeu_ps(vd + e, load_bf16x16(vs + e));
    }
    K = kd;
    V = vd;
  } else {
    K = reinterpret_cast<const float*>(a.k) + kv_off;
    V = reinterpret_cast<const float*>(a.v) + kv_off;
  }
  const __m512 sc = _mm512_set1_ps(a.scale);
  for (int64_t t = t0; t < t1; ++t) {
    const int64_t m = a.row0(b) + t, p = a.bidir ? p_last : a.starts[b] + t;
    const int64_t lo = a.window > 0 ? std::max<int64_t>(0, p - a.window + 1) : 0;
    const int64_t n = p - lo + 1, np = (n + 15) / 16 * 16, j_off = lo - lo0;
    if (static_cast<int64_t>(sbuf.size()) < G * np) sbuf.resize(G * np);
    alignas(64) float lsum[64];  // per query head: Σ of its softmax numerators
    for (int64_t hh = 0; hh < G; ++hh) {
      __m512 qv[DV];
      for (int c = 0; c < DV; ++c) qv[c] = ld16<BF16>(a.q, m * H * D + (g * G + hh) * D + 16 * c);
      float* s = sbuf.data() + hh * np;  // scores, then softmax numerators in place
      for (int64_t j0 = 0; j0 < n; j0 += 16) {  // scores, keys in blocks of 16 (a last partial block: zeros after)
        const int64_t nb = std::min<int64_t>(16, n - j0);
        __m512 acc[16];
        const float* kr = K + (j_off + j0) * D;
        if (nb == 16) {  // a full block: unrolled, in registers
          for (int i = 0; i < 16; ++i) {
            acc[i] = _mm512_fmadd_ps(qv[0], _mm512_loadu_ps(kr + i * D), _mm512_setzero_ps());
            for (int c = 1; c < DV; ++c) acc[i] = _mm512_fmadd_ps(qv[c], _mm512_loadu_ps(kr + i * D + 16 * c), acc[i]);
          }
        } else {
          for (int i = 0; i < 16; ++i) {
            acc[i] = _mm512_setzero_ps();
            if (i < nb) {
              for (int c = 0; c < DV; ++c) acc[i] = _mm512_fmadd_ps(qv[c], _mm512_loadu_ps(kr + i * D + 16 * c), acc[i]);
            }
          }
        }
        _mm512_storeu_ps(s + j0, _mm512_mul_ps(hsum16(acc), sc));
      }
      // the maximum: lane-wise std::max (a NaN score is skipped, as there), then across the lanes
      __m512 m16 = _mm512_set1_ps(-INFINITY);
      for (int64_t j = 0; j < n; j += 16) {
        const __m512 x = _mm512_maskz_loadu_ps(tail16(n - j), s + j);
        m16 = _mm512_mask_mov_ps(m16, _mm512_mask_cmp_ps_mask(tail16(n - j), x, m16, _CMP_GT_OQ), x);
      }
      alignas(64) float lanes[16];
      _mm512_store_ps(lanes, m16);
      float mx = -INFINITY;
      for (int i = 0; i < 16; ++i) mx = std::max(mx, lanes[i]);
      const __m512 mv = _mm512_set1_ps(mx);
      __m512 lacc = _mm512_setzero_ps();
      for (int64_t j = 0; j < n; j += 16) {
        const __m512 e = _mm512_maskz_mov_ps(tail16(n - j), exp_x16(_mm512_sub_ps(_mm512_loadu_ps(s + j), mv)));
        _mm512_storeu_ps(s + j, e);
        lacc = _mm512_add_ps(lacc, e);
      }
      lsum[hh] = reduce_add_x16(lacc);
    }
    // P·V key by key, HB query heads at a time sharing each value row (each head's sum in its own order)
    constexpr int HB = DV >= 16 ? 1 : (16 / DV > 4 ? 4 : 16 / DV);
    for (int64_t h0 = 0; h0 < G; h0 += HB) {
      const int nh = static_cast<int>(std::min<int64_t>(HB, G - h0));
      __m512 o[HB][DV];
      for (int h = 0; h < HB; ++h)
        for (int c = 0; c < DV; ++c) o[h][c] = _mm512_setzero_ps();
      const float* s0 = sbuf.data() + h0 * np;
      for (int64_t j = 0; j < n; ++j) {
        const float* vr = V + (j_off + j) * D;
        __m512 vv[DV];
        for (int c = 0; c < DV; ++c) vv[c] = _mm512_loadu_ps(vr + 16 * c);
        for (int h = 0; h < HB; ++h) {
          if (h >= nh) break;
          const __m512 pj = _mm512_set1_ps(s0[h * np + j]);
          for (int c = 0; c < DV; ++c) o[h][c] = _mm512_fmadd_ps(pj, vv[c], o[h][c]);
        }
      }
      for (int h = 0; h < nh; ++h) {
        const __m512 lv = _mm512_set1_ps(lsum[h0 + h]);
        const int64_t off = m * H * D + (g * G + h0 + h) * D;
        for (int c = 0; c < DV; ++c) {
          const __m512 y = _mm512_div_ps(o[h][c], lv);
          if constexpr (BF16) {
            _mm256_storeu_si256(reinterpret_cast<__m256i*>(reinterpret_cast<uint16_t*>(a.out) + off + 16 * c), f2b_x16(y));
          } else {
            _mm512_storeu_ps(reinterpret_cast<float*>(a.out) + off + 16 * c, y);
          }
        }
      }
    }
  }
}

template <bool BF16>
void attend_unit_d(const AttnArgs& a, int64_t DV, int64_t b, int64_t g, int64_t t0, int64_t t1, std::vector<float>& kf,
                   std::vector<float>& vf, std::vector<float>& sbuf) {
  switch (DV) {
    case 1: return attend_unit<BF16, 1>(a, b, g, t0, t1, kf, vf, sbuf);
    case 2: return attend_unit<BF16, 2>(a, b, g, t0, t1, kf, vf, sbuf);
    case 4: return attend_unit<BF16, 4>(a, b, g, t0, t1, kf, vf, sbuf);
    case 8: return attend_unit<BF16, 8>(a, b, g, t0, t1, kf, vf, sbuf);
    default: return attend_unit<BF16, 16>(a, b, g, t0, t1, kf, vf, sbuf);
  }
}

}  // namespace

// attend (attend.h): this engine's per-unit kernel, with per-thread scratch kept between calls.
at::Tensor attend(const at::Tensor& q, const at::Tensor& ck, const at::Tensor& cv, const at::Tensor& slots,
                  const at::Tensor& starts, const at::Tensor& lengths, int64_t H, int64_t window, double scale,
                  bool bidir, const c10::optional<at::Tensor>& offsets) {
  return attend_with(q, ck, cv, slots, starts, lengths, H, window, scale, bidir, offsets,
                     [](const AttnArgs& a, bool is_bf16, int64_t DV, int64_t b, int64_t g, int64_t t0, int64_t t1) {
                       thread_local std::vector<float> kf, vf, sbuf;
                       if (is_bf16) attend_unit_d<true>(a, DV, b, g, t0, t1, kf, vf, sbuf);
                       else attend_unit_d<false>(a, DV, b, g, t0, t1, kf, vf, sbuf);
                     });
}

}  // namespace dspark
