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

// Bytes of one packed 16-row weight block, and block blk (for software prefetch while the blocks before it are
// multiplied), nullptr past the end
inline int64_t block_bytes(const LinearPlan& p) { return p.Kp * 16 * (p.kind == P_F32 ? 4 : (p.kind == P_BF16 ? 2 : 1)); }
inline const char* next_block(const LinearPlan& p, int64_t blk) {
  return blk >= p.NB ? nullptr : static_cast<const char*>(p.w) + blk * block_bytes(p);
}

// A row group's share of the software prefetch of the blocks after the tile's (as many as the tile multiplies,
// `stride` bytes apart): group g of G touches bytes [g/G, (g+1)/G) of each, `step` = 64/G bytes per k step of one
// 64-byte line (a line per G steps, no branch), so they stream in under the compute of all the groups of this
// tile, not in a burst under the first. next = nullptr: no prefetch.
struct Prefetch {
  const char* next = nullptr;
  int64_t step = 64, stride = 0;
  inline void at(int b, int64_t line) const { _mm_prefetch(next + b * stride + line * step, _MM_HINT_T0); }
};

// ---------------------------------------------------------------------------------------------------- float kinds
// acc[b][h][m] (lanes = rows 8h.. of block blk0 + b) = Σ_k x[m0 + m, k] · w[row, k], k in order
template <int KIND, int MRT, int NBT>
inline void fma_sums(const LinearPlan& p, int64_t m0, int64_t blk0, __m256 (&out)[NBT][2][MRT], Prefetch pf = {}) {
  __m256 acc[NBT][2][MRT];  // local: the caller's array may alias the activations (float), which would force a
                            // store of every accumulator on every k step
  for (int b = 0; b < NBT; ++b)
    for (int h = 0; h < 2; ++h)
      for (int m = 0; m < MRT; ++m) acc[b][h][m] = _mm256_setzero_ps();
  const int64_t Kp = p.Kp, ldx = p.ldx;
  const float* xr = static_cast<const float*>(p.x) + m0 * ldx;
  // Loop order for 16 ymm registers: per k of a k-pair, a block's two weight vectors (both halves), then per row x
  // broadcast once and used for both halves: 2·MRT·NBT accumulators + 2·NBT weight + 1 x register (MRT ≤ 6 at
  // NBT = 1). Each accumulator still takes k, then k + 1 (the bits of the AVX-512 engine); ≥ 8 chains (MRT ≥ 4)
  // hide the FMA latency.
  if constexpr (KIND == P_BF16) {
    const int64_t kq = Kp / 2;
    const __m256i hi_mask = _mm256_set1_epi32(static_cast<int>(0xFFFF0000u));
    for (int64_t k2 = 0; k2 < kq; ++k2) {
      if (pf.next)
        for (int b = 0; b < NBT; ++b) pf.at(b, k2);  // line k2 of each next block
      for (int b = 0; b < NBT; ++b) {
        const uint16_t* wp = static_cast<const uint16_t*>(p.w) + ((blk0 + b) * kq + k2) * 32;
        for (int j = 0; j < 2; ++j) {  // k = 2·k2 + j: the low (j = 0) or high (j = 1) bf16 of each lane
          __m256 w[2];
          for (int h = 0; h < 2; ++h) {
            const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wp + 16 * h));
            w[h] = _mm256_castsi256_ps(j == 0 ? _mm256_slli_epi32(raw, 16) : _mm256_and_si256(raw, hi_mask));
          }
          for (int m = 0; m < MRT; ++m) {
            const __m256 xv = _mm256_broadcast_ss(xr + m * ldx + 2 * k2 + j);
            for (int h = 0; h < 2; ++h) acc[b][h][m] = _mm256_fmadd_ps(xv, w[h], acc[b][h][m]);
          }
        }
      }
    }
  } else {  // P_F32, P_I8F: [NB, K, 16]
    const int64_t line = KIND == P_F32 ? 64 : 16;  // bytes of one k of a block
    for (int64_t k = 0; k < Kp; ++k) {
      if (pf.next && (k * line) % 64 == 0)
        for (int b = 0; b < NBT; ++b) pf.at(b, k * line / 64);
      for (int b = 0; b < NBT; ++b) {
        __m256 wv[2];
        for (int h = 0; h < 2; ++h) {
          if constexpr (KIND == P_F32) {
            wv[h] = _mm256_loadu_ps(static_cast<const float*>(p.w) + ((blk0 + b) * Kp + k) * 16 + 8 * h);
          } else {
            wv[h] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(
                static_cast<const int8_t*>(p.w) + ((blk0 + b) * Kp + k) * 16 + 8 * h))));
          }
        }
        for (int m = 0; m < MRT; ++m) {
          const __m256 xv = _mm256_broadcast_ss(xr + m * ldx + k);
          for (int h = 0; h < 2; ++h) acc[b][h][m] = _mm256_fmadd_ps(xv, wv[h], acc[b][h][m]);
        }
      }
    }
  }
  std::memcpy(out, acc, sizeof(acc));
}

// ---------------------------------------------------------------------------------------------------- int8 kinds
constexpr int64_t SEG = 128;  // quads per int32 segment: |lane| ≤ 128 · 2 · 2^21 = 2^29, a row's pair sum ≤ 2^30

// exact Σ_k x[m0 + m, k] · w[row, k] per row of blocks blk0 + b, as double [b][quarter q: rows 4q..4q+3][m]
template <int MRT, int NBT>
inline void int_sums(const LinearPlan& p, int64_t m0, int64_t blk0, __m256d (&tot)[NBT][4][MRT], Prefetch pf = {}) {
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
      if (pf.next)
        for (int b = 0; b < NBT; ++b) pf.at(b, k4);  // line k4 of each next block
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

// raw sums → fp32 per row: I8Q fp32(s · Σ) (s a power of two: exact in double); SQ the exact integer rounded
template <int MRT, int NBT>
inline void int_values(const LinearPlan& p, int64_t m0, const __m256d (&tot)[NBT][4][MRT], int m, __m256 (&v)[NBT][2]) {
  const __m256d s = _mm256_set1_pd(p.kind == P_I8Q ? p.limb_scale[m0 + m] : 1.0);
  for (int b = 0; b < NBT; ++b)
    for (int h = 0; h < 2; ++h)
      v[b][h] = _mm256_set_m128(_mm256_cvtpd_ps(_mm256_mul_pd(tot[b][2 * h + 1][m], s)),
                                _mm256_cvtpd_ps(_mm256_mul_pd(tot[b][2 * h][m], s)));
}

// Rows m0 .. m0 + MRT − 1 × blocks blk0 .. blk0 + NBT − 1 → outputs. PAIR (SwiGLU, NBT = 1): blocks blk0 (up) and
// blk0 + 1 (fc) summed in two passes of one block each, then emitted together (fewer live registers).
template <int KIND, int MRT, int NBT, bool PAIR = false>
void tile(const LinearPlan& p, int64_t m0, int64_t blk0, int part = 0, int parts = 0) {
  auto pf = [&](int64_t blk) {  // blocks blk.. (as many as the pass multiplies), this group's share
    const char* nb = parts ? next_block(p, blk) : nullptr;
    if (!nb || next_block(p, blk + NBT - 1) == nullptr) return Prefetch{};
    const int64_t bytes = block_bytes(p);
    return Prefetch{nb + bytes * part / parts, 64 / parts, bytes};
  };
  constexpr int NB = PAIR ? 2 : NBT;
  if constexpr (KIND == P_SQ) {  // the int8 kinds (P_SQ stands for P_SQ and P_I8Q)
    __m256d tot[NB][4][MRT];
    if constexpr (PAIR) {
      int_sums<MRT, 1>(p, m0, blk0, reinterpret_cast<__m256d(&)[1][4][MRT]>(tot[0]));
      int_sums<MRT, 1>(p, m0, blk0 + 1, reinterpret_cast<__m256d(&)[1][4][MRT]>(tot[1]));
    } else {
      int_sums<MRT, NB>(p, m0, blk0, tot, pf(blk0 + NB));
    }
    for (int m = 0; m < MRT; ++m) {
      __m256 v[NB][2];
      int_values<MRT, NB>(p, m0, tot, m, v);
      emit_blocks<NB>(p, m0 + m, blk0, v);
    }
  } else {
    __m256 acc[NB][2][MRT];
    if constexpr (PAIR) {
      fma_sums<KIND, MRT, 1>(p, m0, blk0, reinterpret_cast<__m256(&)[1][2][MRT]>(acc[0]), pf(blk0 + 2));
      fma_sums<KIND, MRT, 1>(p, m0, blk0 + 1, reinterpret_cast<__m256(&)[1][2][MRT]>(acc[1]), pf(blk0 + 3));
    } else {
      fma_sums<KIND, MRT, NB>(p, m0, blk0, acc, pf(blk0 + NB));
    }
    for (int m = 0; m < MRT; ++m) {
      __m256 v[NB][2];
      for (int b = 0; b < NB; ++b)
        for (int h = 0; h < 2; ++h) v[b][h] = acc[b][h][m];
      emit_blocks<NB>(p, m0 + m, blk0, v);
    }
  }
}

// ---------------------------------------------------------------------------------------------------- many rows
// Int8 kinds with several rows (M > 1): one 4-row quarter of one weight block per pass, for up to 10 activation
// rows at once — one accumulator per row, so every weight vector widened serves all of them (the block's other
// quarters are read by the next passes, from L1).

// quarter q (rows 4q .. 4q + 3) of block blk, rows m0 .. m0 + R − 1: out[m] = the exact sums as 4 doubles
template <int R>
inline void quarter_pass(const LinearPlan& p, int64_t m0, int64_t blk, int q, __m256d* out, const char* pf) {
  __m256d tot[R];
  for (int m = 0; m < R; ++m) tot[m] = _mm256_setzero_pd();
  const int64_t kq = p.Kp / 4, ldx = p.ldx;
  const int16_t* xr = static_cast<const int16_t*>(p.x) + m0 * ldx;
  const int8_t* wp = static_cast<const int8_t*>(p.w) + blk * kq * 64 + 16 * q;
  for (int64_t s0 = 0; s0 < kq; s0 += SEG) {
    const int64_t s1 = std::min(kq, s0 + SEG);
    __m256i acc[R];  // lanes: row 4q + i, pair i·2 + j (as int_sums)
    for (int m = 0; m < R; ++m) acc[m] = _mm256_setzero_si256();
    for (int64_t k4 = s0; k4 < s1; ++k4) {
      if (pf) _mm_prefetch(pf + k4 * 64, _MM_HINT_T0);
      const __m256i w16 = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(wp + k4 * 64)));
      for (int m = 0; m < R; ++m) {
        int64_t quad;
        std::memcpy(&quad, xr + m * ldx + 4 * k4, 8);
        acc[m] = _mm256_add_epi32(acc[m], _mm256_madd_epi16(w16, _mm256_set1_epi64x(quad)));
      }
    }
    for (int m = 0; m < R; ++m) {  // [p0 p1 p2 p3 | p4 p5 p6 p7] → rows [p0+p1, p2+p3, p4+p5, p6+p7]
      const __m256i h = _mm256_permute4x64_epi64(_mm256_hadd_epi32(acc[m], acc[m]), 0x08);
      tot[m] = _mm256_add_pd(tot[m], _mm256_cvtepi32_pd(_mm256_castsi256_si128(h)));
    }
  }
  std::memcpy(out, tot, sizeof(tot));
}

// rows m0 .. m0 + R − 1 × block blk (SwiGLU: the pair blk, blk + 1) → outputs; pf: prefetch the next blocks
template <int R>
void many_rows(const LinearPlan& p, int64_t m0, int64_t blk, bool pf) {
  const int nb = p.swiglu ? 2 : 1;
  __m256 v[2][2][R];  // [block][half][row]
  for (int b = 0; b < nb; ++b) {
    __m256d tot[4][R];
    for (int q = 0; q < 4; ++q) quarter_pass<R>(p, m0, blk + b, q, tot[q], pf && q == 0 ? next_block(p, blk + b + nb) : nullptr);
    for (int m = 0; m < R; ++m) {
      const __m256d s = _mm256_set1_pd(p.kind == P_I8Q ? p.limb_scale[m0 + m] : 1.0);
      for (int h = 0; h < 2; ++h)
        v[b][h][m] = _mm256_set_m128(_mm256_cvtpd_ps(_mm256_mul_pd(tot[2 * h + 1][m], s)),
                                     _mm256_cvtpd_ps(_mm256_mul_pd(tot[2 * h][m], s)));
    }
  }
  for (int m = 0; m < R; ++m) {
    if (p.swiglu) {
      const __m256 vv[2][2] = {{v[0][0][m], v[0][1][m]}, {v[1][0][m], v[1][1][m]}};
      emit_blocks<2>(p, m0 + m, blk, vv);
    } else {
      const __m256 vv[1][2] = {{v[0][0][m], v[0][1][m]}};
      emit_blocks<1>(p, m0 + m, blk, vv);
    }
  }
}

// ---------------------------------------------------------------------------------------------------- tiling
// One row m: NB1 blocks per pass, both halves (the weights stream once, 2·NB1 FMA chains).
template <int KIND, int NB1>
void one_row(const LinearPlan& p, int64_t m, int64_t b0, int64_t b1) {
  int64_t blk = b0;
  for (; blk + NB1 <= b1; blk += NB1) tile<KIND, 1, NB1>(p, m, blk, 0, 1);  // prefetching the next NB1 blocks
  if constexpr (NB1 > 2) {
    for (; blk + 2 <= b1; blk += 2) tile<KIND, 1, 2>(p, m, blk, 0, 1);
  }
  if (blk < b1) tile<KIND, 1, 1>(p, m, blk);
}

// Several rows: for each weight block (a SwiGLU pair), every row group in turn while the block is in L1, so the
// weights stream from memory at an even rate under the compute instead of in bursts. Groups are sized evenly, at
// most MR rows (9 rows = 4 + 5 at MR = 6: a 1-row group has too few FMA chains to hide their latency).
template <int KIND, int MR, typename Fn>
void row_groups(const LinearPlan& p, int64_t b0, int64_t b1, Fn&& fn) {
  const int64_t groups = (p.M + MR - 1) / MR;
  for (int64_t blk = b0; blk < b1; blk += p.swiglu ? 2 : 1) {
    for (int64_t g = 0, m0 = 0; g < groups; ++g) {
      const int64_t mr = (p.M - m0) / (groups - g);  // even split: sizes differ by at most one
      fn(m0, mr, blk, static_cast<int>(g), static_cast<int>(groups));  // group g prefetches its share of the next block
      m0 += mr;
    }
  }
}

// Float kinds: groups of ≤ 6 rows × one block, both halves (≤ 12 FMA chains, two FMAs per broadcast). Groups of
// 2 or 3 rows take two blocks per pass (a SwiGLU pair at once, else the block and the next): 8 or 12 chains, where
// one block would give 4 or 6, too few to hide the FMA latency (7 rows = 3 + 4 ran at the speed of 8).
template <int KIND>
void float_blocks(const LinearPlan& p, int64_t b0, int64_t b1) {
  row_groups<KIND, 6>(p, b0, b1, [&](int64_t m0, int64_t mr, int64_t blk, int g, int groups) {
    auto run = [&](auto rows) {
      constexpr int R = decltype(rows)::value;
      if constexpr (R == 2 || R == 3) {
        if (p.swiglu) return tile<KIND, R, 2>(p, m0, blk, g, groups);  // emit_blocks<2>: the pair (up, fc)
      }
      if (p.swiglu) tile<KIND, R, 1, true>(p, m0, blk, g, groups); else tile<KIND, R, 1>(p, m0, blk, g, groups);
    };
    switch (mr) {
      case 1: return run(std::integral_constant<int, 1>());
      case 2: return run(std::integral_constant<int, 2>());
      case 3: return run(std::integral_constant<int, 3>());
      case 4: return run(std::integral_constant<int, 4>());
      case 5: return run(std::integral_constant<int, 5>());
      default: return run(std::integral_constant<int, 6>());
    }
  });
}

// Int8 kinds: groups of ≤ 10 rows × one block, through many_rows (one accumulator per row and quarter)
void int_blocks(const LinearPlan& p, int64_t b0, int64_t b1) {
  if (p.M == 1) return one_row<P_SQ, 2>(p, 0, b0, b1);
  row_groups<P_SQ, 10>(p, b0, b1, [&](int64_t m0, int64_t mr, int64_t blk, int g, int) {
    const bool pf = g == 0;  // the first group streams the block from memory: it prefetches the next one
    switch (mr) {
      case 1: return many_rows<1>(p, m0, blk, pf);
      case 2: return many_rows<2>(p, m0, blk, pf);
      case 3: return many_rows<3>(p, m0, blk, pf);
      case 4: return many_rows<4>(p, m0, blk, pf);
      case 5: return many_rows<5>(p, m0, blk, pf);
      case 6: return many_rows<6>(p, m0, blk, pf);
      case 7: return many_rows<7>(p, m0, blk, pf);
      case 8: return many_rows<8>(p, m0, blk, pf);
      case 9: return many_rows<9>(p, m0, blk, pf);
      default: return many_rows<10>(p, m0, blk, pf);
    }
  });
}

void run_blocks(const LinearPlan& p, int64_t b0, int64_t b1) {
  switch (p.kind) {
    case P_BF16: return p.M == 1 ? one_row<P_BF16, 4>(p, 0, b0, b1) : float_blocks<P_BF16>(p, b0, b1);
    case P_F32: return p.M == 1 ? one_row<P_F32, 4>(p, 0, b0, b1) : float_blocks<P_F32>(p, b0, b1);
    case P_I8F: return p.M == 1 ? one_row<P_I8F, 4>(p, 0, b0, b1) : float_blocks<P_I8F>(p, b0, b1);
    default: return int_blocks(p, b0, b1);  // P_SQ, P_I8Q: exact int8 products
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
  const bool in_place = !norm_weight.has_value() && !quads(p.kind) && !p.bf16 && p.Kp == p.K;  // fp32 rows as they are
  execute(p, x, in_place, [&] {
    return stage_input(x, p, norm_weight, static_cast<float>(eps), pre, static_cast<float>(sq_act), limb_scale.data());
  }, run_blocks);
  return out;
}

std::string build_info() { return "avx2+fma"; }

}  // namespace dspark
