// Scalar numerics of every format (docs/design.md §3), written to follow the torch reference in
// quantlib/formats operation by operation: IEEE fp32 multiply / divide in the reference's order, FP8
// and E2M1 rounding done on the fp32 bits with integer operations, E8M0 exponents from the bits.
//
// This header is included *inside* a namespace by each translation unit that needs it (one namespace
// per instruction set, see kernels_impl.h), so that the same inline code is compiled for each target
// without ODR clashes. It therefore includes nothing itself: <cstdint> must come first.

#define QL_INLINE inline __attribute__((always_inline))

QL_INLINE uint32_t f2u(float f) { return __builtin_bit_cast(uint32_t, f); }
QL_INLINE float u2f(uint32_t u) { return __builtin_bit_cast(float, u); }

constexpr uint32_t kAbsMask = 0x7FFFFFFFu;
constexpr uint32_t kSignMask = 0x80000000u;
constexpr uint32_t kInfBits = 0x7F800000u;
constexpr uint32_t kQuietNaN = 0x7FC00000u;
constexpr float kTinyAmax = 5.9604644775390625e-08f;  // 2^-24, formats.spec.TINY_AMAX

QL_INLINE bool isnan_(float v) { return v != v; }
QL_INLINE bool isfinite_(float v) { return (f2u(v) & kInfBits) != kInfBits; }

// torch.clamp(v, lo, hi) = min(max(v, lo), hi): NaN passes, -0.0 stays -0.0 at lo = 0.
QL_INLINE float clampf(float v, float lo, float hi) {
  const float t = v < lo ? lo : v;
  return hi < t ? hi : t;
}

// torch.maximum(a, b): NaN if either is NaN.
QL_INLINE float maximumf(float a, float b) { return isnan_(a) ? a : (isnan_(b) ? b : (a < b ? b : a)); }

// torch.round: round half to even, sign kept (-0.3 -> -0.0); NaN, Inf and |v| >= 2^23 unchanged.
QL_INLINE float rne_int(float v) {
  const uint32_t u = f2u(v);
  const float m = u2f(u & kAbsMask);
  const float r = (m + 8388608.0f) - 8388608.0f;  // exact RNE for m < 2^23 (no fast-math in this build)
  return m < 8388608.0f ? u2f(f2u(r) | (u & kSignMask)) : v;
}

// Round-to-nearest-even right shift of an integer significand m < 2^24 by k bits, 0 <= k <= 31
// (k = 0 gives garbage, never used: callers select another result there).
QL_INLINE uint32_t rne_shift(uint32_t m, uint32_t k) { return (m + ((1u << k) >> 1) - 1u + ((m >> k) & 1u)) >> k; }

// ------------------------------------------------------------------------------ fp16 / bf16 storage

QL_INLINE float bf16_to_float(uint16_t h) { return u2f(uint32_t(h) << 16); }

// Round to nearest even (torch's conversion); NaN becomes a quiet NaN of the same sign.
QL_INLINE uint16_t float_to_bf16(float f) {
  const uint32_t u = f2u(f);
  const uint32_t r = (u + 0x7FFFu + ((u >> 16) & 1u)) >> 16;
  return uint16_t(isnan_(f) ? ((u >> 16) | 0x0040u) : r);
}

QL_INLINE float half_to_float(uint16_t h) {
  const uint32_t sign = uint32_t(h & 0x8000u) << 16;
  const uint32_t em = h & 0x7FFFu;
  const uint32_t e = em >> 10;
  uint32_t bits = (em << 13) + (112u << 23);         // normal: rebias 15 -> 127
  bits = e == 31 ? bits + (112u << 23) : bits;       // Inf / NaN: exponent 255, payload kept
  const float sub = float(int32_t(em)) * 5.9604644775390625e-08f;  // subnormal: em * 2^-24, exact
  return u2f((e == 0 ? f2u(sub) : bits) | sign);
}

// Round to nearest even with overflow to Inf and fp16 subnormals (torch's conversion).
QL_INLINE uint16_t float_to_half(float f) {
  const uint32_t u = f2u(f), a = u & kAbsMask, sign = (u >> 16) & 0x8000u;
  const uint32_t normal = (a - (112u << 23) + 0x0FFFu + ((a >> 13) & 1u)) >> 13;
  // Subnormal: value m * 2^(e-150) in steps of 2^-24. An fp32 subnormal (e = 0) rounds to 0 anyway,
  // so its missing implicit bit does not matter; k saturates at 31 (also for e > 126, unused there).
  const uint32_t e = a >> 23;
  const uint32_t m = (a & 0x007FFFFFu) | 0x00800000u;
  const uint32_t k0 = 126u - e, k = k0 < 31u ? k0 : 31u;
  uint32_t r = a >= 0x38800000u ? normal : rne_shift(m, k);  // 2^-14: smallest fp16 normal
  r = a >= 0x477FF000u ? 0x7C00u : r;                         // 65520 rounds to Inf
  r = a > kInfBits ? 0x7E00u : r;
  return uint16_t(r | sign);
}

// ---------------------------------------------------------------------------- FP8 (E4M3fn, E5M2)

// MBITS mantissa bits; MINF = fp32 biased exponent of the format's smallest normal; Q largest finite.
template <int MBITS, int MINF, int Q>
struct Fp8Format {
  static constexpr int kDrop = 23 - MBITS;
  static constexpr int kMinf = MINF;
  static constexpr float kMax = float(Q);
  static constexpr uint32_t kMinNormalBits = uint32_t(MINF) << 23;
  static constexpr uint32_t kStepBits = uint32_t(MINF - MBITS) << 23;  // subnormal step 2^(MINF-127-MBITS)
  static constexpr uint32_t kCodeBias = uint32_t(MINF - 1) << MBITS;
};
using E4M3 = Fp8Format<3, 121, 448>;    // min normal 2^-6, step 2^-9
using E5M2 = Fp8Format<2, 113, 57344>;  // min normal 2^-14, step 2^-16

// Subnormal steps of |y| (abs bits a below the format's min normal), rounded to nearest even; the
// result 2^MBITS is the smallest normal, so it is also the right code. One fp32 addition does it:
// M = 2^(kDrop + kMinf - 127) has the subnormal step as its ulp and |y| < min normal < M, so |y| + M
// rounds |y| to a multiple of the step (RNE, exact IEEE: no fast-math in this build) and the bits above
// M's count the steps (an fp32 subnormal |y| adds exactly and rounds to 0, as it must). Two variable
// shifts and a select fewer per element than shifting the significand; every fp32 below the min normal
// gives the shift's result (tests/test_kernels/test_fp8_subnormal_steps.py). A normal |y|'s result is
// not used.
template <class F>
QL_INLINE uint32_t fp8_subnormal_steps(uint32_t a) {
  constexpr uint32_t kMagic = uint32_t(F::kDrop + F::kMinf) << 23;
  return f2u(u2f(a) + u2f(kMagic)) - kMagic;
}

// Abs bits of a normal |y| rounded to MBITS mantissa bits (RNE; a carry moves into the exponent).
template <class F>
QL_INLINE uint32_t fp8_normal_round(uint32_t a) {
  return a + ((1u << (F::kDrop - 1)) - 1u) + ((a >> F::kDrop) & 1u);
}

// The FP8 value of y (already clamped to [-Q, Q], or NaN) as fp32: equals float(y.to(fp8)).
template <class F>
QL_INLINE float fp8_round(float y) {
  const uint32_t u = f2u(y), a = u & kAbsMask;
  const uint32_t normal = fp8_normal_round<F>(a) & ~((1u << F::kDrop) - 1u);
  const uint32_t sub = f2u(float(int32_t(fp8_subnormal_steps<F>(a))) * u2f(F::kStepBits));
  const uint32_t r = (a >= F::kMinNormalBits ? normal : sub) | (u & kSignMask);
  return a > kInfBits ? y : u2f(r);
}

// The FP8 code of y (already clamped to [-Q, Q], or NaN): equals y.to(fp8).view(uint8) (NaN -> 0x7F|sign).
// Codes are returned in 32-bit lanes (narrowing only at the store keeps the loops at full width).
template <class F>
QL_INLINE uint32_t fp8_code(float y) {
  const uint32_t u = f2u(y), a = u & kAbsMask;
  const uint32_t normal = (fp8_normal_round<F>(a) >> F::kDrop) - F::kCodeBias;
  uint32_t c = a >= F::kMinNormalBits ? normal : fp8_subnormal_steps<F>(a);
  c = a > kInfBits ? 0x7Fu : c;
  return c | ((u >> 24) & 0x80u);
}

// ---------------------------------------------------------------------------- FP6 (E3M2, E2M3)

// MX-only element formats (formats.fp6), rounded by fp8_round / fp8_subnormal_steps on their own
// fields; E2M3's Q (7.5) is not an integer, hence plain structs rather than Fp8Format.
struct E3M2 {  // min normal 2^-2, step 2^-4, Q 28
  static constexpr int kDrop = 21, kMinf = 125;
  static constexpr float kMax = 28.0f;
  static constexpr uint32_t kMinNormalBits = 125u << 23, kStepBits = 123u << 23, kCodeBias = 124u << 2;
};
struct E2M3 {  // min normal 1, step 2^-3, Q 7.5
  static constexpr int kDrop = 20, kMinf = 127;
  static constexpr float kMax = 7.5f;
  static constexpr uint32_t kMinNormalBits = 127u << 23, kStepBits = 124u << 23, kCodeBias = 126u << 3;
};

// The 6-bit code of y (already clamped to [-Q, Q], or NaN): sign in bit 5; NaN -> 0 (formats.fp6).
template <class F>
QL_INLINE uint32_t fp6_code(float y) {
  const uint32_t u = f2u(y), a = u & kAbsMask;
  const uint32_t normal = (fp8_normal_round<F>(a) >> F::kDrop) - F::kCodeBias;
  const uint32_t c = (a >= F::kMinNormalBits ? normal : fp8_subnormal_steps<F>(a)) | ((u >> 26) & 0x20u);
  return isnan_(y) ? 0u : c;
}

// ---------------------------------------------------------------------------- E2M1

// Round-to-nearest-even on {0, 0.5, 1, 1.5, 2, 3, 4, 6}, saturating at 6 (formats.e2m1 thresholds:
// strict at midpoints whose lower neighbour has an even code, inclusive elsewhere). NaN -> +0.
QL_INLINE uint32_t e2m1_code(float y) {
  const uint32_t u = f2u(y);
  const float m = u2f(u & kAbsMask);
  const uint32_t idx = uint32_t(m > 0.25f) + uint32_t(m >= 0.75f) + uint32_t(m > 1.25f) + uint32_t(m >= 1.75f) +
                       uint32_t(m > 2.5f) + uint32_t(m >= 3.5f) + uint32_t(m > 5.0f);
  const uint32_t sign = isnan_(y) ? 0u : ((u >> 28) & 8u);
  return idx | sign;
}

// The fp32 value of e2m1_code(y) (the sign of zero included): the grid steps 0.5 x4, 1 x2, 2 summed
// over the thresholds passed (every partial sum is exact).
QL_INLINE float e2m1_value(float y) {
  const uint32_t u = f2u(y);
  const float m = u2f(u & kAbsMask);
  float v = (m > 0.25f ? 0.5f : 0.0f) + (m >= 0.75f ? 0.5f : 0.0f);
  v += (m > 1.25f ? 0.5f : 0.0f) + (m >= 1.75f ? 0.5f : 0.0f);
  v += (m > 2.5f ? 1.0f : 0.0f) + (m >= 3.5f ? 1.0f : 0.0f);
  v += m > 5.0f ? 2.0f : 0.0f;
  const uint32_t sign = isnan_(y) ? 0u : (u & kSignMask);
  return u2f(f2u(v) | sign);
}

// ---------------------------------------------------------------------------- E8M0 (MX)

constexpr uint8_t kE8M0NaN = 0xFF;

// Biased shared exponent of a block amax a (formats.e8m0.e8m0_encode): rceil from the bits of a / Q,
// floor from the bits of a minus emax; clamped to [-127, 127]; NaN/Inf -> 0xFF. Branch-free.
QL_INLINE uint8_t e8m0_byte(float a, float qmax, int emax, bool floor_rounding) {
  const uint32_t t = f2u(a / qmax);
  const int tf = int((t >> 23) & 0xFFu);
  const uint32_t tm = t & 0x007FFFFFu;
  int rceil = tm != 0 ? tf - 126 : tf - 127;
  rceil = tf == 0 ? (tm > (1u << 22) ? -126 : -127) : rceil;
  const int af = int((f2u(a) >> 23) & 0xFFu);
  int e = floor_rounding ? (af == 0 ? -127 : af - 127) - emax : rceil;
  e = e < -127 ? -127 : (e > 127 ? 127 : e);
  return isfinite_(a) ? uint8_t(e + 127) : kE8M0NaN;
}

// 2^(byte - 127) exactly (byte 0 is the subnormal 2^-127); NaN for 0xFF.
QL_INLINE float e8m0_to_float(uint8_t byte) {
  const uint32_t bits = byte == 0 ? 0x00400000u : (byte == kE8M0NaN ? kQuietNaN : uint32_t(byte) << 23);
  return u2f(bits);
}

// ---------------------------------------------------------------------------- FP8 blockwise pow2

// formats.fp8_blockwise.pow2_ceil, operation by operation (a subnormal d is scaled by 2^126 first).
QL_INLINE float pow2_ceil(float d) {
  const bool sub = d < 1.1754943508222875e-38f;  // 2^-126
  const float v = sub ? d * 8.507059173023462e+37f : d;  // * 2^126
  const uint32_t bits = f2u(v);
  const uint32_t exp = bits & kInfBits;
  const float up = u2f((bits & 0x007FFFFFu) != 0 ? exp + 0x00800000u : exp);
  float out = sub ? up * 1.1754943508222875e-38f : up;  // * 2^-126
  out = d == 0.0f ? 1.401298464324817e-45f : out;       // 2^-149
  return isfinite_(d) ? out : d;
}
