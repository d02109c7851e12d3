// Row-invariant CPU kernels of the dspark_trt runtime (AVX-512), built at first use by runtime/native/__init__.py.
//
// Owns the arithmetic of the decode / verify / prefill hot path: products (bf16, fp32, int8-weight W8A16,
// int8 x int8 SmoothQuant) with fused RMSNorm, bias, residual and SwiGLU epilogues; RoPE + KV-cache write; and
// per-query attention over the slot cache. Invariant by construction: every output element is computed by one
// fixed chain of vector instructions that depends only on that element's own row (its input row, weight row,
// position and keys), never on how many rows share the call, on the row's place in it, or on the thread count.
// So a request's logits are bit-identical alone, batched, decoded or verified. Knows nothing about models.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#if !defined(__AVX512F__) || !defined(__AVX512BW__)
#error "dspark native kernels need AVX-512F/BW (the Python side only builds them where the CPU has it)"
#endif

namespace {

using bf16 = c10::BFloat16;

// ------------------------------------------------------------------------------------------------ scalar helpers
inline float b2f(uint16_t h) {
  uint32_t u = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
inline uint16_t f2b(float f) { return c10::BFloat16(f).x; }  // round to nearest even, as torch
inline float rb(float f) { return b2f(f2b(f)); }              // round through bf16

// ------------------------------------------------------------------------------------------------ vector helpers
inline __m512 load_bf16x16(const uint16_t* p) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)p)), 16));
}
inline __m512 maskz_load_bf16x16(__mmask16 m, const uint16_t* p) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m, p)), 16));
}
// fp32 -> bf16, round to nearest even, NaN -> 0x7FC0: bit-for-bit c10::BFloat16(float)
inline __m256i f2b_x16(__m512 v) {
  __m512i u = _mm512_castps_si512(v);
  __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  __m512i r = _mm512_srli_epi32(_mm512_add_epi32(u, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7FFF))), 16);
  __mmask16 nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
  r = _mm512_mask_mov_epi32(r, nan, _mm512_set1_epi32(0x7FC0));
  return _mm512_cvtepi32_epi16(r);
}
inline __m512 round_bf16_x16(__m512 v) {  // fp32 value rounded through bf16
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(f2b_x16(v)), 16));
}

// exp(x) for x <= 0 mostly (softmax) and SiLU; Cephes polynomial, ~1 ulp; fixed instruction sequence.
inline __m512 exp_x16(__m512 x) {
  x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-87.33654f)), _mm512_set1_ps(88.37626f));
  __m512 fx = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  x = _mm512_fnmadd_ps(fx, _mm512_set1_ps(0.693359375f), x);
  x = _mm512_fnmadd_ps(fx, _mm512_set1_ps(-2.12194440e-4f), x);
  __m512 y = _mm512_set1_ps(1.9875691500E-4f);
  y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(1.3981999507E-3f));
  y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(8.3334519073E-3f));
  y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(4.1665795894E-2f));
  y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(1.6666665459E-1f));
  y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(5.0000001201E-1f));
  __m512 x2 = _mm512_mul_ps(x, x);
  y = _mm512_fmadd_ps(y, x2, _mm512_add_ps(x, _mm512_set1_ps(1.0f)));
  return _mm512_scalef_ps(y, fx);
}
// ------------------------------------------------------------------------------------------------ products
// Weights are packed once (pack_weight) into blocks of 16 output rows with the 16 rows in the vector lanes, so a
// product never reduces across lanes: output n of row m is one chain acc += x[m, k..] · w[n, k..] over k in order
// (one FMA / dpbf16 step per k, or k-pair / k-quad), the same chain whatever M, tiling or thread split.
//   P_BF16    bf16 [NB, Kp/2, 16, 2]   bf16 activations, dpbf16 over k-pairs (fp32 FMA without AVX512_BF16)
//   P_F32     fp32 [NB, K, 16]         fp32 activations
//   P_I8P     int8 [NB, Kp/2, 16, 2]   W8A16, bf16 activations: widened exactly to bf16, then as P_BF16
//   P_I8F     int8 [NB, K, 16]         W8A16, fp32 activations
//   P_SQ      int8 [NB, Kp/4, 16, 4]   SmoothQuant: uint8 (= int8 + 128) activations, exact int32 (VNNI dpbusd)
// SwiGLU packs block 2i = up rows [16i, 16i+16), block 2i+1 = fc rows N/2 + [16i, 16i+16).
enum Pack { P_BF16 = 0, P_F32 = 1, P_I8P = 2, P_I8F = 3, P_SQ = 4 };
constexpr int LANES = 16;
constexpr int NBLK = 2;  // weight blocks per micro-tile
constexpr int MRMAX = 8;  // activation rows per micro-tile

inline int kgroup(int kind) { return kind == P_SQ ? 4 : (kind == P_BF16 || kind == P_I8P) ? 2 : 1; }

struct LinearPlan {
  int64_t M = 0, K = 0, N = 0;    // activation rows, in features, weight rows (before padding)
  int64_t Kp = 0, NB = 0;         // padded K, number of 16-row blocks
  int kind = P_BF16;
  bool swiglu = false;
  const void* x = nullptr;        // [M, ldx]: bf16 / fp32, or uint8 (SQ, Kp wide)
  int64_t ldx = 0;
  const void* w = nullptr;        // packed
  bool bf16 = true;               // model dtype (activations, bias, residual, output)
  const float* scale = nullptr;   // [N] per weight row (W8A16; SQ: activation scale · weight scale)
  const int32_t* rowsum = nullptr;  // [NB·16] SQ: Σ_k w[n, k]
  const void* bias = nullptr;     // [N]: model dtype (added after rounding) or fp32 (SQ: before rounding)
  bool bias_f32 = false;
  const void* res = nullptr;      // [M, Nout] residual, model dtype
  void* out = nullptr;            // [M, Nout]
  bool out_f32 = false;           // store float (rounded through the model dtype first)
};

// acc[b][m] (16 lanes = rows of weight block blk0 + b) = Σ_k x[m0 + m, k] · w[row, k], k in order.
template <int MRT>
inline void micro(const LinearPlan& p, int64_t m0, int64_t blk0, int nblk, __m512 acc[NBLK][MRMAX],
                  __m512i iacc[NBLK][MRMAX]) {
  for (int b = 0; b < NBLK; ++b)
    for (int m = 0; m < MRT; ++m) {
      acc[b][m] = _mm512_setzero_ps();
      iacc[b][m] = _mm512_setzero_si512();
    }
  const int64_t Kp = p.Kp;
  if (p.kind == P_BF16 || p.kind == P_I8P) {
    const uint16_t* xr[MRT];
    for (int m = 0; m < MRT; ++m) xr[m] = static_cast<const uint16_t*>(p.x) + (m0 + m) * p.ldx;
    const int64_t kq = Kp / 2;
    for (int64_t k2 = 0; k2 < kq; ++k2) {
#if defined(__AVX512BF16__)
      __m512i wv[NBLK];
      for (int b = 0; b < nblk; ++b) {
        if (p.kind == P_BF16) {
          wv[b] = _mm512_loadu_si512(static_cast<const uint16_t*>(p.w) + ((blk0 + b) * kq + k2) * 32);
        } else {
          __m256i w8 = _mm256_loadu_si256((const __m256i*)(static_cast<const int8_t*>(p.w) + ((blk0 + b) * kq + k2) * 32));
          __m512 lo = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_castsi256_si128(w8)));
          __m512 hi = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_extracti128_si256(w8, 1)));
          wv[b] = (__m512i)_mm512_cvtne2ps_pbh(hi, lo);
        }
      }
      for (int m = 0; m < MRT; ++m) {
        int32_t pair;
        std::memcpy(&pair, xr[m] + 2 * k2, 4);
        const __m512i xv = _mm512_set1_epi32(pair);
        for (int b = 0; b < nblk; ++b) acc[b][m] = _mm512_dpbf16_ps(acc[b][m], (__m512bh)xv, (__m512bh)wv[b]);
      }
#else
      // lanes 2i / 2i+1 of the packed pair hold k / k+1 of row i: FMA k then k+1 (same order as dpbf16)
      __m512 w0[NBLK], w1[NBLK];
      for (int b = 0; b < nblk; ++b) {
        __m512i raw;
        if (p.kind == P_BF16) {
          raw = _mm512_loadu_si512(static_cast<const uint16_t*>(p.w) + ((blk0 + b) * kq + k2) * 32);
        } else {
          __m256i w8 = _mm256_loadu_si256((const __m256i*)(static_cast<const int8_t*>(p.w) + ((blk0 + b) * kq + k2) * 32));
          __m512i wi = _mm512_cvtepi8_epi16(w8);
          raw = wi;  // int16 values; converted below
        }
        if (p.kind == P_BF16) {
          w0[b] = _mm512_castsi512_ps(_mm512_slli_epi32(raw, 16));
          w1[b] = _mm512_castsi512_ps(_mm512_and_si512(raw, _mm512_set1_epi32((int)0xFFFF0000u)));
        } else {
          w0[b] = _mm512_cvtepi32_ps(_mm512_srai_epi32(_mm512_slli_epi32(raw, 16), 16));
          w1[b] = _mm512_cvtepi32_ps(_mm512_srai_epi32(raw, 16));
        }
      }
      for (int m = 0; m < MRT; ++m) {
        const __m512 x0 = _mm512_set1_ps(b2f(xr[m][2 * k2])), x1 = _mm512_set1_ps(b2f(xr[m][2 * k2 + 1]));
        for (int b = 0; b < nblk; ++b) {
          acc[b][m] = _mm512_fmadd_ps(x1, w1[b], acc[b][m]);
          acc[b][m] = _mm512_fmadd_ps(x0, w0[b], acc[b][m]);
        }
      }
#endif
    }
  } else if (p.kind == P_F32 || p.kind == P_I8F) {
    const float* xr[MRT];
    for (int m = 0; m < MRT; ++m) xr[m] = static_cast<const float*>(p.x) + (m0 + m) * p.ldx;
    for (int64_t k = 0; k < Kp; ++k) {
      __m512 wv[NBLK];
      for (int b = 0; b < nblk; ++b) {
        if (p.kind == P_F32) {
          wv[b] = _mm512_loadu_ps(static_cast<const float*>(p.w) + ((blk0 + b) * Kp + k) * 16);
        } else {
          wv[b] = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(
              _mm_loadu_si128((const __m128i*)(static_cast<const int8_t*>(p.w) + ((blk0 + b) * Kp + k) * 16))));
        }
      }
      for (int m = 0; m < MRT; ++m) {
        const __m512 xv = _mm512_set1_ps(xr[m][k]);
        for (int b = 0; b < nblk; ++b) acc[b][m] = _mm512_fmadd_ps(xv, wv[b], acc[b][m]);
      }
    }
  } else {  // P_SQ (built only with AVX512_VNNI; pack_weight refuses it otherwise)
#if defined(__AVX512VNNI__)
    const uint8_t* xr[MRT];
    for (int m = 0; m < MRT; ++m) xr[m] = static_cast<const uint8_t*>(p.x) + (m0 + m) * p.ldx;
    const int64_t kq = Kp / 4;
    for (int64_t k4 = 0; k4 < kq; ++k4) {
      __m512i wv[NBLK];
      for (int b = 0; b < nblk; ++b) wv[b] = _mm512_loadu_si512(static_cast<const int8_t*>(p.w) + ((blk0 + b) * kq + k4) * 64);
      for (int m = 0; m < MRT; ++m) {
        int32_t quad;
        std::memcpy(&quad, xr[m] + 4 * k4, 4);
        const __m512i xv = _mm512_set1_epi32(quad);
        for (int b = 0; b < nblk; ++b) {
          iacc[b][m] = _mm512_dpbusd_epi32(iacc[b][m], xv, wv[b]);
        }
      }
    }
    for (int b = 0; b < nblk; ++b) {
      const __m512i corr = _mm512_mullo_epi32(_mm512_loadu_si512(p.rowsum + (blk0 + b) * 16), _mm512_set1_epi32(128));
      for (int m = 0; m < MRT; ++m) acc[b][m] = _mm512_cvtepi32_ps(_mm512_sub_epi32(iacc[b][m], corr));
    }
#endif
  }
}

// Weight rows of block `blk` (16 lanes) and the lane mask of rows < N (or < N/2 per half for SwiGLU).
inline void block_rows(const LinearPlan& p, int64_t blk, int64_t* row0, __mmask16* valid) {
  int64_t r0, lim;
  if (p.swiglu) {
    const int64_t half = p.N / 2;
    r0 = (blk / 2) * 16 + (blk % 2 ? half : 0);
    lim = (blk % 2 ? p.N : half);
  } else {
    r0 = blk * 16;
    lim = p.N;
  }
  const int64_t n = std::max<int64_t>(0, std::min<int64_t>(16, lim - r0));
  *row0 = r0;
  *valid = n >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << n) - 1);
}

// scale, (fp32 bias), round to the model dtype, (model-dtype bias): HF / torch op order
inline __m512 finish(const LinearPlan& p, int64_t row0, __mmask16 valid, __m512 v) {
  if (p.scale) v = _mm512_mul_ps(v, _mm512_maskz_loadu_ps(valid, p.scale + row0));
  if (p.bias && p.bias_f32) v = _mm512_add_ps(v, _mm512_maskz_loadu_ps(valid, static_cast<const float*>(p.bias) + row0));
  if (p.bf16) v = round_bf16_x16(v);
  if (p.bias && !p.bias_f32) {
    if (p.bf16) {
      v = round_bf16_x16(_mm512_add_ps(v, maskz_load_bf16x16(valid, static_cast<const uint16_t*>(p.bias) + row0)));
    } else {
      v = _mm512_add_ps(v, _mm512_maskz_loadu_ps(valid, static_cast<const float*>(p.bias) + row0));
    }
  }
  return v;
}

inline void store16(const LinearPlan& p, int64_t m, int64_t col0, int64_t ldo, __mmask16 valid, __m512 y) {
  if (p.res) {
    if (p.bf16) {
      y = round_bf16_x16(_mm512_add_ps(maskz_load_bf16x16(valid, static_cast<const uint16_t*>(p.res) + m * ldo + col0), y));
    } else {
      y = _mm512_add_ps(_mm512_maskz_loadu_ps(valid, static_cast<const float*>(p.res) + m * ldo + col0), y);
    }
  }
  if (p.out_f32 || !p.bf16) {
    _mm512_mask_storeu_ps(static_cast<float*>(p.out) + m * ldo + col0, valid, y);
  } else {
    _mm256_mask_storeu_epi16(static_cast<uint16_t*>(p.out) + m * ldo + col0, valid, f2b_x16(y));
  }
}

inline __m512 silu_x16(__m512 v) {  // v / (1 + exp(−v)), torch's formula
  return _mm512_div_ps(v, _mm512_add_ps(_mm512_set1_ps(1.0f), exp_x16(_mm512_sub_ps(_mm512_setzero_ps(), v))));
}

template <int MRT>
void tile(const LinearPlan& p, int64_t m0, int64_t blk0, int nblk) {
  __m512 acc[NBLK][MRMAX];
  __m512i iacc[NBLK][MRMAX];
  micro<MRT>(p, m0, blk0, nblk, acc, iacc);
  const int64_t ldo = p.swiglu ? p.N / 2 : p.N;
  if (p.swiglu) {  // blocks come in (up, fc) pairs: blk0 is even, nblk == 2
    int64_t r_up, r_fc;
    __mmask16 v_up, v_fc;
    block_rows(p, blk0, &r_up, &v_up);
    block_rows(p, blk0 + 1, &r_fc, &v_fc);
    for (int m = 0; m < MRT; ++m) {
      const __m512 up = finish(p, r_up, v_up, acc[0][m]);
      const __m512 fc = finish(p, r_fc, v_fc, acc[1][m]);
      __m512 s = silu_x16(fc);
      if (p.bf16) s = round_bf16_x16(s);
      __m512 y = _mm512_mul_ps(up, s);
      if (p.bf16) y = round_bf16_x16(y);
      store16(p, m0 + m, r_up, ldo, v_up, y);
    }
    return;
  }
  for (int b = 0; b < nblk; ++b) {
    int64_t r0;
    __mmask16 valid;
    block_rows(p, blk0 + b, &r0, &valid);
    for (int m = 0; m < MRT; ++m) store16(p, m0 + m, r0, ldo, valid, finish(p, r0, valid, acc[b][m]));
  }
}

void linear_blocks(const LinearPlan& p, int64_t blk_begin, int64_t blk_end) {
  for (int64_t m0 = 0; m0 < p.M; m0 += MRMAX) {
    const int64_t mr = std::min<int64_t>(MRMAX, p.M - m0);
    for (int64_t blk = blk_begin; blk < blk_end; blk += NBLK) {
      const int nblk = static_cast<int>(std::min<int64_t>(NBLK, blk_end - blk));
      switch (mr) {
        case 1: tile<1>(p, m0, blk, nblk); break;
        case 2: tile<2>(p, m0, blk, nblk); break;
        case 3: tile<3>(p, m0, blk, nblk); break;
        case 4: tile<4>(p, m0, blk, nblk); break;
        case 5: tile<5>(p, m0, blk, nblk); break;
        case 6: tile<6>(p, m0, blk, nblk); break;
        case 7: tile<7>(p, m0, blk, nblk); break;
        default: tile<8>(p, m0, blk, nblk); break;
      }
    }
  }
}

// RMSNorm rows of x [M, K] into h (HF numerics: fp32 statistics, x·r rounded to the model dtype, then · weight).
void rms_norm_rows(const void* x, int64_t ldx, const void* wt, float eps, int64_t M, int64_t K, bool is_bf16,
                   void* h) {
  for (int64_t m = 0; m < M; ++m) {
    __m512 ss = _mm512_setzero_ps();
    for (int64_t k = 0; k < K; k += 16) {
      __mmask16 mk = K - k >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << (K - k)) - 1);
      __m512 v = is_bf16 ? maskz_load_bf16x16(mk, static_cast<const uint16_t*>(x) + m * ldx + k)
                         : _mm512_maskz_loadu_ps(mk, static_cast<const float*>(x) + m * ldx + k);
      ss = _mm512_fmadd_ps(v, v, ss);
    }
    const float var = _mm512_reduce_add_ps(ss) / static_cast<float>(K);
    const float r = 1.0f / std::sqrt(var + eps);
    const __m512 rv = _mm512_set1_ps(r);
    for (int64_t k = 0; k < K; k += 16) {
      __mmask16 mk = K - k >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << (K - k)) - 1);
      if (is_bf16) {
        __m512 v = maskz_load_bf16x16(mk, static_cast<const uint16_t*>(x) + m * ldx + k);
        __m512 wv = maskz_load_bf16x16(mk, static_cast<const uint16_t*>(wt) + k);
        __m512 y = round_bf16_x16(_mm512_mul_ps(wv, round_bf16_x16(_mm512_mul_ps(v, rv))));
        _mm256_mask_storeu_epi16(static_cast<uint16_t*>(h) + m * K + k, mk, f2b_x16(y));
      } else {
        __m512 v = _mm512_maskz_loadu_ps(mk, static_cast<const float*>(x) + m * ldx + k);
        __m512 wv = _mm512_maskz_loadu_ps(mk, static_cast<const float*>(wt) + k);
        _mm512_mask_storeu_ps(static_cast<float*>(h) + m * K + k, mk, _mm512_mul_ps(wv, _mm512_mul_ps(v, rv)));
      }
    }
  }
}

// SmoothQuant input: q = clamp(round(x·pre / a), -128, 127), stored +128 as uint8 (torch's op order).
void sq_quantize(const void* x, int64_t ldx, bool is_bf16, const float* pre, float a, int64_t M, int64_t K,
                 int64_t ldq, uint8_t* q) {
  const __m512 av = _mm512_set1_ps(a);
  for (int64_t m = 0; m < M; ++m) {
    for (int64_t k = 0; k < K; k += 16) {
      __mmask16 mk = K - k >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << (K - k)) - 1);
      __m512 v = is_bf16 ? maskz_load_bf16x16(mk, static_cast<const uint16_t*>(x) + m * ldx + k)
                         : _mm512_maskz_loadu_ps(mk, static_cast<const float*>(x) + m * ldx + k);
      v = _mm512_div_ps(_mm512_mul_ps(v, _mm512_maskz_loadu_ps(mk, pre + k)), av);
      v = _mm512_roundscale_ps(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
      v = _mm512_min_ps(_mm512_max_ps(v, _mm512_set1_ps(-128.0f)), _mm512_set1_ps(127.0f));
      __m512i i = _mm512_add_epi32(_mm512_cvtps_epi32(v), _mm512_set1_epi32(128));
      _mm_mask_storeu_epi8(q + m * ldq + k, mk, _mm512_cvtepi32_epi8(i));
    }
  }
}

}  // namespace

// Pack w [N, K] (bf16 | fp32 | int8) for `kind` (see Pack); SwiGLU interleaves up / fc blocks. Returns the packed
// tensor (int8 / bf16 / fp32) and, for P_SQ, the row sums [NB·16] int32 (else an empty tensor).
std::vector<at::Tensor> pack_weight(const at::Tensor& w, int64_t kind, bool swiglu) {
  TORCH_CHECK(w.dim() == 2 && w.is_contiguous(), "pack_weight: contiguous [N, K]");
#if !defined(__AVX512VNNI__)
  TORCH_CHECK(kind != P_SQ, "pack_weight: SmoothQuant needs AVX512_VNNI");
#endif
  const int64_t N = w.size(0), K = w.size(1), g = kgroup(static_cast<int>(kind));
  const int64_t Kp = (K + g - 1) / g * g;
  const int64_t half = N / 2;
  TORCH_CHECK(!swiglu || N % 2 == 0, "pack_weight: SwiGLU needs an even row count");
  const int64_t NB = swiglu ? 2 * ((half + 15) / 16) : (N + 15) / 16;
  at::Tensor out = at::zeros({NB, Kp / g, 16, g}, w.options());
  at::Tensor rowsum = kind == P_SQ ? at::zeros({NB * 16}, w.options().dtype(at::kInt)) : at::empty({0}, w.options().dtype(at::kInt));
  const int64_t es = w.element_size();
  const char* src = static_cast<const char*>(w.data_ptr());
  char* dst = static_cast<char*>(out.data_ptr());
  for (int64_t blk = 0; blk < NB; ++blk) {
    const int64_t r0 = swiglu ? (blk / 2) * 16 + (blk % 2 ? half : 0) : blk * 16;
    const int64_t lim = swiglu ? (blk % 2 ? N : half) : N;
    for (int64_t i = 0; i < 16 && r0 + i < lim; ++i) {
      const int64_t row = r0 + i;
      for (int64_t k = 0; k < K; ++k) {
        const int64_t o = (((blk * (Kp / g) + k / g) * 16 + i) * g + k % g) * es;
        std::memcpy(dst + o, src + (row * K + k) * es, es);
      }
      if (kind == P_SQ) {
        int32_t sum = 0;
        for (int64_t k = 0; k < K; ++k) sum += static_cast<const int8_t*>(w.data_ptr())[row * K + k];
        rowsum.data_ptr<int32_t>()[blk * 16 + i] = sum;
      }
    }
  }
  return {out, rowsum};
}

// x [M, K] (bf16 | fp32) · packed weight (pack_weight of a [N, K] weight) → [M, Nout] (Nout = N, or N/2 with
// SwiGLU). Optional: scale [N] fp32; bias [N] (model dtype, or fp32 with bias_f32: added before rounding); residual
// [M, Nout]; norm_weight [K] (RMSNorm of x first); sq_pre [K] fp32 + sq_act (SmoothQuant input quantization).
at::Tensor linear(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& rowsum, int64_t kind, int64_t N,
                  bool swiglu, const c10::optional<at::Tensor>& scale, const c10::optional<at::Tensor>& bias,
                  bool bias_f32, const c10::optional<at::Tensor>& residual, const c10::optional<at::Tensor>& norm_weight,
                  double eps, const c10::optional<at::Tensor>& sq_pre, double sq_act, bool out_f32) {
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1, "linear: x [M, K] with contiguous rows");
  const bool is_bf16 = x.scalar_type() == at::kBFloat16;
  TORCH_CHECK(is_bf16 || x.scalar_type() == at::kFloat, "linear: bf16 or fp32 activations");
  const bool pair = kind == P_BF16 || kind == P_I8P;
  TORCH_CHECK(pair == is_bf16 || kind == P_SQ, "linear: packing does not match the activation dtype");
  LinearPlan p;
  p.M = x.size(0);
  p.K = x.size(1);
  p.N = N;
  p.kind = static_cast<int>(kind);
  p.swiglu = swiglu;
  p.bf16 = is_bf16;
  p.out_f32 = out_f32;
  p.NB = packed.size(0);
  p.Kp = packed.size(1) * packed.size(3);
  TORCH_CHECK(p.Kp >= p.K && p.Kp - p.K < kgroup(p.kind), "linear: packed K does not match x");
  TORCH_CHECK(!pair || p.K % 2 == 0 || kind == P_SQ, "linear: bf16 packing needs an even K");
  const int64_t nout = swiglu ? N / 2 : N;
  at::Tensor xin = x;
  if (norm_weight.has_value()) {
    const at::Tensor& nw = *norm_weight;
    TORCH_CHECK(nw.scalar_type() == x.scalar_type() && nw.numel() == p.K && nw.is_contiguous(), "linear: norm weight");
    at::Tensor h = at::empty({p.M, p.K}, x.options());
    rms_norm_rows(x.data_ptr(), x.stride(0), nw.data_ptr(), static_cast<float>(eps), p.M, p.K, is_bf16, h.data_ptr());
    xin = h;
  }
  at::Tensor xq;
  if (kind == P_SQ) {
    TORCH_CHECK(sq_pre.has_value() && sq_pre->scalar_type() == at::kFloat && sq_pre->numel() == p.K, "linear: sq_pre");
    xq = at::full({p.M, p.Kp}, 128, x.options().dtype(at::kByte));
    sq_quantize(xin.data_ptr(), xin.stride(0), is_bf16, sq_pre->data_ptr<float>(), static_cast<float>(sq_act), p.M,
                p.K, p.Kp, xq.data_ptr<uint8_t>());
    p.x = xq.data_ptr();
    p.ldx = p.Kp;
    p.rowsum = rowsum.data_ptr<int32_t>();
  } else {
    p.x = xin.data_ptr();
    p.ldx = xin.stride(0);
  }
  p.w = packed.data_ptr();
  if (scale.has_value()) {
    TORCH_CHECK(scale->scalar_type() == at::kFloat && scale->numel() == N && scale->is_contiguous(), "linear: scale");
    p.scale = scale->data_ptr<float>();
  }
  if (bias.has_value()) {
    TORCH_CHECK(bias->numel() == N && bias->is_contiguous(), "linear: bias [N]");
    TORCH_CHECK(bias->scalar_type() == (bias_f32 ? at::kFloat : x.scalar_type()), "linear: bias dtype");
    p.bias = bias->data_ptr();
    p.bias_f32 = bias_f32;
  }
  if (residual.has_value()) {
    TORCH_CHECK(residual->scalar_type() == x.scalar_type() && residual->is_contiguous() && residual->dim() == 2 &&
                residual->size(0) == p.M && residual->size(1) == nout, "linear: residual [M, Nout]");
    p.res = residual->data_ptr();
  }
  at::Tensor out = at::empty({p.M, nout}, x.options().dtype(out_f32 ? at::kFloat : x.scalar_type()));
  p.out = out.data_ptr();
  // parallel over groups of weight blocks; SwiGLU groups keep (up, fc) pairs together
  const int64_t per_task = p.M >= 16 ? 2 : 4;
  const int64_t ntasks = (p.NB + per_task - 1) / per_task;
  const int64_t work = p.M * p.NB * 16 * p.Kp;
  const int64_t grain = work < (1 << 17) ? ntasks : 1;  // tiny products run inline (no fork)
  at::parallel_for(0, ntasks, grain, [&](int64_t t0, int64_t t1) {
    linear_blocks(p, t0 * per_task, std::min(p.NB, t1 * per_task));
  });
  return out;
}

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

// q [M = B·T, H·D]; ck/cv [S, Hkv, max_seq, D] holding this step's keys → out [M, H·D]. Query (b, t) at position
// p = starts[b] + t attends keys lo..p of slot slots[b] (lo = p − window + 1 with a sliding window, else 0); rows
// t ≥ lengths[b] get zeros. Scores fp32, softmax with this file's exp, P·V accumulated in fp32 over keys in order.
at::Tensor attend(const at::Tensor& q, const at::Tensor& ck, const at::Tensor& cv, const at::Tensor& slots,
                  const at::Tensor& starts, const at::Tensor& lengths, int64_t H, int64_t window, double scale) {
  TORCH_CHECK(q.is_contiguous() && ck.is_contiguous() && cv.is_contiguous(), "attend: contiguous tensors");
  const bool is_bf16 = q.scalar_type() == at::kBFloat16;
  const int64_t Hkv = ck.size(1), MS = ck.size(2), D = ck.size(3), B = slots.size(0);
  const int64_t M = q.size(0), T = M / B, G = H / Hkv;
  TORCH_CHECK(q.size(1) == H * D && D % 16 == 0 && D <= 256, "attend: head_dim must be a multiple of 16, ≤ 256");
  at::Tensor out = at::zeros({M, H * D}, q.options());
  const int64_t* sl = slots.data_ptr<int64_t>();
  const int64_t* st = starts.data_ptr<int64_t>();
  const int64_t* ln = lengths.data_ptr<int64_t>();
  const float sc = static_cast<float>(scale);
  const int64_t DV = D / 16;
  int64_t total = 0;
  for (int64_t b = 0; b < B; ++b) total += ln[b] * (st[b] + ln[b]);
  const int64_t units = M * Hkv;
  const int64_t grain = total * H * D < (1 << 16) ? units : 1;
  at::parallel_for(0, units, grain, [&](int64_t u0, int64_t u1) {
    std::vector<float> sbuf;
    for (int64_t u = u0; u < u1; ++u) {
      const int64_t m = u / Hkv, g = u % Hkv, b = m / T, t = m % T;
      if (t >= ln[b]) continue;
      const int64_t p = st[b] + t;
      const int64_t lo = window > 0 ? std::max<int64_t>(0, p - window + 1) : 0;
      const int64_t n = p - lo + 1;
      const int64_t np = (n + 15) / 16 * 16;
      sbuf.assign(G * np, 0.0f);
      const size_t kv_off = ((sl[b] * Hkv + g) * MS + lo) * D;
      // scores s[h][j] = (q_h · k_j) · scale
      for (int64_t j = 0; j < n; ++j) {
        for (int64_t hh = 0; hh < G; ++hh) {
          const int64_t h = g * G + hh;
          __m512 acc = _mm512_setzero_ps();
          if (is_bf16) {
            const uint16_t* qp = static_cast<const uint16_t*>(q.data_ptr()) + m * H * D + h * D;
            const uint16_t* kp = static_cast<const uint16_t*>(ck.data_ptr()) + kv_off + j * D;
#if defined(__AVX512BF16__)
            for (int64_t d = 0; d < D; d += 32) {
              const int64_t nn = std::min<int64_t>(32, D - d);
              __mmask32 mk = nn == 32 ? (__mmask32)0xFFFFFFFFu : (__mmask32)((1ull << nn) - 1);
              acc = _mm512_dpbf16_ps(acc, (__m512bh)_mm512_maskz_loadu_epi16(mk, qp + d),
                                     (__m512bh)_mm512_maskz_loadu_epi16(mk, kp + d));
            }
#else
            for (int64_t d = 0; d < D; d += 16) acc = _mm512_fmadd_ps(load_bf16x16(qp + d), load_bf16x16(kp + d), acc);
#endif
          } else {
            const float* qp = static_cast<const float*>(q.data_ptr()) + m * H * D + h * D;
            const float* kp = static_cast<const float*>(ck.data_ptr()) + kv_off + j * D;
            for (int64_t d = 0; d < D; d += 16) acc = _mm512_fmadd_ps(_mm512_loadu_ps(qp + d), _mm512_loadu_ps(kp + d), acc);
          }
          sbuf[hh * np + j] = _mm512_reduce_add_ps(acc) * sc;
        }
      }
      for (int64_t hh = 0; hh < G; ++hh) {
        const int64_t h = g * G + hh;
        float* s = sbuf.data() + hh * np;
        float mx = -INFINITY;
        for (int64_t j = 0; j < n; ++j) mx = std::max(mx, s[j]);
        const __m512 mv = _mm512_set1_ps(mx);
        __m512 lsum = _mm512_setzero_ps();
        for (int64_t j = 0; j < n; j += 16) {
          __mmask16 mk = n - j >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << (n - j)) - 1);
          __m512 e = _mm512_maskz_mov_ps(mk, exp_x16(_mm512_sub_ps(_mm512_loadu_ps(s + j), mv)));
          _mm512_storeu_ps(s + j, e);
          lsum = _mm512_add_ps(lsum, e);
        }
        const float l = _mm512_reduce_add_ps(lsum);
        __m512 o[16];
        for (int64_t c = 0; c < DV; ++c) o[c] = _mm512_setzero_ps();
        for (int64_t j = 0; j < n; ++j) {
          const __m512 pj = _mm512_set1_ps(s[j]);
          if (is_bf16) {
            const uint16_t* vp = static_cast<const uint16_t*>(cv.data_ptr()) + kv_off + j * D;
            for (int64_t c = 0; c < DV; ++c) o[c] = _mm512_fmadd_ps(pj, load_bf16x16(vp + 16 * c), o[c]);
          } else {
            const float* vp = static_cast<const float*>(cv.data_ptr()) + kv_off + j * D;
            for (int64_t c = 0; c < DV; ++c) o[c] = _mm512_fmadd_ps(pj, _mm512_loadu_ps(vp + 16 * c), o[c]);
          }
        }
        const __m512 lv = _mm512_set1_ps(l);
        for (int64_t c = 0; c < DV; ++c) {
          __m512 y = _mm512_div_ps(o[c], lv);
          if (is_bf16) {
            _mm256_storeu_si256((__m256i*)(static_cast<uint16_t*>(out.data_ptr()) + m * H * D + h * D + 16 * c),
                                f2b_x16(y));
          } else {
            _mm512_storeu_ps(static_cast<float*>(out.data_ptr()) + m * H * D + h * D + 16 * c, y);
          }
        }
      }
    }
  });
  return out;
}

std::string build_info() {
  std::string s = "avx512";
#if defined(__AVX512BF16__)
  s += "+bf16";
#endif
#if defined(__AVX512VNNI__)
  s += "+vnni";
#endif
  return s;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("pack_weight", &pack_weight, "pack a [N, K] weight into 16-row lane blocks");
  m.def("linear", &linear, "row-invariant product with fused norm / bias / residual / SwiGLU");
  m.def("rope_kv", &rope_kv, "RoPE on q, k; k and v written to the cache");
  m.def("attend", &attend, "per-query attention over the slot cache");
  m.def("build_info", &build_info);
}
