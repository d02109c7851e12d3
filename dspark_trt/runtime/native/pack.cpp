// Weight packing of the native products (ISA-neutral: every engine's build compiles it): a [N, K] weight re-laid out
// once into blocks of 16 output rows (layouts: linear.h), with per-row sums for the int8 x int8 kinds.
#include "plan.h"

namespace dspark {

using namespace lin;

std::vector<at::Tensor> pack_weight(const at::Tensor& w, int64_t kind, bool swiglu) {
  TORCH_CHECK(w.dim() == 2 && w.is_contiguous(), "pack_weight: contiguous [N, K]");
  TORCH_CHECK(known_kind(kind), "pack_weight: unknown kind");
  TORCH_CHECK(kInt8Products || !quads(static_cast<int>(kind)), "pack_weight: int8 x int8 products need AVX512_VNNI and AVX512DQ");
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

}  // namespace dspark
