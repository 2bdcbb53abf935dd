// Kernels compiled for AVX-512 (F, BW, VL, DQ); used only where the CPU has it (see runnable_isas in kernels_base.cpp).
#include <immintrin.h>

#include <cstdint>

#include "kernel_api.h"

namespace quantlib {
namespace cpu {
#if defined(__x86_64__) && defined(__GNUC__)
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx2,f16c,bmi,bmi2,popcnt,prefer-vector-width=512")
namespace avx512 {
#define QL_ISA_NAME "avx512"
#define QL_HAS_AVX512 1  // kernels_impl.h's intrinsic loops (fp8_lanes.h), which beat gcc's vectorization here too
#include "kernels_impl.h"
#undef QL_HAS_AVX512
}  // namespace avx512
#pragma GCC pop_options

const IsaKernels* isa_avx512() { return &avx512::kKernels; }
#else
const IsaKernels* isa_avx512() { return nullptr; }
#endif
}  // namespace cpu
}  // namespace quantlib
