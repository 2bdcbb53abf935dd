// Host check of fp8_subnormal_steps (csrc/cpu/numerics.h), compiled with g++ by
// tests/test_kernels/test_fp8_subnormal_steps.py: for every fp32 magnitude below the smallest normal of
// E4M3, E5M2, E3M2 and E2M3 (every K-th with argument K, and all near both ends), the kernel's count of subnormal steps against
// |y| / step rounded to nearest even in double precision (exact: |y| and the step are powers-of-two
// multiples that double holds). Prints "ok" or the first mismatches and exits 1.
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>

namespace q {
#include "numerics.h"
}  // namespace q

// Patterns [begin, end) of |y|, every stride-th.
template <class F>
static long long check_range(const char* name, long long begin, long long end, long long stride) {
  const double step = std::ldexp(1.0, F::kMinf - 127 - (23 - F::kDrop));
  long long bad = 0;
#pragma omp parallel for reduction(+ : bad) schedule(static)
  for (long long a = begin; a < end; a += stride) {
    const float y = q::u2f(uint32_t(a));
    const uint32_t want = uint32_t(std::nearbyint(double(y) / step));
    const uint32_t got = q::fp8_subnormal_steps<F>(uint32_t(a));
    if (got != want) {
      if (bad < 4) std::printf("%s: |y| bits %08llx: %u steps, want %u\n", name, a, got, want);
      ++bad;
    }
  }
  return bad;
}

// Every stride-th pattern below the min normal, and every one of the 2^16 patterns at each end.
template <class F>
static long long check(const char* name, long long stride) {
  const long long end = F::kMinNormalBits;
  return check_range<F>(name, 0, end, stride) + check_range<F>(name, 0, 1 << 16, 1) + check_range<F>(name, end - (1 << 16), end, 1);
}

int main(int argc, char** argv) {
  const long long stride = argc > 1 ? std::atoll(argv[1]) : 1;
  long long bad = check<q::E4M3>("e4m3", stride) + check<q::E5M2>("e5m2", stride) + check<q::E3M2>("e3m2", stride) +
                  check<q::E2M3>("e2m3", stride);
  std::printf(bad ? "%lld mismatches\n" : "ok\n", bad);
  return bad ? 1 : 0;
}
