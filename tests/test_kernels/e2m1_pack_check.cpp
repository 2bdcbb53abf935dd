// Host check of csrc/cuda/e2m1_pack.cuh (the E2M1 rounding and packing of the CUDA casts), compiled
// with g++ by tests/test_kernels/test_e2m1_pack_host.py:
//   every    every fp32 magnitude below 8 (and a stride above) against the thresholds of quantlib/formats/e2m1.py
//   pack N   N random words of eight bf16 elements: nibbles() | signs16() against one code at a time
//   div K    one-correction bf16 quotients (every K-th divisor mantissa) against RN(x / b), code by code
//   file IN OUT  codes (sign included, NaN -> 0) of the fp32 values in IN, one byte each, into OUT
// Prints "ok" or the first mismatches and exits 1.
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstdio>
#include <cstring>
#include <random>
#include <vector>

#include "e2m1_pack.cuh"

using namespace quantlib;

// quantlib/formats/e2m1.py: ties go to the even code (strict > where the lower neighbour is even).
static uint32_t reference_magnitude(float y) {
  const float m = std::fabs(y);
  return uint32_t(m > 0.25f) + uint32_t(m >= 0.75f) + uint32_t(m > 1.25f) + uint32_t(m >= 1.75f) + uint32_t(m > 2.5f) +
         uint32_t(m >= 3.5f) + uint32_t(m > 5.0f);
}

static uint32_t kernel_code(float y) {
  if (std::isnan(y)) return 0;
  return e2m1::code(e2m1::point(y)) | ((e2m1::bits(y) >> 28) & 8u);
}

// The code depends on |y| only; every magnitude below 8 (every rounding case and the saturation at 6),
// then every 127th bit pattern up to infinity.
static int every() {
  long long bad = 0;
  const long long below8 = 0x41000000LL;
  const long long steps = below8 + (0x7F800000LL - below8) / 127 + 1;
#pragma omp parallel for reduction(+ : bad) schedule(static)
  for (long long i = 0; i < steps; ++i) {
    const long long u = i < below8 ? i : below8 + (i - below8) * 127;
    const float y = e2m1::from_bits(uint32_t(u));
    if (e2m1::code(e2m1::point(y)) != reference_magnitude(y)) ++bad;
  }
  if (bad) {
    std::printf("%lld fp32 values round to another code\n", bad);
    return 1;
  }
  std::printf("ok\n");
  return 0;
}

static int pack(long n) {
  std::mt19937 gen(1234);
  long bad = 0;
  for (long t = 0; t < n; ++t) {
    uint32_t w[4], s[8], want = 0;
    for (int j = 0; j < 4; ++j) {
      w[j] = gen();
      if (t % 3 == 0) w[j] &= 0xC0FFC0FFu;  // small magnitudes: every code, not mostly saturated ones
    }
    for (int i = 0; i < 8; ++i) {
      const uint32_t half = (w[i / 2] >> (16 * (i % 2))) & 0xFFFFu;
      float y = e2m1::from_bits(half << 16);
      if (std::isnan(y)) y = 0.0f * (half >> 15 ? -1.0f : 1.0f);  // the kernels rule NaN out by block
      s[i] = e2m1::point(y);
      want |= (e2m1::code(s[i]) | ((half >> 12) & 8u)) << (4 * i);
    }
    const uint32_t got = e2m1::nibbles(s) | e2m1::signs16(w[0], w[1], w[2], w[3]);
    if (got != want && bad++ < 5) std::printf("words %08x %08x %08x %08x: %08x, want %08x\n", w[0], w[1], w[2], w[3], got, want);
  }
  if (bad) return 1;
  std::printf("ok\n");
  return 0;
}

// quotient_bf16's code against the code of RN(x / b) (a double quotient rounded to fp32: a quotient of
// fp32 values is never within 2^-49 of a midpoint, so that rounding is single), for divisor mantissas
// 0, k, 2k, ... (k = 1: all 2^23) and every bf16 x in [2^-3, 2^4), that is every quotient in
// [2^-4, 2^4), where the thresholds are.
static int quotients(long k) {
  long long bad = 0;
#pragma omp parallel for reduction(+ : bad) schedule(dynamic, 64)
  for (long long mb = 0; mb < (1LL << 23); mb += k) {
    const float b = e2m1::from_bits(0x3F800000u | uint32_t(mb));
    const float y = 1.0f / b;
    for (uint32_t h = 124u << 7; h < 131u << 7; ++h) {
      const float x = e2m1::from_bits(h << 16);
      const float exact = float(double(x) / double(b));
      if (e2m1::code(e2m1::point(e2m1::quotient_bf16(x, b, y))) != e2m1::code(e2m1::point(exact))) {
        if (bad++ < 5) std::printf("b %a x %a: quotient %a\n", b, x, exact);
      }
    }
  }
  if (bad) return 1;
  std::printf("ok\n");
  return 0;
}

static int file(const char* in, const char* out) {
  FILE* f = std::fopen(in, "rb");
  if (!f) return 2;
  std::vector<float> v;
  float y;
  while (std::fread(&y, 4, 1, f) == 1) v.push_back(y);
  std::fclose(f);
  std::vector<uint8_t> c(v.size());
  for (size_t i = 0; i < v.size(); ++i) c[i] = uint8_t(kernel_code(v[i]));
  f = std::fopen(out, "wb");
  if (!f) return 2;
  std::fwrite(c.data(), 1, c.size(), f);
  std::fclose(f);
  std::printf("ok\n");
  return 0;
}

int main(int argc, char** argv) {
  if (argc >= 2 && !std::strcmp(argv[1], "every")) return every();
  if (argc >= 3 && !std::strcmp(argv[1], "pack")) return pack(std::atol(argv[2]));
  if (argc >= 4 && !std::strcmp(argv[1], "file")) return file(argv[2], argv[3]);
  if (argc >= 3 && !std::strcmp(argv[1], "div")) return quotients(std::atol(argv[2]));
  std::fprintf(stderr, "usage: %s every | pack N | div K | file IN OUT\n", argv[0]);
  return 2;
}
