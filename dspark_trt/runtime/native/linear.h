// Shared parts of the AVX-512 build's products (linear.cpp: staging and linear(); linear_amx.cpp: the AMX engine;
// linear_fma.cpp: the AVX-512 FMA engine; pack.cpp: the packing): the epilogue both engines end in and their entry
// points. Packing kinds and the plan of one call: plan.h.
//
// The products: y = epilogue(x · wᵀ) for bf16, fp32, W8A16 (int8 weight,
// per-row scale) and SmoothQuant (int8 x int8) weights, with fused RMSNorm (prologue), scale, bias, SwiGLU, residual.
//
// Weights are packed once (pack_weight) into blocks of 16 output rows:
//   P_BF16 bf16 [NB, Kp/2, 16, 2]  k-pairs (VNNI / AMX-B layout), Kp = K rounded up to 32
//   P_F32  fp32 [NB, K, 16]
//   P_I8P  int8 [NB, Kp/2, 16, 2]  W8A16 with bf16 activations, widened exactly to bf16
//   P_I8F  int8 [NB, K, 16]        W8A16 with fp32 activations
//   P_SQ   int8 [NB, Kp/4, 16, 4]  k-quads, Kp = K rounded up to 64
//   P_I8Q  int8 [NB, Kp/4, 16, 4]  W8A16 with bf16 activations as exact integer products (see stage_input)
// SwiGLU packs block 2i = up rows [16i, 16i+16) and block 2i+1 = fc rows N/2 + [16i, 16i+16).
//
// W8A16 on P_I8Q reads each int8 weight as it is, with no widening: each bf16 activation row x is written as 16-bit
// fixed point, x ≈ s · v with s = 2^(e - 14) (2^e > max|x|) and v an integer, |v| < 2^14 (exact for elements within
// 2^7 of the row's maximum, the rest rounded to the grid: an error under 1/64 of the bf16 rounding of the row's
// largest elements), and v as two signed base-256 digits (limbs: low in [-128, 127], high in [-64, 64]). The limb
// products with the int8 weights are exact int32 sums (TDPBSSD, or VNNI dpbusd on the FMA engine, which gives the
// same bits); y = fp32(s · (H·256 + L)) is that exact sum rounded once. Two limb rows per activation row: verify of
// up to 8 tokens (K ≤ 7) is one 16-row AMX tile, like one token; one or two rows more (K = 8, 9) are multiplied on
// VNNI in the same pass, from the weight chunks the tile just loaded, instead of a second pass over the weights.
//
// Two engines, one per process (AMX when the CPU and kernel allow it): AMX tiles (bf16: TDPBF16PS, SQ: TDPBSSD) on
// 16-row activation tiles, or AVX-512 FMA with the 16 output rows in the vector lanes. In both, output (m, n) is one
// accumulation over k in a fixed order that involves only activation row m and weight row n — never other rows,
// the row count, the row's place in a tile or the thread split — so every row's bits are independent of its batch.
#pragma once

#include "plan.h"
#include "simd512.h"

namespace dspark {
namespace lin {

// bf16 products on the FMA engine with AVX512_BF16 (Zen 4 / Zen 5, Sapphire Rapids forced off AMX): VDPBF16PS does a
// k-pair of 16 output rows in one instruction. It adds its two products to the accumulator odd element first, each
// rounded to fp32 like an FMA (bf16 x bf16 is exact in fp32) — measured bit for bit against two fmaf on Zen 4 — so
// with the halves of both operands' pairs swapped it is the FMA chain (k, then k + 1) of the other engines, at half
// the instructions and with no widening of the weights. The one difference is the instruction's DAZ / FTZ:
// subnormal inputs or partial sums (|·| < 2^-126) are flushed. Staged activations are then bf16 pairs (k + 1, k).
// The order and the per-step rounding are checked on the CPU that runs, once, before the first product
// (dp_bf16_exact: 65,536 random lanes against two fmaf); a CPU whose instruction rounds otherwise keeps the FMA kernel.
#if defined(__AVX512BF16__)
constexpr bool kDpBf16 = true;
#else
constexpr bool kDpBf16 = false;
#endif
bool dp_bf16_exact();  // linear_fma.cpp
inline bool dp_bf16(const LinearPlan& p) { return kDpBf16 && p.kind == P_BF16 && !p.amx && dp_bf16_exact(); }

// ---------------------------------------------------------------------------------------------------- epilogue
inline void block_rows(const LinearPlan& p, int64_t blk, int64_t* row0, __mmask16* valid) {
  const int64_t half = p.N / 2;
  const int64_t r0 = p.swiglu ? (blk / 2) * 16 + (blk % 2 ? half : 0) : blk * 16;
  const int64_t lim = p.swiglu ? (blk % 2 ? p.N : half) : p.N;
  *row0 = r0;
  *valid = tail16(std::max<int64_t>(0, lim - r0));
}

// · scale, (+ fp32 bias), round to the model dtype, (+ model-dtype bias, rounded): torch / HF op order
inline __m512 finish(const LinearPlan& p, int64_t row0, __mmask16 valid, __m512 v) {
  if (p.scale) v = _mm512_mul_ps(v, _mm512_maskz_loadu_ps(valid, p.scale + row0));
  if (p.bias && p.bias_f32) v = _mm512_add_ps(v, _mm512_maskz_loadu_ps(valid, static_cast<const float*>(p.bias) + row0));
  if (p.bf16) v = round_bf16_x16(v);
  if (p.bias && !p.bias_f32) {
    v = p.bf16 ? round_bf16_x16(_mm512_add_ps(v, maskz_load_bf16x16(valid, static_cast<const uint16_t*>(p.bias) + row0)))
               : _mm512_add_ps(v, _mm512_maskz_loadu_ps(valid, static_cast<const float*>(p.bias) + row0));
  }
  return v;
}

inline void store16(const LinearPlan& p, int64_t m, int64_t col0, __mmask16 valid, __m512 y) {
  const int64_t ldo = p.swiglu ? p.N / 2 : p.N;
  if (p.res) {
    y = p.bf16 ? round_bf16_x16(_mm512_add_ps(maskz_load_bf16x16(valid, static_cast<const uint16_t*>(p.res) + m * ldo + col0), y))
               : _mm512_add_ps(_mm512_maskz_loadu_ps(valid, static_cast<const float*>(p.res) + m * ldo + col0), y);
  }
  if (p.out_f32 || !p.bf16) {
    _mm512_mask_storeu_ps(static_cast<float*>(p.out) + m * ldo + col0, valid, y);
  } else {
    _mm256_mask_storeu_epi16(static_cast<uint16_t*>(p.out) + m * ldo + col0, valid, bf16_bits_x16(y));  // y is rounded
  }
}

// Raw sums of blocks blk (and blk + 1 for SwiGLU) for activation row m → outputs.
inline void emit(const LinearPlan& p, int64_t m, int64_t blk, __m512 v) {
  int64_t r0;
  __mmask16 valid;
  block_rows(p, blk, &r0, &valid);
  store16(p, m, r0, valid, finish(p, r0, valid, v));
}
inline void emit_swiglu(const LinearPlan& p, int64_t m, int64_t blk_up, __m512 vu, __m512 vf) {
  int64_t ru, rf;
  __mmask16 mu, mf;
  block_rows(p, blk_up, &ru, &mu);
  block_rows(p, blk_up + 1, &rf, &mf);
  const __m512 up = finish(p, ru, mu, vu), fc = finish(p, rf, mf, vf);
  __m512 s = silu_x16(fc);
  if (p.bf16) s = round_bf16_x16(s);
  __m512 y = _mm512_mul_ps(up, s);
  if (p.bf16) y = round_bf16_x16(y);
  store16(p, m, ru, mu, y);
}

// Raw sums v[0..nq) of weight blocks blk0.. for activation row m → outputs (SwiGLU: pairs (up, fc)).
inline void emit_group(const LinearPlan& p, int64_t m, int64_t blk0, int nq, const __m512* v) {
  if (p.swiglu) {
    for (int j = 0; j + 1 < nq; j += 2) emit_swiglu(p, m, blk0 + j, v[j], v[j + 1]);
  } else {
    for (int j = 0; j < nq; ++j) emit(p, m, blk0 + j, v[j]);
  }
}

// I8Q: the LIMBS digit sums (int32 lanes, lowest digit first) of one activation row → fp32(s · Σ_j D_j·256^j),
// exact in double (every term an integer < 2^53), rounded once
inline __m512 limb_sum(const __m512i* d, double s) {
  const __m512d sv = _mm512_set1_pd(s), base = _mm512_set1_pd(256.0);
  __m256 half[2];
  for (int h = 0; h < 2; ++h) {
    __m512d t = _mm512_cvtepi32_pd(_mm512_extracti64x4_epi64(d[LIMBS - 1], h));
    for (int j = LIMBS - 2; j >= 0; --j) t = _mm512_fmadd_pd(t, base, _mm512_cvtepi32_pd(_mm512_extracti64x4_epi64(d[j], h)));
    half[h] = _mm512_cvtpd_ps(_mm512_mul_pd(t, sv));
  }
  return _mm512_insertf32x8(_mm512_castps256_ps512(half[0]), half[1], 1);
}

// FMA engine (linear_fma.cpp): weight blocks [b0, b1) for every activation row
void fma_blocks_any(const LinearPlan& p, int64_t b0, int64_t b1);

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AMX_INT8__)
#define DSPARK_AMX 1  // the compiler targets AMX tiles (whether the CPU and kernel allow them: amx_active())
// AMX engine (linear_amx.cpp): weight blocks [b0, b1) for every 16-row activation tile
void amx_blocks(const LinearPlan& p, int64_t b0, int64_t b1);
#endif

}  // namespace lin
}  // namespace dspark
