// Per-format kernels of one group (tensor, channel, row or block): `block(a)` turns the group amax into
// its parameters and stored scale, `fake(x, p0, p1)` / `code(x, p0, p1)` treat one element. Each follows
// the torch reference's operations in order (see the matching quantlib/formats module).
//
// Included inside a namespace after numerics.h and kernel_api.h (see numerics.h).

struct BlockParams {
  float p0 = 0.f, p1 = 0.f;  // what the element functions take
  float scale = 0.f;         // stored fp32 scale (FP8 blockwise d)
  uint8_t byte = 0;          // stored byte scale (E8M0 exponent, NVFP4 E4M3 block scale)
};

enum class Codes { NONE, FP8, E2M1 };

// formats.int: scale = Q / a; q = clamp(round(x * scale), min, Q), 0 where a <= 2^-24 or q is NaN;
// x_hat = q / scale, q being an integer code (so -0.0 is +0). p0 = scale, p1 = 1 for an all-zero group.
struct IntOp {
  static constexpr Codes kCodes = Codes::NONE;
  float lo, hi;
  explicit IntOp(const Ctx& c) : lo(c.lo), hi(c.hi) {}
  QL_INLINE BlockParams block(float a) const {
    BlockParams p;
    p.p0 = p.scale = hi / a;
    p.p1 = a <= kTinyAmax ? 1.0f : 0.0f;
    return p;
  }
  QL_INLINE float fake(float x, float s, float zero) const {
    float q = clampf(rne_int(x * s), lo, hi);
    q = (zero != 0.0f || !(q != 0.0f)) ? 0.0f : q;  // NaN and -0.0 codes are +0
    return q / s;
  }
};

// formats.fp8: a' = a if a > 2^-24 else 1 (NaN kept); s = Q / a'; x_hat = fp8(clamp(x * s)) * (1 / s).
// p0 = s, p1 = 1 / s.
template <class F>
struct Fp8Op {
  static constexpr Codes kCodes = Codes::FP8;
  explicit Fp8Op(const Ctx&) {}
  QL_INLINE BlockParams block(float a) const {
    float safe = a > kTinyAmax ? a : 1.0f;
    safe = isnan_(a) ? a : safe;
    BlockParams p;
    p.p0 = p.scale = F::kMax / safe;
    p.p1 = 1.0f / p.p0;
    return p;
  }
  QL_INLINE float fake(float x, float s, float inv) const { return fp8_round<F>(clampf(x * s, -F::kMax, F::kMax)) * inv; }
  QL_INLINE uint32_t code(float x, float s, float) const { return fp8_code<F>(clampf(x * s, -F::kMax, F::kMax)); }
};

// formats.fp8_blockwise: d = max(a, eps) / Q (then pow2_ceil); c = fp8(clamp(x / d)); x_hat = c * d;
// NaN codes are 0x7F whatever the NaN's sign (a NaN block is 0x7F throughout).
template <class F>
struct Fp8BlockOp {
  static constexpr Codes kCodes = Codes::FP8;
  float eps;
  bool pow2;
  explicit Fp8BlockOp(const Ctx& c) : eps(c.eps), pow2(c.pow2) {}
  QL_INLINE BlockParams block(float a) const {
    float d = maximumf(a, eps) / F::kMax;
    BlockParams p;
    p.p0 = p.scale = pow2 ? pow2_ceil(d) : d;
    return p;
  }
  QL_INLINE float fake(float x, float d, float) const { return fp8_round<F>(clampf(x / d, -F::kMax, F::kMax)) * d; }
  QL_INLINE uint32_t code(float x, float d, float) const {
    const float y = x / d;
    return isnan_(y) ? 0x7Fu : fp8_code<F>(clampf(y, -F::kMax, F::kMax));  // every NaN code is 0x7F
  }
};

// MX element policies (formats.mx): Q, emax, and the value / code of y already clamped to [-Q, Q].
struct MxE4M3 {
  static constexpr Codes kCodes = Codes::FP8;
  static constexpr float kQ = 448.0f;
  static constexpr int kEmax = 8;
  static QL_INLINE float value(float y) { return fp8_round<E4M3>(y); }
  static QL_INLINE uint32_t code(float y) { return fp8_code<E4M3>(y); }
};
struct MxE2M1 {
  static constexpr Codes kCodes = Codes::E2M1;
  static constexpr float kQ = 6.0f;
  static constexpr int kEmax = 2;
  static QL_INLINE float value(float y) { return e2m1_value(y); }
  static QL_INLINE uint32_t code(float y) { return e2m1_code(y); }
};
template <class F, int EMAX>
struct MxFp6 {  // one 6-bit code per byte
  static constexpr Codes kCodes = Codes::FP8;
  static constexpr float kQ = F::kMax;
  static constexpr int kEmax = EMAX;
  static QL_INLINE float value(float y) { return fp8_round<F>(y); }
  static QL_INLINE uint32_t code(float y) { return fp6_code<F>(y); }
};
using MxE3M2 = MxFp6<E3M2, 4>;
using MxE2M3 = MxFp6<E2M3, 2>;
struct MxInt8 {  // formats.mxint8: integer codes, read back through int8 (so -0.0 is +0, NaN code 0)
  static constexpr Codes kCodes = Codes::FP8;
  static constexpr float kQ = 127.0f;
  static constexpr int kEmax = 6;
  static QL_INLINE float value(float y) { return rne_int(y) + 0.0f; }
  static QL_INLINE uint32_t code(float y) { return isnan_(y) ? 0u : uint32_t(int32_t(rne_int(y))) & 0xFFu; }
};

// formats.mx: shared exponent byte from a; y = clamp(x / 2^e, -Q, Q); element of E; x_hat =
// element * 2^e (NaN for byte 0xFF).
template <class E>
struct MxOp {
  static constexpr Codes kCodes = E::kCodes;
  bool floor;
  explicit MxOp(const Ctx& c) : floor(c.floor) {}
  QL_INLINE BlockParams block(float a) const {
    BlockParams p;
    p.byte = e8m0_byte(a, E::kQ, E::kEmax, floor);
    p.p0 = e8m0_to_float(p.byte);
    return p;
  }
  QL_INLINE float fake(float x, float s, float) const { return E::value(clampf(x / s, -E::kQ, E::kQ)) * s; }
  QL_INLINE uint32_t code(float x, float s, float) const { return E::code(clampf(x / s, -E::kQ, E::kQ)); }
};

// formats.nvfp4: sb = a / (6 s2), 1 where 0; sb8 = e4m3(clamp(sb, 2^-9, 448)); y = x / (sb8 * s2);
// x_hat = e2m1(y) * (sb8 * s2). p0 = sb8 * s2.
struct Nvfp4Op {
  static constexpr Codes kCodes = Codes::E2M1;
  float s2, six_s2;
  explicit Nvfp4Op(const Ctx& c) : s2(c.s2), six_s2(c.six_s2) {}
  QL_INLINE BlockParams block(float a) const {
    float sb = a / six_s2;
    sb = sb == 0.0f ? 1.0f : sb;
    sb = clampf(sb, 0.001953125f, 448.0f);
    BlockParams p;
    p.byte = uint8_t(fp8_code<E4M3>(sb));
    p.p0 = fp8_round<E4M3>(sb) * s2;
    return p;
  }
  QL_INLINE float fake(float x, float d, float) const { return e2m1_value(x / d) * d; }
  QL_INLINE uint32_t code(float x, float d, float) const { return e2m1_code(x / d); }
};

// Parameters of one group for the broadcast path (computed by the wrapper, once per group).
QL_INLINE BlockParams group_params(Op op, const Ctx& c, float a) {
  switch (op) {
    case Op::INT: return IntOp(c).block(a);
    case Op::FP8_E4M3: return Fp8Op<E4M3>(c).block(a);
    case Op::FP8_E5M2: return Fp8Op<E5M2>(c).block(a);
    default: return BlockParams{};
  }
}
