// The AVX-512 build's linear(): staging of the activations (RMSNorm prologue, SmoothQuant / W8A16 limb
// quantization) into the layout of the engine that runs (AMX: linear_amx.cpp, FMA: linear_fma.cpp), the product on
// the threads, and build_info(). Layouts, W8A16 limbs and the engines' invariants: linear.h.
#include "linear.h"

namespace dspark {
namespace {

using namespace lin;

void run_blocks(const LinearPlan& p, int64_t b0, int64_t b1) {
#if defined(DSPARK_AMX)
  if (p.amx) return amx_blocks(p, b0, b1);
#endif
  fma_blocks_any(p, b0, b1);
}

// ---------------------------------------------------------------------------------------------------- prologue
// RMSNorm of row m (HF numerics: fp32 statistics, x·r rounded to the model dtype, then · weight, rounded) into h.
void rms_norm_row(const void* x, const void* wt, float eps, int64_t K, bool is_bf16, float* h) {
  __m512 ss = _mm512_setzero_ps();
  for (int64_t k = 0; k < K; k += 16) {
    const __mmask16 mk = tail16(K - k);
    const __m512 v = is_bf16 ? maskz_load_bf16x16(mk, static_cast<const uint16_t*>(x) + k)
                             : _mm512_maskz_loadu_ps(mk, static_cast<const float*>(x) + k);
    ss = _mm512_fmadd_ps(v, v, ss);
  }
  const float r = 1.0f / std::sqrt(reduce_add_x16(ss) / static_cast<float>(K) + eps);
  const __m512 rv = _mm512_set1_ps(r);
  for (int64_t k = 0; k < K; k += 16) {
    const __mmask16 mk = tail16(K - k);
    __m512 y;
    if (is_bf16) {
      const __m512 v = maskz_load_bf16x16(mk, static_cast<const uint16_t*>(x) + k);
      const __m512 wv = maskz_load_bf16x16(mk, static_cast<const uint16_t*>(wt) + k);
      y = round_bf16_x16(_mm512_mul_ps(wv, round_bf16_x16(_mm512_mul_ps(v, rv))));
    } else {
      y = _mm512_mul_ps(_mm512_maskz_loadu_ps(mk, static_cast<const float*>(wt) + k),
                        _mm512_mul_ps(_mm512_maskz_loadu_ps(mk, static_cast<const float*>(x) + k), rv));
    }
    _mm512_mask_storeu_ps(h + k, mk, y);
  }
}

// I8Q: row src [K] (bf16 values) → LIMBS digit rows of int8 (+ bias: 128 for the FMA engine's uint8), lowest digit
// first (row j at dst + j·ld), returns s.
double stage_limbs(const float* src, int64_t K, int8_t* dst, int64_t ld, int bias) {
  __m512 amax = _mm512_setzero_ps();
  for (int64_t k = 0; k < K; k += 16) amax = _mm512_max_ps(amax, _mm512_abs_ps(_mm512_maskz_loadu_ps(tail16(K - k), src + k)));
  const float mx = _mm512_reduce_max_ps(amax);
  int e = 0;
  if (mx > 0.0f && std::isfinite(mx)) std::frexp(mx, &e);  // mx < 2^e
  const __m512 shift = _mm512_set1_ps(static_cast<float>(LIMB_BITS - e));
  const __m512i c128 = _mm512_set1_epi32(128), c255 = _mm512_set1_epi32(255), cb = _mm512_set1_epi32(bias);
  for (int64_t k = 0; k < K; k += 16) {
    const __mmask16 mk = tail16(K - k);
    // v = round(x · 2^(LIMB_BITS - e)), |v| < 2^LIMB_BITS: exact for elements within 2^(LIMB_BITS - 7) of the maximum
    const __m512 f = _mm512_roundscale_ps(_mm512_scalef_ps(_mm512_maskz_loadu_ps(mk, src + k), shift),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512i v = _mm512_cvtps_epi32(f);
    for (int j = 0; j < LIMBS; ++j) {  // balanced digits in [-128, 127]; the top one is what remains (|·| ≤ 64)
      const __m512i d = j + 1 < LIMBS ? _mm512_sub_epi32(_mm512_and_si512(_mm512_add_epi32(v, c128), c255), c128) : v;
      _mm_mask_storeu_epi8(dst + j * ld + k, mk, _mm512_cvtepi32_epi8(_mm512_add_epi32(d, cb)));
      v = _mm512_srai_epi32(_mm512_sub_epi32(v, d), 8);
    }
  }
  return std::ldexp(1.0, e - LIMB_BITS);
}

// Stage x (optionally RMSNorm'd, SQ-quantized) into the engine's layout: AMX bf16 / int8 [Mp, Kp] (Mp = M rounded
// up to 16, zero padded); FMA fp32 [M, Kp] (zero padded; the bf16 kind on VDPBF16PS: bf16 pairs (k + 1, k)) or, for
// SQ, uint8 = int8 + 128 [M, Kp] (padded with 128).
// I8Q: LIMBS limb rows per activation row, on AMX LIMB_ROWS rows per 16-row tile (rows 16t + LIMBS·i + j), on the
// FMA engine rows LIMBS·m + j, + 128; limb_scale[m] = s.
// The buffer is this thread's scratch (kept between calls: no allocator or ATen op per product), valid until its next
// stage_input.
void* stage_input(const at::Tensor& x, const LinearPlan& p, const c10::optional<at::Tensor>& norm, float eps,
                  const float* sq_pre, float sq_act, double* limb_scale) {
  const int64_t M = p.M, K = p.K, Kp = p.Kp;
  const bool sq = p.kind == P_SQ, limbs = p.kind == P_I8Q, i8 = sq || limbs;
  const int64_t rows = limbs ? (p.amx ? (M + LIMB_ROWS - 1) / LIMB_ROWS * 16 : LIMBS * M)
                             : (p.amx ? (M + 15) / 16 * 16 : M);
  const bool dp = dp_bf16(p);  // bf16 pairs for VDPBF16PS (linear.h)
  const int64_t esz = i8 ? 1 : ((p.amx || dp) ? 2 : 4);
  thread_local std::vector<uint8_t> scratch;
  thread_local std::vector<float> h;
  const size_t bytes = static_cast<size_t>(rows * Kp * esz);
  if (scratch.size() < bytes) scratch.resize(bytes);
  if (static_cast<int64_t>(h.size()) < K) h.resize(K);
  char* buf = reinterpret_cast<char*>(scratch.data());
  std::memset(buf, (i8 && !p.amx) ? 128 : 0, bytes);
  const int64_t es = x.element_size();
  for (int64_t m = 0; m < M; ++m) {
    const void* xr = static_cast<const char*>(x.data_ptr()) + m * x.stride(0) * es;
    const float* src;
    if (norm.has_value()) {
      rms_norm_row(xr, norm->data_ptr(), eps, K, p.bf16, h.data());
      src = h.data();
    } else if (p.bf16) {
      for (int64_t k = 0; k < K; k += 16) {
        const __mmask16 mk = tail16(K - k);
        _mm512_mask_storeu_ps(h.data() + k, mk, maskz_load_bf16x16(mk, static_cast<const uint16_t*>(xr) + k));
      }
      src = h.data();
    } else {
      src = static_cast<const float*>(xr);
    }
    if (limbs) {
      int8_t* base = reinterpret_cast<int8_t*>(buf);
      const int64_t r0 = p.amx ? (m / LIMB_ROWS) * 16 + LIMBS * (m % LIMB_ROWS) : LIMBS * m;
      limb_scale[m] = stage_limbs(src, K, base + r0 * Kp, Kp, p.amx ? 0 : 128);
    } else if (sq) {  // torch's op order: round(x · pre / a), clamp to [-128, 127]
      const __m512 av = _mm512_set1_ps(sq_act);
      for (int64_t k = 0; k < K; k += 16) {
        const __mmask16 mk = tail16(K - k);
        __m512 v = _mm512_div_ps(_mm512_mul_ps(_mm512_maskz_loadu_ps(mk, src + k), _mm512_maskz_loadu_ps(mk, sq_pre + k)), av);
        v = _mm512_roundscale_ps(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
        v = _mm512_min_ps(_mm512_max_ps(v, _mm512_set1_ps(-128.0f)), _mm512_set1_ps(127.0f));
        __m512i i = _mm512_cvtps_epi32(v);
        if (!p.amx) i = _mm512_add_epi32(i, _mm512_set1_epi32(128));
        _mm_mask_storeu_epi8(reinterpret_cast<int8_t*>(buf) + m * Kp + k, mk, _mm512_cvtepi32_epi8(i));
      }
    } else if (p.amx) {
      for (int64_t k = 0; k < K; k += 16) {
        const __mmask16 mk = tail16(K - k);
        _mm256_mask_storeu_epi16(reinterpret_cast<uint16_t*>(buf) + m * Kp + k, mk, f2b_x16(_mm512_maskz_loadu_ps(mk, src + k)));
      }
    } else if (dp) {  // bf16 k-pairs with their halves swapped, (k + 1, k): VDPBF16PS's order (linear.h)
      for (int64_t k = 0; k < K; k += 16) {
        const __m256i b = f2b_x16(_mm512_maskz_loadu_ps(tail16(K - k), src + k));  // exact: src holds bf16 values
        const __m256i sw = _mm256_or_si256(_mm256_slli_epi32(b, 16), _mm256_srli_epi32(b, 16));
        _mm256_mask_storeu_epi16(reinterpret_cast<uint16_t*>(buf) + m * Kp + k, tail16((K - k + 1) & ~int64_t{1}), sw);
      }
    } else {
      std::memcpy(reinterpret_cast<float*>(buf) + m * Kp, src, K * sizeof(float));
    }
  }
  return buf;
}

}  // namespace

at::Tensor linear(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& rowsum, int64_t kind, int64_t N,
                  bool swiglu, const c10::optional<at::Tensor>& scale, const c10::optional<at::Tensor>& bias,
                  bool bias_f32, const c10::optional<at::Tensor>& residual, const c10::optional<at::Tensor>& norm_weight,
                  double eps, const c10::optional<at::Tensor>& sq_pre, double sq_act, bool out_f32) {
  LinearPlan p;
  const float* pre = nullptr;
  at::Tensor out = make_plan(x, packed, rowsum, kind, N, swiglu, scale, bias, bias_f32, residual, norm_weight, sq_pre,
                             out_f32, amx_active(), &p, &pre);
  const bool is_bf16 = p.bf16;
  std::vector<double> limb_scale(kind == P_I8Q ? p.M : 0);
  p.limb_scale = limb_scale.data();

  const bool in_place = !norm_weight.has_value() && kind != P_SQ && !is_bf16 && p.Kp == p.K;  // fp32 rows as they are
  execute(p, x, in_place, [&] {
    return stage_input(x, p, norm_weight, static_cast<float>(eps), pre, static_cast<float>(sq_act), limb_scale.data());
  }, run_blocks);
  return out;
}

std::string build_info() {
  std::string s = "avx512";
#if defined(__AVX512VNNI__)
  s += "+vnni";
#endif
#if defined(__AVX512BF16__)
  s += lin::dp_bf16_exact() ? "+bf16" : "+bf16(off: VDPBF16PS rounds otherwise here)";
#endif
#if defined(DSPARK_AMX)
  s += "+amx";
#endif
  return s + (amx_active() ? " (amx on)" : " (fma)");
}

}  // namespace dspark
