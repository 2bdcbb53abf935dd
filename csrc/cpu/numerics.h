// Scalar numerics of every format (DESIGN.md section 3), written to follow the torch reference in
// quantlib/formats operation by operation: IEEE fp32 multiply / divide in the reference's order, FP8
// and E2M1 rounding done on the fp32 bits with integer operations.
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
  float t = v < lo ? lo : v;
  return hi < t ? hi : t;
}

// torch.maximum(a, b): NaN if either is NaN.
QL_INLINE float maximumf(float a, float b) { return isnan_(a) ? a : (isnan_(b) ? b : (a < b ? b : a)); }

// torch.round: round half to even; sign kept (-0.3 -> -0.0); NaN/Inf/|v| >= 2^23 unchanged.
QL_INLINE float rne_int(float v) {
  const uint32_t u = f2u(v);
  const float m = u2f(u & kAbsMask);
  const float r = (m + 8388608.0f) - 8388608.0f;  // exact RNE for m < 2^23 (no fast-math here)
  return m < 8388608.0f ? u2f(f2u(r) | (u & kSignMask)) : v;
}

// Round-to-nearest-even shift of a 24-bit significand by k bits (1 <= k <= 31).
QL_INLINE uint32_t rne_shift(uint32_t m, int k) {
  return (m + (1u << (k - 1)) - 1u + ((m >> k) & 1u)) >> k;
}

// ---------------------------------------------------------------------------- FP8 (E4M3fn, E5M2)

// MBITS mantissa bits; MINF = fp32 biased exponent of the format's smallest normal; Q largest finite.
template <int MBITS, int MINF>
struct Fp8Format {
  static constexpr int kDrop = 23 - MBITS;
  static constexpr uint32_t kMinNormalBits = uint32_t(MINF) << 23;
  static constexpr uint32_t kQuantumBits = uint32_t(MINF - MBITS) << 23;  // subnormal step, 2^(MINF-127-MBITS)
  static constexpr uint32_t kCodeBias = uint32_t(MINF - 1) << MBITS;
};
using E4M3 = Fp8Format<3, 121>;  // min normal 2^-6, step 2^-9, Q = 448
using E5M2 = Fp8Format<2, 113>;  // min normal 2^-14, step 2^-16, Q = 57344

// Number of subnormal steps of |y| (abs bits a < min normal), rounded to nearest even.
template <class F>
QL_INLINE uint32_t fp8_subnormal_steps(uint32_t a) {
  const uint32_t e = a >> 23;
  const uint32_t m = (a & 0x007FFFFFu) | (e != 0 ? 0x00800000u : 0u);
  int k = F::kDrop + MINF_of<F>() - int(e != 0 ? e : 1);
  k = k < 1 ? 1 : (k > 31 ? 31 : k);
  return rne_shift(m, k);
}
