// Kernels compiled for AVX2; used only where the CPU has it (see runnable_isas in kernels_base.cpp).
#include <immintrin.h>

#include <cstdint>

#include "kernel_api.h"

namespace quantlib {
namespace cpu {
#if defined(__x86_64__) && defined(__GNUC__)
#pragma GCC push_options
#pragma GCC target("avx2,f16c,bmi,bmi2,popcnt")
namespace avx2 {
#define QL_ISA_NAME "avx2"
#define QL_HAS_AVX2 1  // kernels_impl.h's intrinsic loops
#include "kernels_impl.h"
#undef QL_HAS_AVX2
}  // namespace avx2
#pragma GCC pop_options

const IsaKernels* isa_avx2() { return &avx2::kKernels; }
#else
const IsaKernels* isa_avx2() { return nullptr; }
#endif
}  // namespace cpu
}  // namespace quantlib
