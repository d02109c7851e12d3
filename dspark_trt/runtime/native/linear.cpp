// Row-invariant products of the dspark_trt native kernels: packing, staging (RMSNorm prologue, SmoothQuant / limb
// quantization), the AMX engine and linear(). Layouts, W8A16 limbs and the engines' invariants: linear.h.
#include <sys/syscall.h>
#include <unistd.h>

#include <atomic>

#include "linear.h"

namespace dspark {
namespace {

using namespace lin;

std::atomic<int> g_amx_allowed{1};

bool amx_supported() {
#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AMX_INT8__)
  static const bool ok = [] {
    constexpr long ARCH_REQ_XCOMP_PERM = 0x1023, XFEATURE_XTILEDATA = 18;
    return syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
  }();
  return ok;
#else
  return false;
#endif
}

// ---------------------------------------------------------------------------------------------------- AMX engine
#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AMX_INT8__)
struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

#if defined(__AVX512VNNI__)
// I8Q: rows past the full tiles (T of them, ≤ VNNI_TAIL) on VNNI dpbusd in the tiles' pass, from the weight chunk c
// the tiles just loaded (L1): acc[b][i][j] += limb j of tail row i · block b, exact int32 sums (the same bits as on a
// tile). Staged limbs are signed; ^ 0x80 per byte makes them the uint8 v + 128 dpbusd takes (p.rowsum corrects).
constexpr int VNNI_TAIL = 2;
template <int T>
inline void limb_tail_chunk(const int8_t* xt, int64_t ldx, const char* Bc, int64_t bs, int nq, __m512i (&acc)[4][VNNI_TAIL][LIMBS]) {
  for (int q = 0; q < 16; ++q) {
    __m512i xv[T][LIMBS];
    for (int i = 0; i < T; ++i)
      for (int j = 0; j < LIMBS; ++j) {
        int32_t quad;
        std::memcpy(&quad, xt + (LIMBS * i + j) * ldx + 4 * q, 4);
        xv[i][j] = _mm512_set1_epi32(quad ^ static_cast<int32_t>(0x80808080u));
      }
    for (int b = 0; b < 4; ++b) {
      if (b >= nq) break;
      const __m512i w = _mm512_loadu_si512(Bc + b * bs + q * 64);
      for (int i = 0; i < T; ++i)
        for (int j = 0; j < LIMBS; ++j) acc[b][i][j] = _mm512_dpbusd_epi32(acc[b][i][j], xv[i][j], w);
    }
  }
}
#else
constexpr int VNNI_TAIL = 0;
#endif

// Blocks [b0, b1) (a multiple of 2 apart for SwiGLU), all 16-row activation tiles. Tiles 0-3 accumulate four
// weight blocks, tile 4 holds the activation chunk, tiles 5 / 6 the weight chunks.
void amx_blocks(const LinearPlan& p, int64_t b0, int64_t b1) {
  const bool sq = quads(p.kind), limbs = p.kind == P_I8Q;
  const int64_t rows_used = limbs ? LIMBS * std::min<int64_t>(p.M, LIMB_ROWS) : std::min<int64_t>(p.M, 16);
  const int arows = static_cast<int>(p.M <= (limbs ? LIMB_ROWS : 16) ? rows_used : 16);  // one tile: only its rows
  TileConfig cfg;
  for (int t = 0; t < 7; ++t) {
    cfg.rows[t] = (t <= 4) ? arows : 16;  // C tiles 0-3 and A tile 4 have the activation rows; B tiles 16 k-rows
    cfg.colsb[t] = 64;
  }
  _tile_loadconfig(&cfg);
  const int64_t chunk = sq ? 64 : 32;  // k per tile step
  const int64_t nchunks = p.Kp / chunk;
  const int64_t block_bytes = p.Kp * 16 * (sq ? 1 : 2);
  const int64_t xes = sq ? 1 : 2, ldx_b = p.ldx * xes;
  const int64_t per_tile = limbs ? LIMB_ROWS : 16;  // activation rows per tile
  // I8Q with 1..VNNI_TAIL rows past full tiles (verify of K + 1 = 9 or 10 tokens): those on VNNI in the same pass
  const int tail = (limbs && p.M > LIMB_ROWS && p.M % LIMB_ROWS <= VNNI_TAIL) ? static_cast<int>(p.M % LIMB_ROWS) : 0;
  const int64_t mtiles = (p.M - tail + per_tile - 1) / per_tile;
  alignas(64) float cbuf[2][4][256];  // two groups' sums: one group's epilogue runs during the next group's chunks
  // Raw tile sums of activation row r of tile mt, weight blocks nb.. nb + nq - 1 (in cb) → outputs.
  auto epi_row = [&](const float (*cb)[256], int64_t nbp, int nqp, int64_t mtp, int64_t r) {
    const int64_t m = mtp * per_tile + r;
    __m512 v[4];
    for (int j = 0; j < nqp; ++j) {
      if (limbs) {
        __m512i d[LIMBS];
        for (int l = 0; l < LIMBS; ++l) d[l] = _mm512_load_si512(cb[j] + (LIMBS * r + l) * 16);
        v[j] = limb_sum(d, p.limb_scale[m]);
      } else {
        v[j] = _mm512_load_ps(cb[j] + r * 16);
        if (sq) v[j] = _mm512_cvtepi32_ps(_mm512_castps_si512(v[j]));
      }
    }
    emit_group(p, m, nbp, nqp, v);
  };
  struct Pending { int64_t nb = -1, mt = 0, mr = 0, done = 0; int nq = 0, buf = 0; } pend;
  auto drain = [&](int64_t upto) {
    for (; pend.nb >= 0 && pend.done < std::min(upto, pend.mr); ++pend.done) epi_row(cbuf[pend.buf], pend.nb, pend.nq, pend.mt, pend.done);
  };
  int cur = 0;
  thread_local std::vector<uint16_t> wide;  // W8A16 with > 16 rows: the block quad widened to bf16 once
  alignas(64) uint16_t wtile[4][512];       // W8A16 with ≤ 16 rows: one chunk of each block, widened in L1
  const bool i8 = p.kind == P_I8P, per_chunk = i8 && mtiles == 1;
  auto widen = [](const int8_t* src, uint16_t* dst, int64_t n) {  // exact: int8 values are bf16 values
    for (int64_t i = 0; i < n; i += 32) {
      const __m256i w8 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + i));
      const __m512 lo = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_castsi256_si128(w8)));
      const __m512 hi = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_extracti128_si256(w8, 1)));
      _mm512_storeu_si512(dst + i, (__m512i)_mm512_cvtne2ps_pbh(hi, lo));
    }
  };
  for (int64_t nb = b0; nb < b1; nb += 4) {
    const int nq = static_cast<int>(std::min<int64_t>(4, b1 - nb));
    const char* B = static_cast<const char*>(p.w) + nb * block_bytes;
    const int8_t* B8 = static_cast<const int8_t*>(p.w) + nb * p.Kp * 16;
    if (i8 && !per_chunk) {
      const int64_t n = nq * p.Kp * 16;
      if (static_cast<int64_t>(wide.size()) < n) wide.resize(n);
      widen(B8, wide.data(), n);
      B = reinterpret_cast<const char*>(wide.data());
    }
    for (int64_t mt = 0; mt < mtiles; ++mt) {
      _tile_zero(0);
      _tile_zero(1);
      _tile_zero(2);
      _tile_zero(3);
      const char* A = static_cast<const char*>(p.x) + mt * 16 * ldx_b;  // 16 staged rows per tile
      const bool with_tail = tail > 0 && mt == 0;
#if defined(__AVX512VNNI__)
      __m512i tacc[4][VNNI_TAIL][LIMBS];
      const int8_t* xt = static_cast<const int8_t*>(p.x) + mtiles * 16 * p.ldx;  // the tail's staged limb rows
      if (with_tail)
        for (int b = 0; b < 4; ++b)
          for (int i = 0; i < VNNI_TAIL; ++i)
            for (int j = 0; j < LIMBS; ++j) tacc[b][i][j] = _mm512_setzero_si512();
#endif
      for (int64_t c = 0; c < nchunks; ++c) {
        _tile_loadd(4, A + c * chunk * xes, ldx_b);
        const char* Bc = B + c * 1024;
        int64_t bs = block_bytes;
        if (per_chunk) {
          for (int j = 0; j < nq; ++j) widen(B8 + j * p.Kp * 16 + c * 512, wtile[j], 512);
          Bc = reinterpret_cast<const char*>(wtile[0]);
          bs = 1024;
        }
        _tile_loadd(5, Bc, 64);
        if (sq) _tile_dpbssd(0, 4, 5); else _tile_dpbf16ps(0, 4, 5);
        if (nq > 1) {
          _tile_loadd(6, Bc + bs, 64);
          if (sq) _tile_dpbssd(1, 4, 6); else _tile_dpbf16ps(1, 4, 6);
        }
        if (nq > 2) {
          _tile_loadd(5, Bc + 2 * bs, 64);
          if (sq) _tile_dpbssd(2, 4, 5); else _tile_dpbf16ps(2, 4, 5);
        }
        if (nq > 3) {
          _tile_loadd(6, Bc + 3 * bs, 64);
          if (sq) _tile_dpbssd(3, 4, 6); else _tile_dpbf16ps(3, 4, 6);
        }
        drain((c + 1) * ((pend.mr + nchunks - 1) / nchunks));  // the previous group's rows, spread over the chunks
#if defined(__AVX512VNNI__)
        if (with_tail) {
          if (tail == 1) limb_tail_chunk<1>(xt + c * 64, p.ldx, Bc, bs, nq, tacc);
          else limb_tail_chunk<2>(xt + c * 64, p.ldx, Bc, bs, nq, tacc);
        }
#endif
      }
      _tile_stored(0, cbuf[cur][0], 64);
      if (nq > 1) _tile_stored(1, cbuf[cur][1], 64);
      if (nq > 2) _tile_stored(2, cbuf[cur][2], 64);
      if (nq > 3) _tile_stored(3, cbuf[cur][3], 64);
      drain(INT64_MAX);
      pend = Pending{nb, mt, std::min<int64_t>(per_tile, p.M - mt * per_tile), 0, nq, cur};
      cur ^= 1;
#if defined(__AVX512VNNI__)
      for (int i = 0; with_tail && i < tail; ++i) {
        const int64_t m = mtiles * per_tile + i;
        __m512 v[4];
        for (int j = 0; j < nq; ++j) {
          const __m512i corr = _mm512_slli_epi32(_mm512_loadu_si512(p.rowsum + (nb + j) * 16), 7);  // 128 · Σw
          __m512i d[LIMBS];
          for (int l = 0; l < LIMBS; ++l) d[l] = _mm512_sub_epi32(tacc[j][i][l], corr);
          v[j] = limb_sum(d, p.limb_scale[m]);
        }
        emit_group(p, m, nb, nq, v);
      }
#endif
    }
  }
  drain(INT64_MAX);
  _tile_release();
}
#endif

void run_blocks(const LinearPlan& p, int64_t b0, int64_t b1) {
#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AMX_INT8__)
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
// up to 16, zero padded); FMA fp32 [M, Kp] (zero padded) or, for SQ, uint8 = int8 + 128 [M, Kp] (padded with 128).
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
  const int64_t esz = i8 ? 1 : (p.amx ? 2 : 4);
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
    } else {
      std::memcpy(reinterpret_cast<float*>(buf) + m * Kp, src, K * sizeof(float));
    }
  }
  return buf;
}

}  // namespace

bool amx_active() { return g_amx_allowed.load() && amx_supported(); }
void set_amx(bool on) { g_amx_allowed.store(on ? 1 : 0); }

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
#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AMX_INT8__)
  s += "+amx";
#endif
  return s + (amx_active() ? " (amx on)" : " (fma)");
}

}  // namespace dspark
