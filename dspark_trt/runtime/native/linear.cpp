// Row-invariant products of the dspark_trt native kernels: y = epilogue(x · wᵀ) for bf16, fp32, W8A16 (int8 weight,
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
// W8A16 on P_I8Q reads each int8 weight as it is, with no widening: each bf16 activation row x is written exactly as
// fixed point, x = s · v with s = 2^(e - 22) (2^e > max|x|) and v an integer (elements more than 2^15 below the row's
// maximum are rounded to the grid), and v as three signed base-256 digits (limbs, each in [-128, 127]). The three
// limb products with the int8 weights are exact int32 sums (TDPBSSD, or VNNI dpbusd on the FMA engine, which gives the
// same bits); y = fp32(s · (H·65536 + M·256 + L)) is the exact sum rounded once.
//
// Two engines, one per process (AMX when the CPU and kernel allow it): AMX tiles (bf16: TDPBF16PS, SQ: TDPBSSD) on
// 16-row activation tiles, or AVX-512 FMA with the 16 output rows in the vector lanes. In both, output (m, n) is one
// accumulation over k in a fixed order that involves only activation row m and weight row n — never other rows,
// the row count, the row's place in a tile or the thread split — so every row's bits are independent of its batch.
#include <sys/syscall.h>
#include <unistd.h>

#include <atomic>

#include "common.h"

namespace dspark {
namespace {

enum Pack { P_BF16 = 0, P_F32 = 1, P_I8P = 2, P_I8F = 3, P_SQ = 4, P_I8Q = 5 };
inline bool quads(int kind) { return kind == P_SQ || kind == P_I8Q; }  // int8 x int8 products on k-quads
inline int kgroup(int kind) { return quads(kind) ? 4 : (kind == P_BF16 || kind == P_I8P) ? 2 : 1; }
inline int64_t kalign(int kind) { return quads(kind) ? 64 : (kind == P_BF16 || kind == P_I8P) ? 32 : 1; }
constexpr int LIMB_ROWS = 5;  // P_I8Q on AMX: activation rows per 16-row tile (3 limb rows each, row 15 unused)

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

struct LinearPlan {
  int64_t M = 0, K = 0, N = 0, Kp = 0, NB = 0;
  int kind = P_BF16;
  bool swiglu = false, bf16 = true, out_f32 = false, amx = false;
  const void* x = nullptr;  // staged activations, ldx elements per row (see stage_input)
  int64_t ldx = 0;
  const void* w = nullptr;  // packed weight
  const float* scale = nullptr;
  const int32_t* rowsum = nullptr;  // SQ / I8Q on the FMA engine: Σ_k w[n, k] (activations are stored +128)
  const double* limb_scale = nullptr;  // I8Q: per activation row, s = 2^(e - 22)
  const void* bias = nullptr;
  bool bias_f32 = false;
  const void* res = nullptr;
  void* out = nullptr;
};

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
    _mm256_mask_storeu_epi16(static_cast<uint16_t*>(p.out) + m * ldo + col0, valid, f2b_x16(y));
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

// I8Q: the three limb sums (int32 lanes) of one activation row → fp32(s · (H·65536 + M·256 + L)), rounded once
inline __m512 limb_sum(__m512i lo, __m512i mid, __m512i hi, double s) {
  const __m512d sv = _mm512_set1_pd(s);
  auto half = [&](__m256i l, __m256i m, __m256i h) {
    const __m512i t = _mm512_add_epi64(_mm512_add_epi64(_mm512_slli_epi64(_mm512_cvtepi32_epi64(h), 16),
                                                        _mm512_slli_epi64(_mm512_cvtepi32_epi64(m), 8)),
                                       _mm512_cvtepi32_epi64(l));
    return _mm512_cvtpd_ps(_mm512_mul_pd(_mm512_cvtepi64_pd(t), sv));  // exact int64 → double, × 2^k, one rounding
  };
  const __m256 a = half(_mm512_castsi512_si256(lo), _mm512_castsi512_si256(mid), _mm512_castsi512_si256(hi));
  const __m256 b = half(_mm512_extracti64x4_epi64(lo, 1), _mm512_extracti64x4_epi64(mid, 1), _mm512_extracti64x4_epi64(hi, 1));
  return _mm512_insertf32x8(_mm512_castps256_ps512(a), b, 1);
}

// ---------------------------------------------------------------------------------------------------- AMX engine
#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AMX_INT8__)
struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// Blocks [b0, b1) (a multiple of 2 apart for SwiGLU), all 16-row activation tiles. Tiles 0-3 accumulate four
// weight blocks, tile 4 holds the activation chunk, tiles 5 / 6 the weight chunks.
void amx_blocks(const LinearPlan& p, int64_t b0, int64_t b1) {
  TileConfig cfg;
  for (int t = 0; t < 7; ++t) {
    cfg.rows[t] = 16;
    cfg.colsb[t] = 64;
  }
  _tile_loadconfig(&cfg);
  const bool sq = quads(p.kind), limbs = p.kind == P_I8Q;
  const int64_t chunk = sq ? 64 : 32;  // k per tile step
  const int64_t nchunks = p.Kp / chunk;
  const int64_t block_bytes = p.Kp * 16 * (sq ? 1 : 2);
  const int64_t xes = sq ? 1 : 2, ldx_b = p.ldx * xes;
  const int64_t per_tile = limbs ? LIMB_ROWS : 16;  // activation rows per tile
  const int64_t mtiles = (p.M + per_tile - 1) / per_tile;
  alignas(64) float cbuf[4][256];
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
      }
      _tile_stored(0, cbuf[0], 64);
      if (nq > 1) _tile_stored(1, cbuf[1], 64);
      if (nq > 2) _tile_stored(2, cbuf[2], 64);
      if (nq > 3) _tile_stored(3, cbuf[3], 64);
      const int64_t mr = std::min<int64_t>(per_tile, p.M - mt * per_tile);
      for (int64_t r = 0; r < mr; ++r) {
        const int64_t m = mt * per_tile + r;
        __m512 v[4];
        for (int j = 0; j < nq; ++j) {
          if (limbs) {
            const float* c = cbuf[j] + 3 * r * 16;
            v[j] = limb_sum(_mm512_load_si512(c), _mm512_load_si512(c + 16), _mm512_load_si512(c + 32), p.limb_scale[m]);
          } else {
            v[j] = _mm512_load_ps(cbuf[j] + r * 16);
            if (sq) v[j] = _mm512_cvtepi32_ps(_mm512_castps_si512(v[j]));
          }
        }
        if (p.swiglu) {
          for (int j = 0; j + 1 < nq; j += 2) emit_swiglu(p, m, nb + j, v[j], v[j + 1]);
        } else {
          for (int j = 0; j < nq; ++j) emit(p, m, nb + j, v[j]);
        }
      }
    }
  }
  _tile_release();
}
#endif

// ---------------------------------------------------------------------------------------------------- FMA engine
// acc[b][m] (lanes = rows of weight block blk0 + b) = Σ_k x[m0 + m, k] · w[row, k], k in order (k-pairs: k, then
// k + 1). Staged activations: fp32 (bf16 models widened), or uint8 = int8 + 128 for SQ (VNNI dpbusd).
template <int KIND, int MRT, int NBT>
inline void fma_tile(const LinearPlan& p, int64_t m0, int64_t blk0) {
  __m512 acc[NBT][MRT];
  for (int b = 0; b < NBT; ++b)
    for (int m = 0; m < MRT; ++m) acc[b][m] = _mm512_setzero_ps();
  const int64_t Kp = p.Kp;
  if constexpr (KIND == P_BF16 || KIND == P_I8P) {
    const float* xr = static_cast<const float*>(p.x) + m0 * p.ldx;
    const int64_t kq = Kp / 2;
    for (int64_t k2 = 0; k2 < kq; ++k2) {
      __m512 w0[NBT], w1[NBT];
      for (int b = 0; b < NBT; ++b) {
        if constexpr (KIND == P_BF16) {
          const __m512i raw = _mm512_loadu_si512(static_cast<const uint16_t*>(p.w) + ((blk0 + b) * kq + k2) * 32);
          w0[b] = _mm512_castsi512_ps(_mm512_slli_epi32(raw, 16));
          w1[b] = _mm512_castsi512_ps(_mm512_and_si512(raw, _mm512_set1_epi32(static_cast<int>(0xFFFF0000u))));
        } else {
          const __m512i raw = _mm512_cvtepi8_epi16(
              _mm256_loadu_si256((const __m256i*)(static_cast<const int8_t*>(p.w) + ((blk0 + b) * kq + k2) * 32)));
          w0[b] = _mm512_cvtepi32_ps(_mm512_srai_epi32(_mm512_slli_epi32(raw, 16), 16));
          w1[b] = _mm512_cvtepi32_ps(_mm512_srai_epi32(raw, 16));
        }
      }
      for (int m = 0; m < MRT; ++m) {
        const __m512 x0 = _mm512_set1_ps(xr[m * p.ldx + 2 * k2]), x1 = _mm512_set1_ps(xr[m * p.ldx + 2 * k2 + 1]);
        for (int b = 0; b < NBT; ++b) acc[b][m] = _mm512_fmadd_ps(x1, w1[b], _mm512_fmadd_ps(x0, w0[b], acc[b][m]));
      }
    }
  } else if constexpr (KIND == P_F32 || KIND == P_I8F) {
    const float* xr = static_cast<const float*>(p.x) + m0 * p.ldx;
    for (int64_t k = 0; k < Kp; ++k) {
      __m512 wv[NBT];
      for (int b = 0; b < NBT; ++b) {
        if constexpr (KIND == P_F32) {
          wv[b] = _mm512_loadu_ps(static_cast<const float*>(p.w) + ((blk0 + b) * Kp + k) * 16);
        } else {
          wv[b] = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(
              _mm_loadu_si128((const __m128i*)(static_cast<const int8_t*>(p.w) + ((blk0 + b) * Kp + k) * 16))));
        }
      }
      for (int m = 0; m < MRT; ++m) {
        const __m512 xv = _mm512_set1_ps(xr[m * p.ldx + k]);
        for (int b = 0; b < NBT; ++b) acc[b][m] = _mm512_fmadd_ps(xv, wv[b], acc[b][m]);
      }
    }
  } else {
#if defined(__AVX512VNNI__)
    const uint8_t* xr = static_cast<const uint8_t*>(p.x) + m0 * p.ldx;
    const int64_t kq = Kp / 4;
    __m512i iacc[NBT][MRT];
    for (int b = 0; b < NBT; ++b)
      for (int m = 0; m < MRT; ++m) iacc[b][m] = _mm512_setzero_si512();
    for (int64_t k4 = 0; k4 < kq; ++k4) {
      __m512i wv[NBT];
      for (int b = 0; b < NBT; ++b) wv[b] = _mm512_loadu_si512(static_cast<const int8_t*>(p.w) + ((blk0 + b) * kq + k4) * 64);
      for (int m = 0; m < MRT; ++m) {
        int32_t quad;
        std::memcpy(&quad, xr + m * p.ldx + 4 * k4, 4);
        const __m512i xv = _mm512_set1_epi32(quad);
        for (int b = 0; b < NBT; ++b) iacc[b][m] = _mm512_dpbusd_epi32(iacc[b][m], xv, wv[b]);
      }
    }
    for (int b = 0; b < NBT; ++b) {
      const __m512i corr = _mm512_slli_epi32(_mm512_loadu_si512(p.rowsum + (blk0 + b) * 16), 7);  // 128 · Σw
      for (int m = 0; m < MRT; ++m) acc[b][m] = _mm512_cvtepi32_ps(_mm512_sub_epi32(iacc[b][m], corr));
    }
#endif
  }
  for (int m = 0; m < MRT; ++m) {
    if (p.swiglu) {
      if constexpr (NBT == 2) emit_swiglu(p, m0 + m, blk0, acc[0][m], acc[1][m]);
    } else {
      for (int b = 0; b < NBT; ++b) emit(p, m0 + m, blk0 + b, acc[b][m]);
    }
  }
}

#if defined(__AVX512VNNI__)
// I8Q on the FMA engine: staged rows 3m + j = limb j of activation row m, stored + 128 (uint8, dpbusd); exact int32
// sums, so the bits equal the AMX engine's.
template <int MRT, int NBT>
inline void fma_limb_tile(const LinearPlan& p, int64_t m0, int64_t blk0) {
  __m512i acc[NBT][MRT][3];
  for (int b = 0; b < NBT; ++b)
    for (int m = 0; m < MRT; ++m)
      for (int j = 0; j < 3; ++j) acc[b][m][j] = _mm512_setzero_si512();
  const uint8_t* xr = static_cast<const uint8_t*>(p.x) + 3 * m0 * p.ldx;
  const int64_t kq = p.Kp / 4;
  for (int64_t k4 = 0; k4 < kq; ++k4) {
    __m512i wv[NBT];
    for (int b = 0; b < NBT; ++b) wv[b] = _mm512_loadu_si512(static_cast<const int8_t*>(p.w) + ((blk0 + b) * kq + k4) * 64);
    for (int m = 0; m < MRT; ++m) {
      for (int j = 0; j < 3; ++j) {
        int32_t quad;
        std::memcpy(&quad, xr + (3 * m + j) * p.ldx + 4 * k4, 4);
        const __m512i xv = _mm512_set1_epi32(quad);
        for (int b = 0; b < NBT; ++b) acc[b][m][j] = _mm512_dpbusd_epi32(acc[b][m][j], xv, wv[b]);
      }
    }
  }
  __m512 v[NBT][MRT];
  for (int b = 0; b < NBT; ++b) {
    const __m512i corr = _mm512_slli_epi32(_mm512_loadu_si512(p.rowsum + (blk0 + b) * 16), 7);  // 128 · Σw
    for (int m = 0; m < MRT; ++m) {
      v[b][m] = limb_sum(_mm512_sub_epi32(acc[b][m][0], corr), _mm512_sub_epi32(acc[b][m][1], corr),
                         _mm512_sub_epi32(acc[b][m][2], corr), p.limb_scale[m0 + m]);
    }
  }
  for (int m = 0; m < MRT; ++m) {
    if (p.swiglu) {
      if constexpr (NBT == 2) emit_swiglu(p, m0 + m, blk0, v[0][m], v[1][m]);
    } else {
      for (int b = 0; b < NBT; ++b) emit(p, m0 + m, blk0 + b, v[b][m]);
    }
  }
}

void fma_limb_blocks(const LinearPlan& p, int64_t b0, int64_t b1) {
  constexpr int64_t MR = 2;
  for (int64_t m0 = 0; m0 < p.M; m0 += MR) {
    const bool two = m0 + 1 < p.M;
    for (int64_t blk = b0; blk < b1; blk += 2) {
      const bool pair = blk + 1 < b1;
      if (two && pair) fma_limb_tile<2, 2>(p, m0, blk);
      else if (two) fma_limb_tile<2, 1>(p, m0, blk);
      else if (pair) fma_limb_tile<1, 2>(p, m0, blk);
      else fma_limb_tile<1, 1>(p, m0, blk);
    }
  }
}
#endif

template <int KIND, int NBT>
void fma_rows(const LinearPlan& p, int64_t m0, int64_t mr, int64_t blk) {
  switch (mr) {
    case 1: fma_tile<KIND, 1, NBT>(p, m0, blk); break;
    case 2: fma_tile<KIND, 2, NBT>(p, m0, blk); break;
    case 3: fma_tile<KIND, 3, NBT>(p, m0, blk); break;
    case 4: fma_tile<KIND, 4, NBT>(p, m0, blk); break;
    case 5: fma_tile<KIND, 5, NBT>(p, m0, blk); break;
    default: fma_tile<KIND, 6, NBT>(p, m0, blk); break;
  }
}

template <int KIND>
void fma_blocks(const LinearPlan& p, int64_t b0, int64_t b1) {
  constexpr int64_t MR = 6;
  for (int64_t m0 = 0; m0 < p.M; m0 += MR) {
    const int64_t mr = std::min<int64_t>(MR, p.M - m0);
    for (int64_t blk = b0; blk < b1; blk += 2) {
      if (blk + 1 < b1) fma_rows<KIND, 2>(p, m0, mr, blk); else fma_rows<KIND, 1>(p, m0, mr, blk);
    }
  }
}

void run_blocks(const LinearPlan& p, int64_t b0, int64_t b1) {
#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AMX_INT8__)
  if (p.amx) return amx_blocks(p, b0, b1);
#endif
  switch (p.kind) {
    case P_BF16: fma_blocks<P_BF16>(p, b0, b1); break;
    case P_F32: fma_blocks<P_F32>(p, b0, b1); break;
    case P_I8P: fma_blocks<P_I8P>(p, b0, b1); break;
    case P_I8F: fma_blocks<P_I8F>(p, b0, b1); break;
#if defined(__AVX512VNNI__)
    case P_I8Q: fma_limb_blocks(p, b0, b1); break;
#endif
    default: fma_blocks<P_SQ>(p, b0, b1); break;
  }
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
  const float r = 1.0f / std::sqrt(_mm512_reduce_add_ps(ss) / static_cast<float>(K) + eps);
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

// I8Q: row src [K] (bf16 values) → three limb rows of int8 (+ bias: 128 for the FMA engine's uint8), returns s.
double stage_limbs(const float* src, int64_t K, int8_t* lo, int8_t* mid, int8_t* hi, int bias) {
  __m512 amax = _mm512_setzero_ps();
  for (int64_t k = 0; k < K; k += 16) amax = _mm512_max_ps(amax, _mm512_abs_ps(_mm512_maskz_loadu_ps(tail16(K - k), src + k)));
  const float mx = _mm512_reduce_max_ps(amax);
  int e = 0;
  if (mx > 0.0f && std::isfinite(mx)) std::frexp(mx, &e);  // mx < 2^e
  const __m512 shift = _mm512_set1_ps(static_cast<float>(22 - e));
  const __m512i c128 = _mm512_set1_epi32(128), c255 = _mm512_set1_epi32(255), cb = _mm512_set1_epi32(bias);
  for (int64_t k = 0; k < K; k += 16) {
    const __mmask16 mk = tail16(K - k);
    // v = round(x · 2^(22 - e)), |v| < 2^22; exact for elements within 2^15 of the row maximum
    const __m512 f = _mm512_roundscale_ps(_mm512_scalef_ps(_mm512_maskz_loadu_ps(mk, src + k), shift),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m512i v = _mm512_cvtps_epi32(f);
    const __m512i l = _mm512_sub_epi32(_mm512_and_si512(_mm512_add_epi32(v, c128), c255), c128);  // balanced digits
    const __m512i v1 = _mm512_srai_epi32(_mm512_sub_epi32(v, l), 8);
    const __m512i m = _mm512_sub_epi32(_mm512_and_si512(_mm512_add_epi32(v1, c128), c255), c128);
    const __m512i h = _mm512_srai_epi32(_mm512_sub_epi32(v1, m), 8);  // |h| ≤ 65
    _mm_mask_storeu_epi8(lo + k, mk, _mm512_cvtepi32_epi8(_mm512_add_epi32(l, cb)));
    _mm_mask_storeu_epi8(mid + k, mk, _mm512_cvtepi32_epi8(_mm512_add_epi32(m, cb)));
    _mm_mask_storeu_epi8(hi + k, mk, _mm512_cvtepi32_epi8(_mm512_add_epi32(h, cb)));
  }
  return std::ldexp(1.0, e - 22);
}

// Stage x (optionally RMSNorm'd, SQ-quantized) into the engine's layout: AMX bf16 / int8 [Mp, Kp] (Mp = M rounded
// up to 16, zero padded); FMA fp32 [M, Kp] (zero padded) or, for SQ, uint8 = int8 + 128 [M, Kp] (padded with 128).
// I8Q: three limb rows per activation row, on AMX LIMB_ROWS rows per 16-row tile (rows 16t + 3i + j), on the FMA
// engine rows 3m + j, + 128; limb_scale[m] = s.
at::Tensor stage_input(const at::Tensor& x, const LinearPlan& p, const c10::optional<at::Tensor>& norm, float eps,
                       const float* sq_pre, float sq_act, double* limb_scale) {
  const int64_t M = p.M, K = p.K, Kp = p.Kp;
  const bool sq = p.kind == P_SQ, limbs = p.kind == P_I8Q, i8 = sq || limbs;
  const int64_t rows = limbs ? (p.amx ? (M + LIMB_ROWS - 1) / LIMB_ROWS * 16 : 3 * M)
                             : (p.amx ? (M + 15) / 16 * 16 : M);
  at::ScalarType st = i8 ? (p.amx ? at::kChar : at::kByte) : (p.amx ? at::kBFloat16 : at::kFloat);
  at::Tensor buf = (i8 && !p.amx) ? at::full({rows, Kp}, 128, x.options().dtype(st)) : at::zeros({rows, Kp}, x.options().dtype(st));
  std::vector<float> h(K);
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
      int8_t* base = static_cast<int8_t*>(buf.data_ptr());
      const int64_t r0 = p.amx ? (m / LIMB_ROWS) * 16 + 3 * (m % LIMB_ROWS) : 3 * m;
      limb_scale[m] = stage_limbs(src, K, base + r0 * Kp, base + (r0 + 1) * Kp, base + (r0 + 2) * Kp, p.amx ? 0 : 128);
    } else if (sq) {  // torch's op order: round(x · pre / a), clamp to [-128, 127]
      const __m512 av = _mm512_set1_ps(sq_act);
      for (int64_t k = 0; k < K; k += 16) {
        const __mmask16 mk = tail16(K - k);
        __m512 v = _mm512_div_ps(_mm512_mul_ps(_mm512_maskz_loadu_ps(mk, src + k), _mm512_maskz_loadu_ps(mk, sq_pre + k)), av);
        v = _mm512_roundscale_ps(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
        v = _mm512_min_ps(_mm512_max_ps(v, _mm512_set1_ps(-128.0f)), _mm512_set1_ps(127.0f));
        __m512i i = _mm512_cvtps_epi32(v);
        if (!p.amx) i = _mm512_add_epi32(i, _mm512_set1_epi32(128));
        _mm_mask_storeu_epi8(static_cast<int8_t*>(buf.data_ptr()) + m * Kp + k, mk, _mm512_cvtepi32_epi8(i));
      }
    } else if (p.amx) {
      for (int64_t k = 0; k < K; k += 16) {
        const __mmask16 mk = tail16(K - k);
        _mm256_mask_storeu_epi16(static_cast<uint16_t*>(buf.data_ptr()) + m * Kp + k, mk, f2b_x16(_mm512_maskz_loadu_ps(mk, src + k)));
      }
    } else {
      std::memcpy(static_cast<float*>(buf.data_ptr()) + m * Kp, src, K * sizeof(float));
    }
  }
  return buf;
}

}  // namespace

bool amx_active() { return g_amx_allowed.load() && amx_supported(); }
void set_amx(bool on) { g_amx_allowed.store(on ? 1 : 0); }

std::vector<at::Tensor> pack_weight(const at::Tensor& w, int64_t kind, bool swiglu) {
  TORCH_CHECK(w.dim() == 2 && w.is_contiguous(), "pack_weight: contiguous [N, K]");
  TORCH_CHECK(kind >= P_BF16 && kind <= P_I8Q, "pack_weight: unknown kind");
#if !defined(__AVX512VNNI__) || !defined(__AVX512DQ__)
  TORCH_CHECK(!quads(static_cast<int>(kind)), "pack_weight: int8 x int8 products need AVX512_VNNI and AVX512DQ");
#endif
  const int64_t N = w.size(0), K = w.size(1), g = kgroup(static_cast<int>(kind)), al = kalign(static_cast<int>(kind));
  const int64_t Kp = (K + al - 1) / al * al, half = N / 2;
  TORCH_CHECK(!swiglu || N % 2 == 0, "pack_weight: SwiGLU needs an even row count");
  const int64_t NB = swiglu ? 2 * ((half + 15) / 16) : (N + 15) / 16;
  at::Tensor out = at::zeros({NB, Kp / g, 16, g}, w.options());
  at::Tensor rowsum = at::zeros({NB * 16}, w.options().dtype(at::kInt));
  const int64_t es = w.element_size();
  const char* src = static_cast<const char*>(w.data_ptr());
  char* dst = static_cast<char*>(out.data_ptr());
  at::parallel_for(0, NB, 1, [&](int64_t b0, int64_t b1) {
    for (int64_t blk = b0; blk < b1; ++blk) {
      const int64_t r0 = swiglu ? (blk / 2) * 16 + (blk % 2 ? half : 0) : blk * 16;
      const int64_t lim = swiglu ? (blk % 2 ? N : half) : N;
      for (int64_t i = 0; i < 16 && r0 + i < lim; ++i) {
        const int64_t row = r0 + i;
        int32_t sum = 0;
        for (int64_t k = 0; k < K; ++k) {
          std::memcpy(dst + (((blk * (Kp / g) + k / g) * 16 + i) * g + k % g) * es, src + (row * K + k) * es, es);
          if (quads(static_cast<int>(kind))) sum += static_cast<const int8_t*>(w.data_ptr())[row * K + k];
        }
        rowsum.data_ptr<int32_t>()[blk * 16 + i] = sum;
      }
    }
  });
  return {out, rowsum};
}

at::Tensor linear(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& rowsum, int64_t kind, int64_t N,
                  bool swiglu, const c10::optional<at::Tensor>& scale, const c10::optional<at::Tensor>& bias,
                  bool bias_f32, const c10::optional<at::Tensor>& residual, const c10::optional<at::Tensor>& norm_weight,
                  double eps, const c10::optional<at::Tensor>& sq_pre, double sq_act, bool out_f32) {
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1, "linear: x [M, K] with contiguous rows");
  const bool is_bf16 = x.scalar_type() == at::kBFloat16;
  TORCH_CHECK(is_bf16 || x.scalar_type() == at::kFloat, "linear: bf16 or fp32 activations");
  const bool pair = kind == P_BF16 || kind == P_I8P;
  TORCH_CHECK(kind == P_SQ || (kind == P_I8Q ? is_bf16 : pair == is_bf16), "linear: packing does not match the activation dtype");
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
  TORCH_CHECK(p.Kp >= p.K && p.Kp - p.K < kalign(p.kind), "linear: packed K does not match x");
  p.amx = (pair || quads(p.kind)) && amx_active();
  const int64_t nout = swiglu ? N / 2 : N;
  if (norm_weight.has_value()) {
    TORCH_CHECK(norm_weight->scalar_type() == x.scalar_type() && norm_weight->numel() == p.K &&
                norm_weight->is_contiguous(), "linear: norm weight [K] in x's dtype");
  }
  const float* pre = nullptr;
  if (kind == P_SQ) {
    TORCH_CHECK(sq_pre.has_value() && sq_pre->scalar_type() == at::kFloat && sq_pre->numel() == p.K, "linear: sq_pre");
    pre = sq_pre->data_ptr<float>();
    p.rowsum = rowsum.data_ptr<int32_t>();
  }
  if (kind == P_I8Q) p.rowsum = rowsum.data_ptr<int32_t>();
  std::vector<double> limb_scale(kind == P_I8Q ? p.M : 0);
  p.limb_scale = limb_scale.data();
  at::Tensor staged;
  if (!norm_weight.has_value() && kind != P_SQ && !is_bf16 && p.Kp == p.K) {
    p.x = x.data_ptr();  // fp32 rows used in place
    p.ldx = x.stride(0);
  } else {
    staged = stage_input(x, p, norm_weight, static_cast<float>(eps), pre, static_cast<float>(sq_act), limb_scale.data());
    p.x = staged.data_ptr();
    p.ldx = p.Kp;
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
  const int64_t per_task = 4;  // weight blocks per task (even: SwiGLU keeps (up, fc) pairs together)
  const int64_t ntasks = (p.NB + per_task - 1) / per_task;
  const int64_t work = p.M * p.NB * 16 * p.Kp;
  const int64_t grain = work < (1 << 17) ? ntasks : 1;  // tiny products run inline (no fork)
  at::parallel_for(0, ntasks, grain, [&](int64_t t0, int64_t t1) {
    run_blocks(p, t0 * per_task, std::min(p.NB, t1 * per_task));
  });
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
