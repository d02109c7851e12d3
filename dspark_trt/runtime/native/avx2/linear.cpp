// The AVX2 + FMA engine of the native products (x86-64-v3 CPUs without AVX-512, or forced): the packed layouts and
// plan of plan.h / linear.h, 8 output rows per register instead of 16, and per output the accumulation of the
// AVX-512 FMA engine (linear_fma.cpp), so the two engines give the same bits:
// - bf16 / fp32 / int8-weight-with-fp32-activation kinds: one fp32 FMA chain over k in order (k-pairs: k, then k + 1);
// - int8 x int8 kinds on vpmaddwd: SmoothQuant activations as int16, W8A16 (P_I8Q) activations as the whole 16-bit
//   fixed-point integer v of linear.h (no limbs: |v| ≤ 2^14 fits int16), weights sign-extended from the k-quad
//   layout. The sums are exact integers (int32 lanes for ≤ 128 quads, then exact in double), so they equal the
//   VNNI / AMX engines' exact sums whatever the order; y = fp32(s · Σ) rounded once, as there.
// Staging, the RMSNorm prologue and the epilogue use linear.cpp / linear.h's op order lane for lane.
#include "../plan.h"
#include "../simd256.h"

namespace dspark {
namespace {

using namespace lin;

// ---------------------------------------------------------------------------------------------------- epilogue
// half h (rows 8h..8h+7) of weight block blk → first output row, valid rows
inline void half_rows(const LinearPlan& p, int64_t blk, int h, int64_t* row0, int64_t* n) {
  const int64_t half = p.N / 2;
  const int64_t r0 = (p.swiglu ? (blk / 2) * 16 + (blk % 2 ? half : 0) : blk * 16) + 8 * h;
  const int64_t lim = p.swiglu ? (blk % 2 ? p.N : half) : p.N;
  *row0 = r0;
  *n = std::max<int64_t>(0, std::min<int64_t>(8, lim - r0));
}

inline __m256 finish(const LinearPlan& p, int64_t row0, int64_t n, __m256 v) {  // linear.h finish()
  if (p.scale) v = _mm256_mul_ps(v, v8::maskz_load(n, p.scale + row0));
  if (p.bias && p.bias_f32) v = _mm256_add_ps(v, v8::maskz_load(n, static_cast<const float*>(p.bias) + row0));
  if (p.bf16) v = v8::round_bf16(v);
  if (p.bias && !p.bias_f32) {
    v = p.bf16 ? v8::round_bf16(_mm256_add_ps(v, v8::maskz_load_bf16(n, static_cast<const uint16_t*>(p.bias) + row0)))
               : _mm256_add_ps(v, v8::maskz_load(n, static_cast<const float*>(p.bias) + row0));
  }
  return v;
}

inline void store8(const LinearPlan& p, int64_t m, int64_t col0, int64_t n, __m256 y) {  // linear.h store16()
  if (n <= 0) return;
  const int64_t ldo = p.swiglu ? p.N / 2 : p.N;
  if (p.res) {
    y = p.bf16 ? v8::round_bf16(_mm256_add_ps(v8::maskz_load_bf16(n, static_cast<const uint16_t*>(p.res) + m * ldo + col0), y))
               : _mm256_add_ps(v8::maskz_load(n, static_cast<const float*>(p.res) + m * ldo + col0), y);
  }
  if (p.out_f32 || !p.bf16) v8::mask_store(n, static_cast<float*>(p.out) + m * ldo + col0, y);
  else v8::mask_store_bf16(n, static_cast<uint16_t*>(p.out) + m * ldo + col0, v8::bf16_bits(y));  // y is rounded
}

inline void emit(const LinearPlan& p, int64_t m, int64_t blk, int h, __m256 v) {
  int64_t r0, n;
  half_rows(p, blk, h, &r0, &n);
  store8(p, m, r0, n, finish(p, r0, n, v));
}
inline void emit_swiglu(const LinearPlan& p, int64_t m, int64_t blk_up, int h, __m256 vu, __m256 vf) {
  int64_t ru, rf, nu, nf;
  half_rows(p, blk_up, h, &ru, &nu);
  half_rows(p, blk_up + 1, h, &rf, &nf);
  const __m256 up = finish(p, ru, nu, vu), fc = finish(p, rf, nf, vf);
  __m256 s = v8::silu(fc);
  if (p.bf16) s = v8::round_bf16(s);
  __m256 y = _mm256_mul_ps(up, s);
  if (p.bf16) y = v8::round_bf16(y);
  store8(p, m, ru, nu, y);
}
// sums v[b][h] of blocks blk0 + b for activation row m → outputs (SwiGLU: pairs (up, fc))
template <int NBT>
inline void emit_blocks(const LinearPlan& p, int64_t m, int64_t blk0, const __m256 (&v)[NBT][2]) {
  for (int h = 0; h < 2; ++h) {
    if (p.swiglu) {
      for (int b = 0; b + 1 < NBT; b += 2) emit_swiglu(p, m, blk0 + b, h, v[b][h], v[b + 1][h]);
    } else {
      for (int b = 0; b < NBT; ++b) emit(p, m, blk0 + b, h, v[b][h]);
    }
  }
}

// ---------------------------------------------------------------------------------------------------- float kinds
// acc[b][h][m] (lanes = rows 8h.. of block blk0 + b) = Σ_k x[m0 + m, k] · w[row, k], k in order
template <int KIND, int MRT, int NBT>
inline void fma_tile(const LinearPlan& p, int64_t m0, int64_t blk0) {
  __m256 acc[NBT][2][MRT];
  for (int b = 0; b < NBT; ++b)
    for (int h = 0; h < 2; ++h)
      for (int m = 0; m < MRT; ++m) acc[b][h][m] = _mm256_setzero_ps();
  const int64_t Kp = p.Kp, ldx = p.ldx;
  const float* xr = static_cast<const float*>(p.x) + m0 * ldx;
  if constexpr (KIND == P_BF16) {
    const int64_t kq = Kp / 2;
    const __m256i hi_mask = _mm256_set1_epi32(static_cast<int>(0xFFFF0000u));
    for (int64_t k2 = 0; k2 < kq; ++k2) {
      __m256 x0[MRT], x1[MRT];
      for (int m = 0; m < MRT; ++m) {
        x0[m] = _mm256_broadcast_ss(xr + m * ldx + 2 * k2);
        x1[m] = _mm256_broadcast_ss(xr + m * ldx + 2 * k2 + 1);
      }
      for (int b = 0; b < NBT; ++b) {
        const uint16_t* wp = static_cast<const uint16_t*>(p.w) + ((blk0 + b) * kq + k2) * 32;
        for (int h = 0; h < 2; ++h) {
          const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wp + 16 * h));
          const __m256 w0 = _mm256_castsi256_ps(_mm256_slli_epi32(raw, 16));
          const __m256 w1 = _mm256_castsi256_ps(_mm256_and_si256(raw, hi_mask));
          for (int m = 0; m < MRT; ++m) acc[b][h][m] = _mm256_fmadd_ps(x1[m], w1, _mm256_fmadd_ps(x0[m], w0, acc[b][h][m]));
        }
      }
    }
  } else {  // P_F32, P_I8F: [NB, K, 16]
    for (int64_t k = 0; k < Kp; ++k) {
      __m256 xv[MRT];
      for (int m = 0; m < MRT; ++m) xv[m] = _mm256_broadcast_ss(xr + m * ldx + k);
      for (int b = 0; b < NBT; ++b) {
        for (int h = 0; h < 2; ++h) {
          __m256 wv;
          if constexpr (KIND == P_F32) {
            wv = _mm256_loadu_ps(static_cast<const float*>(p.w) + ((blk0 + b) * Kp + k) * 16 + 8 * h);
          } else {
            wv = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(
                static_cast<const int8_t*>(p.w) + ((blk0 + b) * Kp + k) * 16 + 8 * h))));
          }
          for (int m = 0; m < MRT; ++m) acc[b][h][m] = _mm256_fmadd_ps(xv[m], wv, acc[b][h][m]);
        }
      }
    }
  }
  for (int m = 0; m < MRT; ++m) {
    __m256 v[NBT][2];
    for (int b = 0; b < NBT; ++b)
      for (int h = 0; h < 2; ++h) v[b][h] = acc[b][h][m];
    emit_blocks<NBT>(p, m0 + m, blk0, v);
  }
}

// ---------------------------------------------------------------------------------------------------- int8 kinds
constexpr int64_t SEG = 128;  // quads per int32 segment: |lane| ≤ 128 · 2 · 2^21 = 2^29, a row's pair sum ≤ 2^30

// exact Σ_k x[m0 + m, k] · w[row, k] per row of blocks blk0 + b, as double [b][quarter q: rows 4q..4q+3][m]
template <int MRT, int NBT>
inline void int_sums(const LinearPlan& p, int64_t m0, int64_t blk0, __m256d (&tot)[NBT][4][MRT]) {
  for (int b = 0; b < NBT; ++b)
    for (int q = 0; q < 4; ++q)
      for (int m = 0; m < MRT; ++m) tot[b][q][m] = _mm256_setzero_pd();
  const int64_t kq = p.Kp / 4, ldx = p.ldx;
  const int16_t* xr = static_cast<const int16_t*>(p.x) + m0 * ldx;
  for (int64_t s0 = 0; s0 < kq; s0 += SEG) {
    const int64_t s1 = std::min(kq, s0 + SEG);
    // acc[b][q][m] lanes: row 4q + i, pair i·2 + j = Σ over the segment of x[4k4 + 2j .. +1] · w[.., same k]
    __m256i acc[NBT][4][MRT];
    for (int b = 0; b < NBT; ++b)
      for (int q = 0; q < 4; ++q)
        for (int m = 0; m < MRT; ++m) acc[b][q][m] = _mm256_setzero_si256();
    for (int64_t k4 = s0; k4 < s1; ++k4) {
      __m256i xb[MRT];
      for (int m = 0; m < MRT; ++m) {
        int64_t quad;
        std::memcpy(&quad, xr + m * ldx + 4 * k4, 8);
        xb[m] = _mm256_set1_epi64x(quad);
      }
      for (int b = 0; b < NBT; ++b) {
        const int8_t* wp = static_cast<const int8_t*>(p.w) + ((blk0 + b) * kq + k4) * 64;
        for (int q = 0; q < 4; ++q) {
          const __m256i w16 = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(wp + 16 * q)));
          for (int m = 0; m < MRT; ++m) acc[b][q][m] = _mm256_add_epi32(acc[b][q][m], _mm256_madd_epi16(w16, xb[m]));
        }
      }
    }
    for (int b = 0; b < NBT; ++b) {
      for (int m = 0; m < MRT; ++m) {
        for (int g = 0; g < 2; ++g) {  // rows 8g..8g+7: hadd of quarters 2g, 2g+1 → [r0 r1 r4 r5 | r2 r3 r6 r7]
          const __m256i r = _mm256_permute4x64_epi64(_mm256_hadd_epi32(acc[b][2 * g][m], acc[b][2 * g + 1][m]), 0xD8);
          tot[b][2 * g][m] = _mm256_add_pd(tot[b][2 * g][m], _mm256_cvtepi32_pd(_mm256_castsi256_si128(r)));
          tot[b][2 * g + 1][m] = _mm256_add_pd(tot[b][2 * g + 1][m], _mm256_cvtepi32_pd(_mm256_extracti128_si256(r, 1)));
        }
      }
    }
  }
}

template <int MRT, int NBT>
inline void int_tile(const LinearPlan& p, int64_t m0, int64_t blk0) {
  __m256d tot[NBT][4][MRT];
  int_sums<MRT, NBT>(p, m0, blk0, tot);
  for (int m = 0; m < MRT; ++m) {
    // I8Q: fp32(s · Σ) (s a power of two: exact in double); SQ: the exact integer rounded to fp32
    const __m256d s = _mm256_set1_pd(p.kind == P_I8Q ? p.limb_scale[m0 + m] : 1.0);
    __m256 v[NBT][2];
    for (int b = 0; b < NBT; ++b)
      for (int h = 0; h < 2; ++h)
        v[b][h] = _mm256_set_m128(_mm256_cvtpd_ps(_mm256_mul_pd(tot[b][2 * h + 1][m], s)),
                                  _mm256_cvtpd_ps(_mm256_mul_pd(tot[b][2 * h][m], s)));
    emit_blocks<NBT>(p, m0 + m, blk0, v);
  }
}

// ---------------------------------------------------------------------------------------------------- tiling
template <int KIND, int NBT>
void fma_rows(const LinearPlan& p, int64_t m0, int64_t mr, int64_t blk) {
  if (mr == 1) fma_tile<KIND, 1, NBT>(p, m0, blk); else fma_tile<KIND, 2, NBT>(p, m0, blk);
}

template <int KIND>
void float_blocks(const LinearPlan& p, int64_t b0, int64_t b1) {
  if (p.M == 1) {  // decode: four blocks (64 output rows) per pass
    int64_t blk = b0;
    for (; blk + 4 <= b1; blk += 4) fma_tile<KIND, 1, 4>(p, 0, blk);
    for (; blk + 2 <= b1; blk += 2) fma_tile<KIND, 1, 2>(p, 0, blk);
    if (blk < b1) fma_tile<KIND, 1, 1>(p, 0, blk);
    return;
  }
  for (int64_t m0 = 0; m0 < p.M; m0 += 2) {
    const int64_t mr = std::min<int64_t>(2, p.M - m0);
    for (int64_t blk = b0; blk < b1; blk += 2) {
      if (blk + 1 < b1) fma_rows<KIND, 2>(p, m0, mr, blk); else fma_rows<KIND, 1>(p, m0, mr, blk);
    }
  }
}

void int_blocks(const LinearPlan& p, int64_t b0, int64_t b1) {
  if (p.M == 1 || p.swiglu) {  // one row, two blocks (SwiGLU: the (up, fc) pair) per pass
    for (int64_t m = 0; m < p.M; ++m)
      for (int64_t blk = b0; blk < b1; blk += 2) {
        if (blk + 1 < b1) int_tile<1, 2>(p, m, blk); else int_tile<1, 1>(p, m, blk);
      }
    return;
  }
  for (int64_t m0 = 0; m0 < p.M; m0 += 2) {
    const bool two = m0 + 1 < p.M;
    for (int64_t blk = b0; blk < b1; ++blk) {
      if (two) int_tile<2, 1>(p, m0, blk); else int_tile<1, 1>(p, m0, blk);
    }
  }
}

void run_blocks(const LinearPlan& p, int64_t b0, int64_t b1) {
  switch (p.kind) {
    case P_BF16: return float_blocks<P_BF16>(p, b0, b1);
    case P_F32: return float_blocks<P_F32>(p, b0, b1);
    case P_I8F: return float_blocks<P_I8F>(p, b0, b1);
    default: return int_blocks(p, b0, b1);  // P_SQ, P_I8Q
  }
}

// ---------------------------------------------------------------------------------------------------- prologue
// RMSNorm of one row into h (linear.cpp rms_norm_row: the sum of squares in 16 lanes, reduced by the same tree)
void rms_norm_row(const void* x, const void* wt, float eps, int64_t K, bool is_bf16, float* h) {
  auto ld = [&](const void* base, int64_t k) {
    const int64_t n = K - k;
    return is_bf16 ? v8::maskz_load_bf16(n, static_cast<const uint16_t*>(base) + k)
                   : v8::maskz_load(n, static_cast<const float*>(base) + k);
  };
  __m256 lo = _mm256_setzero_ps(), hi = _mm256_setzero_ps();
  for (int64_t k = 0; k < K; k += 16) {
    const __m256 a = ld(x, k), b = ld(x, k + 8);
    lo = _mm256_fmadd_ps(a, a, lo);
    hi = _mm256_fmadd_ps(b, b, hi);
  }
  const float r = 1.0f / std::sqrt(v8::reduce_add16(lo, hi) / static_cast<float>(K) + eps);
  const __m256 rv = _mm256_set1_ps(r);
  for (int64_t k = 0; k < K; k += 8) {
    const __m256 v = ld(x, k), wv = ld(wt, k);
    const __m256 y = is_bf16 ? v8::round_bf16(_mm256_mul_ps(wv, v8::round_bf16(_mm256_mul_ps(v, rv))))
                             : _mm256_mul_ps(wv, _mm256_mul_ps(v, rv));
    v8::mask_store(K - k, h + k, y);
  }
}

inline void store_i16(int16_t* dst, int64_t n, __m256i v) {  // 8 int32 lanes (each within int16) → n int16
  const __m128i s = _mm_packs_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  if (n >= 8) { _mm_storeu_si128(reinterpret_cast<__m128i*>(dst), s); return; }
  alignas(16) int16_t tmp[8];
  _mm_store_si128(reinterpret_cast<__m128i*>(tmp), s);
  std::memcpy(dst, tmp, static_cast<size_t>(n) * 2);
}

// I8Q: row src [K] → v = round(x · 2^(LIMB_BITS − e)) as int16 (linear.cpp stage_limbs' v, before its digits); s
double stage_fixed(const float* src, int64_t K, int16_t* dst) {
  const __m256 sign = _mm256_set1_ps(-0.0f);
  __m256 amax = _mm256_setzero_ps();
  for (int64_t k = 0; k < K; k += 8) amax = _mm256_max_ps(amax, _mm256_andnot_ps(sign, v8::maskz_load(K - k, src + k)));
  const float mx = v8::reduce_max(amax);
  int e = 0;
  if (mx > 0.0f && std::isfinite(mx)) std::frexp(mx, &e);  // mx < 2^e
  // x · 2^(LIMB_BITS − e) as two exact power-of-two products (each factor a normal float), = _mm512_scalef_ps
  const int shift = LIMB_BITS - e, a = shift >> 1, b = shift - a;
  const __m256 fa = _mm256_set1_ps(std::ldexp(1.0f, a)), fb = _mm256_set1_ps(std::ldexp(1.0f, b));
  for (int64_t k = 0; k < K; k += 8) {
    const __m256 f = _mm256_round_ps(_mm256_mul_ps(_mm256_mul_ps(v8::maskz_load(K - k, src + k), fa), fb),
                                     _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    store_i16(dst + k, K - k, _mm256_cvtps_epi32(f));
  }
  return std::ldexp(1.0, e - LIMB_BITS);
}

// Stage x (optionally RMSNorm'd) for the engine: fp32 [M, Kp] (float kinds), int16 [M, Kp] (SQ: the quantized
// activation; I8Q: v), zero padded. This thread's scratch, valid until its next stage_input.
void* stage_input(const at::Tensor& x, const LinearPlan& p, const c10::optional<at::Tensor>& norm, float eps,
                  const float* sq_pre, float sq_act, double* limb_scale) {
  const int64_t M = p.M, K = p.K, Kp = p.Kp;
  const bool ints = quads(p.kind);
  const int64_t esz = ints ? 2 : 4;
  thread_local std::vector<uint8_t> scratch;
  thread_local std::vector<float> h;
  const size_t bytes = static_cast<size_t>(M * Kp * esz);
  if (scratch.size() < bytes) scratch.resize(bytes);
  if (static_cast<int64_t>(h.size()) < K) h.resize(K);
  char* buf = reinterpret_cast<char*>(scratch.data());
  std::memset(buf, 0, bytes);
  const int64_t es = x.element_size();
  for (int64_t m = 0; m < M; ++m) {
    const void* xr = static_cast<const char*>(x.data_ptr()) + m * x.stride(0) * es;
    const float* src;
    if (norm.has_value()) {
      rms_norm_row(xr, norm->data_ptr(), eps, K, p.bf16, h.data());
      src = h.data();
    } else if (p.bf16) {
      for (int64_t k = 0; k < K; k += 8)
        v8::mask_store(K - k, h.data() + k, v8::maskz_load_bf16(K - k, static_cast<const uint16_t*>(xr) + k));
      src = h.data();
    } else {
      src = static_cast<const float*>(xr);
    }
    int16_t* row16 = reinterpret_cast<int16_t*>(buf) + m * Kp;
    if (p.kind == P_I8Q) {
      limb_scale[m] = stage_fixed(src, K, row16);
    } else if (p.kind == P_SQ) {  // torch's op order: round(x · pre / a), clamp to [-128, 127]
      const __m256 av = _mm256_set1_ps(sq_act);
      for (int64_t k = 0; k < K; k += 8) {
        __m256 v = _mm256_div_ps(_mm256_mul_ps(v8::maskz_load(K - k, src + k), v8::maskz_load(K - k, sq_pre + k)), av);
        v = _mm256_round_ps(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
        v = _mm256_min_ps(_mm256_max_ps(v, _mm256_set1_ps(-128.0f)), _mm256_set1_ps(127.0f));
        store_i16(row16 + k, K - k, _mm256_cvtps_epi32(v));
      }
    } else {
      std::memcpy(reinterpret_cast<float*>(buf) + m * Kp, src, K * sizeof(float));
    }
  }
  return buf;
}

}  // namespace

bool amx_active() { return false; }
void set_amx(bool) {}

at::Tensor linear(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& rowsum, int64_t kind, int64_t N,
                  bool swiglu, const c10::optional<at::Tensor>& scale, const c10::optional<at::Tensor>& bias,
                  bool bias_f32, const c10::optional<at::Tensor>& residual, const c10::optional<at::Tensor>& norm_weight,
                  double eps, const c10::optional<at::Tensor>& sq_pre, double sq_act, bool out_f32) {
  TORCH_CHECK(kind != P_I8P, "linear: the AVX2 engine runs W8A16 with bf16 activations as P_I8Q");
  LinearPlan p;
  const float* pre = nullptr;
  at::Tensor out = make_plan(x, packed, rowsum, kind, N, swiglu, scale, bias, bias_f32, residual, norm_weight, sq_pre,
                             out_f32, false, &p, &pre);
  std::vector<double> limb_scale(kind == P_I8Q ? p.M : 0);
  p.limb_scale = limb_scale.data();
  if (!norm_weight.has_value() && !quads(p.kind) && !p.bf16 && p.Kp == p.K) {
    p.x = x.data_ptr();  // fp32 rows used in place
    p.ldx = x.stride(0);
  } else {
    p.x = stage_input(x, p, norm_weight, static_cast<float>(eps), pre, static_cast<float>(sq_act), limb_scale.data());
    p.ldx = p.Kp;
  }
  const int64_t per_task = 4;  // weight blocks per task (even: SwiGLU keeps (up, fc) pairs together)
  const int64_t ntasks = (p.NB + per_task - 1) / per_task;
  const int64_t work = p.M * p.NB * 16 * p.Kp;
  const int64_t grain = work < (1 << 17) ? ntasks : 1;  // tiny products run inline (no fork)
  at::parallel_for(0, ntasks, grain, [&](int64_t t0, int64_t t1) {
    run_blocks(p, t0 * per_task, std::min(p.NB, t1 * per_task));
  });
  return out;
}

std::string build_info() { return "avx2+fma"; }

}  // namespace dspark
