// Interface between the tensor-level wrappers (ops.cpp) and the raw kernels (kernels_impl.h), which
// are compiled once per instruction set (kernels_base.cpp, kernels_avx2.cpp, kernels_avx512.cpp) and
// picked at run time. Plain C++: no torch headers, so the kernel translation units compile fast.
#pragma once

#include <cstdint>

namespace quantlib {
namespace cpu {

enum class DType : int { F32, BF16, F16 };

enum class Op : int {
  AMAX,         // block amax only
  INT,          // integer fake quant: scale Q / a
  FP8_E4M3,     // per tensor / channel / row FP8: s = Q / a'
  FP8_E5M2,
  FP8BLK_E4M3,  // FP8 blockwise: d = max(a, eps) / Q
  FP8BLK_E5M2,
  MX_E4M3,      // MX: E8M0 shared exponent
  MX_E2M1,
  MX_E3M2,
  MX_E2M3,
  MX_INT8,
  NVFP4,        // E2M1 elements, E4M3 block scale, fp32 global scale
};

enum class Mode : int {
  FAKE,       // write dequantize(quantize(x)) in x's dtype
  CODES,      // write codes (FP8 bytes, or E2M1 packed two per byte) and per-block scales; FP8_E4M3 /
              // FP8_E5M2: rows of K elements with the given scale_in (fp8_cast)
  AMAX_ONLY,  // write the per-block amax only
};

// Constants of one call.
struct Ctx {
  float lo = 0.f, hi = 0.f;   // INT code range
  float eps = 0.f;            // FP8 blockwise
  bool pow2 = false;          // FP8 blockwise
  bool floor = false;         // MX exponent rounding (false: rceil)
  float s2 = 1.f;             // NVFP4 global scale
  float six_s2 = 6.f;         // 6 * s2 (fp32)
};

// x (contiguous) viewed as [L, M, K] in blocks of BM x BK over (M, K); mb x kb blocks per [M, K]
// slice; blocks are numbered (l, i, j) row-major, the order of every per-block output. 1-D blocks
// along the last dim are BM = 1 with M = rows.
struct BlockTask {
  DType dtype = DType::F32;
  Op op = Op::AMAX;
  Mode mode = Mode::FAKE;
  Ctx ctx;
  const void* x = nullptr;
  int64_t L = 0, M = 0, K = 0, BM = 1, BK = 1, mb = 0, kb = 0;
  const float* amax_in = nullptr;  // static amax per block, or null: computed from the block
  bool nan_groups = false;         // with amax_in: a block holding NaN gets a NaN scale (INT)
  const float* s2_rows = nullptr;  // NVFP4 with 1-D blocks: a global scale per row (null: ctx.s2)
  const float* scale_in = nullptr; // FP8 per tensor / row codes (fp8_cast): each row's scale s = Q / a
  bool one_scale = false;          // scale_in holds one scale for every row
  void* out = nullptr;             // FAKE: like x
  uint8_t* codes = nullptr;        // CODES: FP8 codes [L, M, K], or E2M1 packed [L, M, (K + 1) / 2]
  float* amax_out = nullptr;       // per block, each optional
  float* scale_out = nullptr;
  uint8_t* byte_out = nullptr;
};

// Fake quant of a contiguous x whose groups come from a broadcast amax: the wrapper precomputes the
// per-group parameters p0, p1 (see formats.h) and calls `segment` on runs of the last dim.
struct BcastTask {
  DType dtype = DType::F32;
  Op op = Op::INT;
  Ctx ctx;
  const void* x = nullptr;
  void* out = nullptr;
  const float* p0 = nullptr;
  const float* p1 = nullptr;
};

struct IsaKernels {
  const char* name;
  // Blocks [b0, b1) of the task.
  void (*blocks)(const BlockTask& task, int64_t b0, int64_t b1);
  // Elements [off, off + n) of x; element k uses parameters at poff + k * pstride. Returns whether x
  // held a NaN there (so INT can make that group NaN).
  bool (*segment)(const BcastTask& task, int64_t off, int64_t n, int64_t poff, int64_t pstride);
};

const IsaKernels& isa_base();
const IsaKernels* isa_avx2();    // null where not compiled for
const IsaKernels* isa_avx512();

// The variants this build has and this CPU runs, widest first, null-terminated (decided once).
const IsaKernels* const* runnable_isas();

}  // namespace cpu
}  // namespace quantlib
