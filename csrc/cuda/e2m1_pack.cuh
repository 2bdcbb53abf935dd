// E2M1 codes of eight elements packed into one 32-bit word, in a few integer / fp32 operations an
// element. Shared by the CUDA casts (fp4_cast.cuh) and the host check that runs every fp32 value
// through it (tests/test_kernels/e2m1_pack_check.cpp): what the test compiles with g++ is what runs.
//
// The rounding is docs/numerics.md's "E2M1 in the kernels": m = min(|y|, 6), p = 2^j the power of two
// of max(m, 1) (j = 0, 1, 2), s = RN(M + m) in one FMA with M = p 2^22 + (254 + 2j) p / 2, whose ulp
// p / 2 is the grid's step there. The (254 + 2j) steps added to p 2^22 (an even count: ties still go
// to the even code) make s's mantissa the code plus 254 (the steps above p 2^22 are the code's offset
// inside the binade, 2j the binade's), and cost one shift-add on p's bits. The eight codes are then
// summed at their nibbles (the sum is linear, so the 254s leave as one constant); for nibbles 3..7 the
// shift alone drops s's exponent, so no mask is needed. The signs of eight 16-bit inputs are gathered
// with four byte permutes (instead of a shift and a mask an element).
#pragma once

#include <stdint.h>

#include <cmath>
#include <cstring>

#ifdef __CUDACC__
#define QL_HD __host__ __device__ __forceinline__
#else
#define QL_HD inline
#endif

namespace quantlib {
namespace e2m1 {

QL_HD uint32_t bits(float f) {
#ifdef __CUDA_ARCH__
  return __float_as_uint(f);
#else
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
#endif
}

QL_HD float from_bits(uint32_t u) {
#ifdef __CUDA_ARCH__
  return __uint_as_float(u);
#else
  float f;
  std::memcpy(&f, &u, 4);
  return f;
#endif
}

QL_HD float fma_rn(float a, float b, float c) {
#ifdef __CUDA_ARCH__
  return __fmaf_rn(a, b, c);
#else
  return std::fma(a, b, c);
#endif
}

QL_HD float mul_rn(float a, float b) {
#ifdef __CUDA_ARCH__
  return __fmul_rn(a, b);
#else
  return a * b;  // the host check is built with -ffp-contract=off
#endif
}

// x / b for the E2M1 code of a bfloat16 x, y = RN(1 / b): q = RN(x * y) and one FMA correction (the
// general division takes two). Not always RN(x / b), but always on its E2M1 code: checked for every
// fp32 divisor mantissa against every bf16 x whose quotient is in [2^-4, 2^4) (the check's "div"
// mode); the power of two of b cancels, and quotients outside that range are code 0 or 7 either way.
// The sign of a zero is not kept (the codes take the sign from x).
QL_HD float quotient_bf16(float x, float b, float y) {
  const float q = mul_rn(x, y);
  return fma_rn(fma_rn(-q, b, x), y, q);
}

// s = RN(M + min(|y|, 6)) as fp32 bits, for y not NaN (the callers rule NaN out block by block).
QL_HD uint32_t point(float y) {
#ifdef __CUDA_ARCH__
  const float m = fminf(fabsf(y), 6.0f);
#else
  const float m = std::fmin(std::fabs(y), 6.0f);
#endif
  const uint32_t mb = bits(m);
  const uint32_t p = (mb > 0x3F800000u ? mb : 0x3F800000u) & 0x7F800000u;  // (127 + j) << 23
  const float a = from_bits(p + (p >> 22));  // p (1 + (254 + 2j) 2^-23): a 2^22 = M
  return bits(fma_rn(a, 4194304.0f, m));
}

// The magnitude code (0..7) of a point.
QL_HD uint32_t code(uint32_t s) { return (s & 0x7FFFFFu) - 254u; }

// Magnitude codes of eight points, point i in nibble i (bit 3 of every nibble 0).
QL_HD uint32_t nibbles(const uint32_t (&s)[8]) {
  uint32_t acc = (s[0] & 0x1FFu) + ((s[1] & 0x1FFu) << 4) + ((s[2] & 0x1FFu) << 8);
  acc += (s[3] << 12) + (s[4] << 16) + (s[5] << 20) + (s[6] << 24) + (s[7] << 28);  // exponents shifted out
  return acc - 254u * 0x11111111u;
}

QL_HD uint32_t byte_perm(uint32_t x, uint32_t y, uint32_t sel) {
#ifdef __CUDA_ARCH__
  return __byte_perm(x, y, sel);
#else
  const uint64_t v = (uint64_t(y) << 32) | x;
  uint32_t r = 0;
  for (int i = 0; i < 4; ++i) r |= uint32_t((v >> (8 * ((sel >> (4 * i)) & 7u))) & 0xFFu) << (8 * i);
  return r;
#endif
}

// The sign bits (bit 3 of nibble i) of eight 16-bit elements held two a word, element 2j in the low
// half of w[j]: their high bytes, even elements' and odd elements' apart, then one mask each.
QL_HD uint32_t signs16(uint32_t w0, uint32_t w1, uint32_t w2, uint32_t w3) {
  const uint32_t p01 = byte_perm(w0, w1, 0x7351u);  // high bytes of elements 0, 2, 1, 3
  const uint32_t p23 = byte_perm(w2, w3, 0x7351u);  // 4, 6, 5, 7
  const uint32_t even = byte_perm(p01, p23, 0x5410u), odd = byte_perm(p01, p23, 0x7632u);
  return ((even >> 4) & 0x08080808u) | (odd & 0x80808080u);
}

}  // namespace e2m1
}  // namespace quantlib
