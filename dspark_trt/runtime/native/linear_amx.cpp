// The AMX engine of the native products (the AVX-512 build, where the CPU and the kernel allow tiles): 16-row
// activation tiles, bf16 on TDPBF16PS, int8 x int8 (SmoothQuant, W8A16 limbs) on TDPBSSD, epilogues of one group
// overlapping the next group's tile steps; and the process-wide AMX switch (amx_active / set_amx). Layouts, plan and
// epilogue: linear.h; staging and linear(): linear.cpp.
#include <sys/syscall.h>
#include <unistd.h>

#include <atomic>

#include "linear.h"

namespace dspark {
namespace {

std::atomic<int> g_amx_allowed{1};

bool amx_supported() {
#if defined(DSPARK_AMX)
  static const bool ok = [] {
    constexpr long ARCH_REQ_XCOMP_PERM = 0x1023, XFEATURE_XTILEDATA = 18;
    return syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
  }();
  return ok;
#else
  return false;
#endif
}

}  // namespace

bool amx_active() { return g_amx_allowed.load() && amx_supported(); }
void set_amx(bool on) { g_amx_allowed.store(on ? 1 : 0); }

#if defined(DSPARK_AMX)
namespace lin {
namespace {

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

}  // namespace

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

}  // namespace lin
#endif

}  // namespace dspark
