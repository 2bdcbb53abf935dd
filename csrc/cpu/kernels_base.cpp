// Kernels for the baseline instruction set of the build target, and the run-time choice among the
// compiled variants (kernels_avx2.cpp, kernels_avx512.cpp).
#include <cstdint>

#include "kernel_api.h"

namespace quantlib {
namespace cpu {
namespace base {
#define QL_ISA_NAME "base"
#include "kernels_impl.h"
}  // namespace base

const IsaKernels& isa_base() { return base::kKernels; }

const IsaKernels* const* runnable_isas() {
  static const IsaKernels* list[4] = {nullptr, nullptr, nullptr, nullptr};
  static const bool filled = [] {
    int n = 0;
#if defined(__x86_64__) && defined(__GNUC__)
    __builtin_cpu_init();
    if (isa_avx512() != nullptr && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
        __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq"))
      list[n++] = isa_avx512();
    if (isa_avx2() != nullptr && __builtin_cpu_supports("avx2")) list[n++] = isa_avx2();
#endif
    list[n] = &isa_base();
    return true;
  }();
  (void)filled;
  return list;
}

}  // namespace cpu
}  // namespace quantlib
