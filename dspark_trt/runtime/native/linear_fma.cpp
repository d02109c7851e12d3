// The AVX-512 FMA engine of the native products (the fallback where AMX is off or absent): the 16 output rows of a
// weight block in the vector lanes, activation rows broadcast; bf16 on VDPBF16PS where the CPU has it; int8 x int8
// kinds on VNNI dpbusd. Layouts, plan and epilogue: linear.h.
#include "linear.h"

namespace dspark {
namespace lin {
namespace {

// ---------------------------------------------------------------------------------------------------- FMA engine
// acc[b][m] (lanes = rows of weight block blk0 + b) = Σ_k x[m0 + m, k] · w[row, k], k in order (k-pairs: k, then
// k + 1). Staged activations: fp32 (bf16 models widened), or uint8 = int8 + 128 for SQ (VNNI dpbusd).
// Software prefetch of the NBT blocks after a one-row tile's (decode streams every weight once: the hardware
// prefetchers alone leave the int8 and bf16 kinds ~10-20% short of the bandwidth): `next` = the first of them or
// nullptr, `stride` = bytes of one block; line(i) touches line i of each.
struct NextBlocks {
  const char* next = nullptr;
  int64_t stride = 0;
  template <int NBT>
  inline void line(int64_t i) const {
    if (next)
      for (int b = 0; b < NBT; ++b) _mm_prefetch(next + b * stride + i * 64, _MM_HINT_T0);
  }
};

// blocks blk .. blk + n − 1 when they exist (one-row tiles prefetch them), else none
inline NextBlocks next_blocks(const LinearPlan& p, int64_t blk, int64_t n) {
  if (blk + n > p.NB) return {};
  const int64_t stride = p.Kp * 16 * (p.kind == P_F32 ? 4 : (p.kind == P_BF16 ? 2 : 1));
  return {static_cast<const char*>(p.w) + blk * stride, stride};
}

// The tile's outputs through the epilogue (linear.h): rows m0 .. m0 + MRT − 1 × blocks blk0 .. blk0 + NBT − 1
// (SwiGLU: NBT = 2 is one (up, fc) pair).
template <int MRT, int NBT>
inline void emit_tile(const LinearPlan& p, int64_t m0, int64_t blk0, const __m512 (&v)[NBT][MRT]) {
  for (int m = 0; m < MRT; ++m) {
    if (p.swiglu) {
      if constexpr (NBT == 2) emit_swiglu(p, m0 + m, blk0, v[0][m], v[1][m]);
    } else {
      for (int b = 0; b < NBT; ++b) emit(p, m0 + m, blk0 + b, v[b][m]);
    }
  }
}

#if defined(__AVX512BF16__)
// The bf16 kind on VDPBF16PS (linear.h): staged rows are bf16 pairs (k + 1, k); each weight pair is swapped to match
// (one rotate per block and k-pair), then one instruction per row and block: acc += x[k]·w[k], then x[k+1]·w[k+1].
// 2·MRT accumulators + NBT weights + one broadcast fit the 32 registers up to MRT = 14: verify of up to 12 tokens
// reads the weights once.
template <int MRT, int NBT>
inline void dp_tile(const LinearPlan& p, int64_t m0, int64_t blk0, NextBlocks pf = {}) {
  __m512 acc[NBT][MRT];
  for (int b = 0; b < NBT; ++b)
    for (int m = 0; m < MRT; ++m) acc[b][m] = _mm512_setzero_ps();
  const uint16_t* xr = static_cast<const uint16_t*>(p.x) + m0 * p.ldx;
  const int64_t kq = p.Kp / 2;
  for (int64_t k2 = 0; k2 < kq; ++k2) {
    pf.line<NBT>(k2);  // 64 bytes of a block per k-pair
    __m512i wv[NBT];
    for (int b = 0; b < NBT; ++b)
      wv[b] = _mm512_rol_epi32(_mm512_loadu_si512(static_cast<const uint16_t*>(p.w) + ((blk0 + b) * kq + k2) * 32), 16);
    for (int m = 0; m < MRT; ++m) {
      int32_t pair;
      std::memcpy(&pair, xr + m * p.ldx + 2 * k2, 4);
      const __m512bh xv = (__m512bh)_mm512_set1_epi32(pair);
      for (int b = 0; b < NBT; ++b) acc[b][m] = _mm512_dpbf16_ps(acc[b][m], xv, (__m512bh)wv[b]);
    }
  }
  emit_tile(p, m0, blk0, acc);
}

template <int NBT>
void dp_rows(const LinearPlan& p, int64_t m0, int64_t mr, int64_t blk) {
  switch (mr) {
    case 1: dp_tile<1, NBT>(p, m0, blk, p.M == 1 ? next_blocks(p, blk + NBT, NBT) : NextBlocks{}); break;
    case 2: dp_tile<2, NBT>(p, m0, blk); break;
    case 3: dp_tile<3, NBT>(p, m0, blk); break;
    case 4: dp_tile<4, NBT>(p, m0, blk); break;
    case 5: dp_tile<5, NBT>(p, m0, blk); break;
    case 6: dp_tile<6, NBT>(p, m0, blk); break;
    case 7: dp_tile<7, NBT>(p, m0, blk); break;
    case 8: dp_tile<8, NBT>(p, m0, blk); break;
    case 9: dp_tile<9, NBT>(p, m0, blk); break;
    case 10: dp_tile<10, NBT>(p, m0, blk); break;
    case 11: dp_tile<11, NBT>(p, m0, blk); break;
    default: dp_tile<12, NBT>(p, m0, blk); break;
  }
}

void dp_blocks(const LinearPlan& p, int64_t b0, int64_t b1) {
  constexpr int64_t MR = 12;
  for (int64_t blk = b0; blk < b1; blk += 2) {  // blocks outer: a pair streams in once, row tiles reread it from L1
    for (int64_t m0 = 0; m0 < p.M; m0 += MR) {
      const int64_t mr = std::min<int64_t>(MR, p.M - m0);
      if (blk + 1 < b1) dp_rows<2>(p, m0, mr, blk); else dp_rows<1>(p, m0, mr, blk);
    }
  }
}
#endif

template <int KIND, int MRT, int NBT>
inline void fma_tile(const LinearPlan& p, int64_t m0, int64_t blk0, NextBlocks pf = {}) {
  __m512 acc[NBT][MRT];
  for (int b = 0; b < NBT; ++b)
    for (int m = 0; m < MRT; ++m) acc[b][m] = _mm512_setzero_ps();
  const int64_t Kp = p.Kp;
  if constexpr (KIND == P_BF16 || KIND == P_I8P) {
    const float* xr = static_cast<const float*>(p.x) + m0 * p.ldx;
    const int64_t kq = Kp / 2;
    for (int64_t k2 = 0; k2 < kq; ++k2) {
      if constexpr (KIND == P_BF16) pf.line<NBT>(k2);  // 64 bytes of a block per k-pair
      else if (k2 % 2 == 0) pf.line<NBT>(k2 / 2);      // I8P: 32
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
      if constexpr (KIND == P_F32) pf.line<NBT>(k);  // 64 bytes of a block per k
      else if (k % 4 == 0) pf.line<NBT>(k / 4);      // I8F: 16
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
      pf.line<NBT>(k4);  // 64 bytes of a block per k-quad
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
  emit_tile(p, m0, blk0, acc);
}

#if defined(__AVX512VNNI__)
// I8Q on the FMA engine: staged rows 3m + j = limb j of activation row m, stored + 128 (uint8, dpbusd); exact int32
// sums, so the bits equal the AMX engine's.
template <int MRT, int NBT>
inline void fma_limb_tile(const LinearPlan& p, int64_t m0, int64_t blk0, NextBlocks pf = {}) {
  __m512i acc[NBT][MRT][LIMBS];
  for (int b = 0; b < NBT; ++b)
    for (int m = 0; m < MRT; ++m)
      for (int j = 0; j < LIMBS; ++j) acc[b][m][j] = _mm512_setzero_si512();
  const uint8_t* xr = static_cast<const uint8_t*>(p.x) + LIMBS * m0 * p.ldx;
  const int64_t kq = p.Kp / 4;
  for (int64_t k4 = 0; k4 < kq; ++k4) {
    pf.line<NBT>(k4);
    __m512i wv[NBT];
    for (int b = 0; b < NBT; ++b) wv[b] = _mm512_loadu_si512(static_cast<const int8_t*>(p.w) + ((blk0 + b) * kq + k4) * 64);
    for (int m = 0; m < MRT; ++m) {
      for (int j = 0; j < LIMBS; ++j) {
        int32_t quad;
        std::memcpy(&quad, xr + (LIMBS * m + j) * p.ldx + 4 * k4, 4);
        const __m512i xv = _mm512_set1_epi32(quad);
        for (int b = 0; b < NBT; ++b) acc[b][m][j] = _mm512_dpbusd_epi32(acc[b][m][j], xv, wv[b]);
      }
    }
  }
  __m512 v[NBT][MRT];
  for (int b = 0; b < NBT; ++b) {
    const __m512i corr = _mm512_slli_epi32(_mm512_loadu_si512(p.rowsum + (blk0 + b) * 16), 7);  // 128 · Σw
    for (int m = 0; m < MRT; ++m) {
      __m512i d[LIMBS];
      for (int j = 0; j < LIMBS; ++j) d[j] = _mm512_sub_epi32(acc[b][m][j], corr);
      v[b][m] = limb_sum(d, p.limb_scale[m0 + m]);
    }
  }
  emit_tile(p, m0, blk0, v);
}

void fma_limb_blocks(const LinearPlan& p, int64_t b0, int64_t b1) {
  constexpr int64_t MR = 2;
  for (int64_t blk = b0; blk < b1; blk += 2) {  // blocks outer: a pair streams in once, row tiles reread it from L1
    const bool pair = blk + 1 < b1;
    for (int64_t m0 = 0; m0 < p.M; m0 += MR) {
      const bool two = m0 + 1 < p.M;
      if (two && pair) fma_limb_tile<2, 2>(p, m0, blk);
      else if (two) fma_limb_tile<2, 1>(p, m0, blk);
      else if (pair) fma_limb_tile<1, 2>(p, m0, blk, p.M == 1 ? next_blocks(p, blk + 2, 2) : NextBlocks{});
      else fma_limb_tile<1, 1>(p, m0, blk);
    }
  }
}
#endif

template <int KIND, int NBT>
void fma_rows(const LinearPlan& p, int64_t m0, int64_t mr, int64_t blk) {
  switch (mr) {
    case 1: fma_tile<KIND, 1, NBT>(p, m0, blk, p.M == 1 ? next_blocks(p, blk + NBT, NBT) : NextBlocks{}); break;
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
  for (int64_t blk = b0; blk < b1; blk += 2) {  // blocks outer: a pair streams in once, row tiles reread it from L1
    for (int64_t m0 = 0; m0 < p.M; m0 += MR) {
      const int64_t mr = std::min<int64_t>(MR, p.M - m0);
      if (blk + 1 < b1) fma_rows<KIND, 2>(p, m0, mr, blk); else fma_rows<KIND, 1>(p, m0, mr, blk);
    }
  }
}

}  // namespace

#if defined(__AVX512BF16__)
// VDPBF16PS against the FMA chain it stands for (linear.h), once per process: 4,096 × 16 lanes of random normal bf16
// pairs (|·| in [2^-7, 2^8)) onto random accumulators (|·| in [2^-9, 2^13)), so products and sums round in every way;
// true when every lane equals fmaf(x_k, w_k, ·) then fmaf(x_{k+1}, w_{k+1}, ·) with the pair swapped as the kernel does.
bool dp_bf16_exact() {
  static const bool ok = [] {
    uint32_t s = 0x9E3779B9u;
    auto next = [&s] { s ^= s << 13; s ^= s >> 17; s ^= s << 5; return s; };
    auto bf = [](uint16_t h) { const uint32_t u = static_cast<uint32_t>(h) << 16; float f; std::memcpy(&f, &u, 4); return f; };
    for (int it = 0; it < 4096; ++it) {
      alignas(64) uint16_t x[32], w[32];
      alignas(64) float acc[16], got[16];
      for (int i = 0; i < 32; ++i) {
        x[i] = static_cast<uint16_t>(((next() & 1) << 15) | ((120 + next() % 16) << 7) | (next() & 127));
        w[i] = static_cast<uint16_t>(((next() & 1) << 15) | ((120 + next() % 16) << 7) | (next() & 127));
      }
      for (int j = 0; j < 16; ++j) {
        const uint32_t u = ((next() & 1) << 31) | ((118 + next() % 22) << 23) | (next() & 0x7FFFFF);
        std::memcpy(&acc[j], &u, 4);
      }
      // the kernel's operands: pairs (k + 1, k) in both, i.e. x[2j] = element k + 1, x[2j + 1] = element k
      const __m512 r = _mm512_dpbf16_ps(_mm512_load_ps(acc), (__m512bh)_mm512_load_si512(x), (__m512bh)_mm512_load_si512(w));
      _mm512_store_ps(got, r);
      for (int j = 0; j < 16; ++j) {
        const float want = std::fma(bf(x[2 * j]), bf(w[2 * j]), std::fma(bf(x[2 * j + 1]), bf(w[2 * j + 1]), acc[j]));
        if (std::memcmp(&want, &got[j], 4) != 0) return false;
      }
    }
    return true;
  }();
  return ok;
}
#else
bool dp_bf16_exact() { return false; }
#endif

void fma_blocks_any(const LinearPlan& p, int64_t b0, int64_t b1) {
  switch (p.kind) {
    case P_BF16:
#if defined(__AVX512BF16__)
      if (dp_bf16(p)) { dp_blocks(p, b0, b1); break; }
#endif
      fma_blocks<P_BF16>(p, b0, b1);
      break;
    case P_F32: fma_blocks<P_F32>(p, b0, b1); break;
    case P_I8P: fma_blocks<P_I8P>(p, b0, b1); break;
    case P_I8F: fma_blocks<P_I8F>(p, b0, b1); break;
#if defined(__AVX512VNNI__)
    case P_I8Q: fma_limb_blocks(p, b0, b1); break;
#endif
    default: fma_blocks<P_SQ>(p, b0, b1); break;
  }
}

}  // namespace lin
}  // namespace dspark
