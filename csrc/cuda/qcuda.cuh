// CUDA kernels of quantlib's block formats: one pass over device memory (16-byte vector loads, block
// amax + scale + cast fused), bit-exact to quantlib.formats (docs/design.md §3).
//
// Every fp32 operation the contract names is an explicit round-to-nearest intrinsic (__fdiv_rn,
// __fmul_rn, __fmaf_rn, __frcp_rn), so neither fast-math nor FMA contraction can change a result;
// E4M3 rounding is the hardware conversion, E2M1 and E8M0 rounding work on the fp32 bits. The same
// formulas and results as the Triton kernels (quantlib/kernels/triton/_numerics.py); where a step is
// cheaper here (the division on finite blocks, E2M1 by one FMA), its comment says why it is exact.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>
#include <stdint.h>

#include "e2m1_pack.cuh"

namespace quantlib {
namespace cuda {

// ------------------------------------------------------------------------------------------ numerics

#define QL_DEV __device__ __forceinline__

constexpr float kTiny = 5.9604644775390625e-08f;  // 2^-24
constexpr float kMinNormal = 1.1754943508222875e-38f;  // 2^-126
constexpr float kTwo126 = 8.507059173023462e37f;
constexpr float kTwo60 = 1.152921504606847e18f;
constexpr float kTwoM60 = 8.673617379884035e-19f;  // 2^-60

QL_DEV uint32_t f2u(float f) { return __float_as_uint(f); }
QL_DEV float u2f(uint32_t u) { return __uint_as_float(u); }
QL_DEV bool is_nan(float v) { return (f2u(v) & 0x7FFFFFFFu) > 0x7F800000u; }

// torch.clamp: NaN stays NaN.
QL_DEV float clamp_nan(float v, float lo, float hi) { return v < lo ? lo : (v > hi ? hi : v); }

// fp32 value of the E4M3 rounding (RNE, saturating at 448, NaN kept) of two values, by the hardware
// conversion (sm_89+; emulated bit-exactly by cuda_fp8.h elsewhere). Its saturation is the contract's
// clamp to [-448, 448], so no caller clamps first. The low byte of e4m3x2 is a's.
QL_DEV uint32_t e4m3x2(float a, float b) {
  return __nv_cvt_float2_to_fp8x2(make_float2(a, b), __NV_SATFINITE, __NV_E4M3);
}
QL_DEV float2 e4m3x2_value(uint32_t codes) {
  return __half22float2(__half2(__nv_cvt_fp8x2_to_halfraw2(__nv_fp8x2_storage_t(codes), __NV_E4M3)));
}
QL_DEV float e4m3_round(float v) { return e4m3x2_value(e4m3x2(v, 0.0f)).x; }
QL_DEV uint32_t e4m3_byte(float v) { return e4m3x2(v, 0.0f) & 0xFFu; }

// Smallest power of two >= d >= 0 (subnormal d scaled by 2^126 first and back after; 0 -> 2^-149).
QL_DEV float pow2_ceil(float d) {
  const bool sub = d < kMinNormal;
  const float v = sub ? __fmul_rn(d, kTwo126) : d;
  const uint32_t bits = f2u(v), ex = bits & 0x7F800000u;
  const float up = u2f((bits & 0x007FFFFFu) != 0 ? ex + 0x00800000u : ex);
  float out = sub ? __fmul_rn(up, kMinNormal) : up;
  out = d == 0.0f ? u2f(1u) : out;
  return (f2u(d) & 0x7FFFFFFFu) >= 0x7F800000u ? d : out;
}

// Biased E8M0 byte of a block amax: rceil (ceil(log2(a / Q)) from the bits) or floor
// (floor(log2 a) - emax); clamp to [-127, 127]; 255 for NaN / Inf.
template <bool FLOOR>
QL_DEV int e8m0_byte(float a, float qmax, int emax) {
  int e;
  if (FLOOR) {
    const int field = int((f2u(a) >> 23) & 0xFFu);
    e = (field == 0 ? -127 : field - 127) - emax;
  } else {
    const uint32_t bits = f2u(__fdiv_rn(a, qmax));
    const int field = int((bits >> 23) & 0xFFu);
    const uint32_t mant = bits & 0x007FFFFFu;
    e = mant != 0 ? field - 126 : field - 127;
    if (field == 0) e = mant > 0x400000u ? -126 : -127;
  }
  e = e < -127 ? -127 : (e > 127 ? 127 : e);
  return (f2u(a) & 0x7FFFFFFFu) < 0x7F800000u ? e + 127 : 255;
}

QL_DEV float e8m0_value(int byte) {
  uint32_t bits = byte == 0 ? 0x00400000u : uint32_t(byte) << 23;
  return u2f(byte == 255 ? 0x7FC00000u : bits);
}

// Exactly 1 / e8m0_value(byte).
QL_DEV float e8m0_inverse(int byte) {
  uint32_t bits = byte == 254 ? 0x00400000u : uint32_t(254 - byte) << 23;
  return u2f(byte == 255 ? 0x7FC00000u : bits);
}

// RN(x / b) without a division per element: y = RN(1 / b) once per block; q = x * y is within 1.5 ulp,
// one FMA correction brings it within one ulp and a second rounds it correctly (Markstein: the residual
// x - q * b is exact and RN(q + r * y) is the rounded quotient). Exact for b in [2^-60, 2^60] wherever
// the quotient is >= 2^-100; below that it keeps its sign and stays under every grid's smallest step,
// which is all the callers use. The corrections would turn an infinite quotient or dividend into NaN
// and -0 into +0: a block takes this path (Divisor::fast) only when every |x| it divides is at most a
// finite bound whose quotient stays finite, and the sign of x is put back on the result. Every other
// block divides with __fdiv_rn. Same as div_exact in quantlib/kernels/triton/_numerics.py.
struct Divisor {
  float b, nb, y;
  bool fast;
};

// bound: the largest |x| the block divides by b (NaN or Inf: none is fast).
QL_DEV Divisor make_divisor(float b, float bound) {
  Divisor d;
  d.b = b;
  d.nb = -b;
  d.y = __frcp_rn(b);
  d.fast = b >= kTwoM60 && b <= kTwo60 && __fmul_rn(bound, d.y) < kTwo126;
  return d;
}

// SIGN = false: the caller takes +0 for -0 (what the corrections give), so the sign is not put back.
template <bool FAST, bool SIGN = true>
QL_DEV float divide(float x, const Divisor& d) {
  if (!FAST) return __fdiv_rn(x, d.b);
  const float q = __fmul_rn(x, d.y);
  const float q1 = __fmaf_rn(__fmaf_rn(q, d.nb, x), d.y, q);
  const float q2 = __fmaf_rn(__fmaf_rn(q1, d.nb, x), d.y, q1);
  return SIGN ? u2f(f2u(q2) | (f2u(x) & 0x80000000u)) : q2;
}

// E2M1 (grid {0, .5, 1, 1.5, 2, 3, 4, 6}, RNE, saturating; NaN -> code 0 / value 0) by the point
// s = fma(p, 2^22, min(|y|, 6)) of e2m1_pack.cuh (p: the power of two of max(m, 1)); s - M is the
// grid value. The sign is taken from sx (y's, or the dividend's where y is its quotient by a positive
// scale and may have lost the sign of a zero). MAYBE_NAN = false: the caller knows y is not NaN.
template <bool MAYBE_NAN = true>
QL_DEV float e2m1_round(float y, float sx) {
  const float m = fminf(fabsf(y), 6.0f);
  const float p = u2f(max(f2u(m), 0x3F800000u) & 0x7F800000u);
  const float s = __fmaf_rn(p, 4194304.0f, m);
  const float v = u2f(f2u(__fmaf_rn(p, -4194304.0f, s)) | (f2u(sx) & 0x80000000u));
  return MAYBE_NAN && is_nan(y) ? 0.0f : v;
}

// The code, from the same point as e2m1_pack.cuh's (which the host test runs over every fp32 value).
template <bool MAYBE_NAN = true>
QL_DEV uint32_t e2m1_code(float y, float sx) {
  const uint32_t c = e2m1::code(e2m1::point(y)) | ((f2u(sx) & 0x80000000u) >> 28);
  return MAYBE_NAN && is_nan(y) ? 0u : c;
}

// INT fake quant of one group: q / (Q / a), the code through an integer dtype (NaN and -0 -> 0). An
// amax <= 2^-24 quantizes every element to 0: scale 0 (codes +-0 or NaN, both 0) over divisor 1.
struct IntGroup {
  float scale, lo, hi;
  Divisor div;
};

QL_DEV IntGroup int_group(float a, float lo, float hi) {
  IntGroup g;
  const bool zero = a <= kTiny;
  g.lo = lo;
  g.hi = hi;
  g.scale = zero ? 0.0f : __fdiv_rn(hi, a);
  g.div = make_divisor(zero ? 1.0f : g.scale, fmaxf(-lo, hi));
  return g;
}

// FAST: the block holds no NaN or Inf, so no code is NaN, and the reciprocal path turns -0 into +0.
template <bool FAST>
QL_DEV float int_fake(float x, const IntGroup& g) {
  const float q = rintf(__fmul_rn(x, g.scale));  // torch.round: half to even
  const float c = fminf(fmaxf(q, g.lo), g.hi);
  if (FAST) return divide<true, false>(c, g.div);
  return divide<false>(is_nan(q) ? 0.0f : __fadd_rn(c, 0.0f), g.div);
}

template <bool POW2>
QL_DEV float fp8_block_scale(float a, float eps, float qmax) {
  const float m = is_nan(a) ? a : (a > eps ? a : eps);
  const float d = __fdiv_rn(m, qmax);
  return POW2 ? pow2_ceil(d) : d;
}

QL_DEV float nvfp4_s2(float A) { return A <= kTiny ? 1.0f : __fdiv_rn(A, 2688.0f); }

// a / (6 s2) by the thread's reciprocal of 6 s2 where that is exact (the divisor in range, the
// quotient finite; a >= 0 or NaN), else by the division.
QL_DEV float nvfp4_sb8(float a, const Divisor& six_s2) {
  const bool fast = six_s2.fast && __fmul_rn(a, six_s2.y) < kTwo126;
  float sb = fast ? divide<true, false>(a, six_s2) : __fdiv_rn(a, six_s2.b);
  sb = sb == 0.0f ? 1.0f : sb;
  return e4m3_round(clamp_nan(sb, 0.001953125f, 448.0f));
}

// ------------------------------------------------------------------------------------ block scales

enum Kind : int { kInt = 0, kFp8Block = 1, kMx = 2, kNvfp4 = 3 };
enum Op : int { kFake = 1, kCast = 2 };

// Everything one block needs from its amax a (and the largest |x| it holds, m): how an element is
// scaled onto the element grid (scaled<FAST>) and back (back), the scale a cast stores, and whether
// the block is "fast": its divisions may all take the reciprocal and no scaled element is NaN.
template <int KIND, bool POW2, bool E2M1, bool FLOOR>
struct BlockScale {
  float back = 1.0f;             // FP8 block: d; MX: 2^e; NVFP4: sb8 * s2
  float pre = 1.0f, mul = 1.0f;  // y = (x * pre) * mul: FP8 block with pow2 (exact), MX
  Divisor div;                   // y = x / div: FP8 block, NVFP4
  IntGroup g;
  uint32_t stored = 0;           // cast: fp32 bits of d, or the E8M0 / E4M3 byte
  bool fast = true;
  static constexpr bool kNibbles = E2M1 || KIND == kNvfp4;  // E2M1 codes, two a byte

  QL_DEV BlockScale(float a, float m, float eps, float lo, float hi, const Divisor& six_s2, float s2) {
    constexpr float QMAX = E2M1 ? 6.0f : 448.0f;
    if (KIND == kInt) {
      g = int_group(a, lo, hi);
      fast = g.div.fast && m < INFINITY;
    } else if (KIND == kFp8Block) {
      const float d = fp8_block_scale<POW2>(a, eps, 448.0f);
      back = d;
      stored = f2u(d);
      if (POW2) {  // a subnormal d is scaled by 2^126 first, so that 1 / d stays finite
        const bool sub = d < kMinNormal;
        pre = sub ? kTwo126 : 1.0f;
        mul = __frcp_rn(sub ? __fmul_rn(d, kTwo126) : d);
      } else {
        div = make_divisor(d, m);
        fast = div.fast;
      }
    } else if (KIND == kMx) {
      const int byte = e8m0_byte<FLOOR>(a, QMAX, E2M1 ? 2 : 8);
      mul = e8m0_inverse(byte);
      back = e8m0_value(byte);
      stored = uint32_t(byte);
      fast = m < INFINITY;  // no element is NaN: E2M1 skips its NaN select
    } else {
      const float sb8 = nvfp4_sb8(a, six_s2);
      back = __fmul_rn(sb8, s2);
      div = make_divisor(back, m);
      fast = div.fast;
      stored = e4m3_byte(sb8);
    }
  }

  template <bool FAST>
  QL_DEV float scaled(float x) const {
    if (KIND == kNvfp4) return divide<FAST, false>(x, div);  // E2M1 takes the sign from x
    if (KIND == kFp8Block && !POW2) return divide<FAST>(x, div);
    return __fmul_rn(KIND == kMx ? x : __fmul_rn(x, pre), mul);
  }

  // dequant(quant(a)), dequant(quant(b)).
  template <bool FAST>
  QL_DEV float2 fake2(float a, float b) const {
    if (KIND == kInt) return make_float2(int_fake<FAST>(a, g), int_fake<FAST>(b, g));
    const float ya = scaled<FAST>(a), yb = scaled<FAST>(b);
    if (kNibbles) return make_float2(__fmul_rn(e2m1_round<!FAST>(ya, a), back), __fmul_rn(e2m1_round<!FAST>(yb, b), back));
    const float2 r = e4m3x2_value(e4m3x2(ya, yb));
    return make_float2(__fmul_rn(r.x, back), __fmul_rn(r.y, back));
  }

  // The codes of a and b: two E4M3 bytes (a's low), or one byte of two E2M1 nibbles (a's low).
  template <bool FAST>
  QL_DEV uint32_t cast2(float a, float b) const {
    const float ya = scaled<FAST>(a), yb = scaled<FAST>(b);
    if (kNibbles) return e2m1_code<!FAST>(ya, a) | (e2m1_code<!FAST>(yb, b) << 4);
    uint32_t c = e4m3x2(ya, yb);
    if (KIND == kFp8Block) {  // every NaN code is 0x7F, whatever the NaN's sign (docs/numerics.md)
      c = is_nan(ya) ? ((c & 0xFF00u) | 0x7Fu) : c;
      c = is_nan(yb) ? ((c & 0x00FFu) | 0x7F00u) : c;
    }
    return c;
  }
};

// ------------------------------------------------------------------------------------ vector access

// 16 bytes of input held as four 32-bit words (two elements a word for 16-bit types) until they are
// used: half the registers of fp32 values, and the block amax is taken on the raw bits.
template <typename T>
struct Elems;

template <>
struct Elems<float> {
  static QL_DEV uint32_t absmax_bits(const uint4& w) {
    return max(max(w.x & 0x7FFFFFFFu, w.y & 0x7FFFFFFFu), max(w.z & 0x7FFFFFFFu, w.w & 0x7FFFFFFFu));
  }
  static QL_DEV float2 pair(const uint4& w, int i) {  // elements 2i, 2i + 1
    return i == 0 ? make_float2(u2f(w.x), u2f(w.y)) : make_float2(u2f(w.z), u2f(w.w));
  }
  static QL_DEV void put(uint4& w, int i, float2 v) {
    if (i == 0) { w.x = f2u(v.x); w.y = f2u(v.y); } else { w.z = f2u(v.x); w.w = f2u(v.y); }
  }
};

// 16-bit types: |x| bits of two elements at once (NaN sorts high), the max widened to fp32 bits.
QL_DEV uint32_t absmax16(const uint4& w) {
  constexpr uint32_t kAbs = 0x7FFF7FFFu;
  const uint32_t m = __vmaxu2(__vmaxu2(w.x & kAbs, w.y & kAbs), __vmaxu2(w.z & kAbs, w.w & kAbs));
  return max(m & 0xFFFFu, m >> 16);
}

QL_DEV uint32_t word(const uint4& w, int i) { return i == 0 ? w.x : (i == 1 ? w.y : (i == 2 ? w.z : w.w)); }
QL_DEV void set_word(uint4& w, int i, uint32_t v) {
  if (i == 0) w.x = v; else if (i == 1) w.y = v; else if (i == 2) w.z = v; else w.w = v;
}

template <>
struct Elems<__nv_bfloat16> {
  static QL_DEV uint32_t absmax_bits(const uint4& w) { return absmax16(w) << 16; }
  static QL_DEV float2 pair(const uint4& w, int i) {
    const uint32_t v = word(w, i);
    return make_float2(u2f(v << 16), u2f(v & 0xFFFF0000u));
  }
  static QL_DEV void put(uint4& w, int i, float2 v) {
    const __nv_bfloat162 h = __floats2bfloat162_rn(v.x, v.y);
    set_word(w, i, *reinterpret_cast<const uint32_t*>(&h));
  }
};

template <>
struct Elems<__half> {
  static QL_DEV uint32_t absmax_bits(const uint4& w) {
    return f2u(__half2float(__ushort_as_half(static_cast<unsigned short>(absmax16(w)))));
  }
  static QL_DEV float2 pair(const uint4& w, int i) {
    const uint32_t v = word(w, i);
    return __half22float2(*reinterpret_cast<const __half2*>(&v));
  }
  static QL_DEV void put(uint4& w, int i, float2 v) {
    const __half2 h = __floats2half2_rn(v.x, v.y);
    set_word(w, i, *reinterpret_cast<const uint32_t*>(&h));
  }
};

// Codes of one 16-byte input vector: VEC E4M3 bytes or VEC / 2 bytes of E2M1 pairs (2, 4 or 8 bytes).
template <int N>
QL_DEV void store_code_bytes(uint8_t* p, const uint32_t* w) {
  if (N == 8) *reinterpret_cast<uint2*>(p) = make_uint2(w[0], w[1]);
  else if (N == 4) *reinterpret_cast<uint32_t*>(p) = w[0];
  else *reinterpret_cast<uint16_t*>(p) = uint16_t(w[0]);
}

// max over aligned groups of LANES lanes (LANES a power of two <= 32), on abs bits (NaN sorts high).
template <int LANES>
QL_DEV uint32_t group_max(uint32_t v) {
#pragma unroll
  for (int off = LANES / 2; off > 0; off >>= 1) v = max(v, __shfl_xor_sync(0xFFFFFFFFu, v, off));
  return v;
}

// One 16-byte vector through a block's scale: the fake-quant result in place (OP kFake), or its codes
// into code[] (OP kCast).
template <typename T, int OP, bool FAST, typename S>
QL_DEV void quantize_pairs(const S& s, uint4& w, uint32_t* code) {
  using E = Elems<T>;
  constexpr int PAIRS = 8 / sizeof(T);  // element pairs in 16 bytes
  uint32_t c[PAIRS];
#pragma unroll
  for (int i = 0; i < PAIRS; ++i) {
    const float2 v = E::pair(w, i);
    if (OP == kFake) E::put(w, i, s.template fake2<FAST>(v.x, v.y));
    else c[i] = s.template cast2<FAST>(v.x, v.y);
  }
  if (OP == kCast) {
    if (S::kNibbles) {  // a byte a pair
#pragma unroll
      for (int j = 0; j < (PAIRS + 3) / 4; ++j) {
        uint32_t b = 0;
#pragma unroll
        for (int i = 0; i < 4 && 4 * j + i < PAIRS; ++i) b |= c[4 * j + i] << (8 * i);
        code[j] = b;
      }
    } else {  // two bytes a pair
#pragma unroll
      for (int j = 0; j < PAIRS / 2; ++j) code[j] = c[2 * j] | (c[2 * j + 1] << 16);
    }
  }
}

// quantize_pairs on the block's path: the reciprocal division (and no NaN selects) where s.fast.
template <typename T, int OP, typename S>
QL_DEV void quantize_vec(const S& s, uint4& w, uint32_t* code) {
  if (s.fast) quantize_pairs<T, OP, true>(s, w, code);
  else quantize_pairs<T, OP, false>(s, w, code);
}

// The amax a block is quantized with: its static one, or the largest |x| (bits m) it holds. A NaN
// in an INT group makes the scale NaN, as the reference's NaN-propagating amax does.
template <int KIND, bool STATIC>
QL_DEV float group_amax(const float* amax, int64_t group, uint32_t m) {
  if (!STATIC) return u2f(m);
  const float a = __ldg(amax + group);
  return (KIND == kInt && m > 0x7F800000u) ? u2f(0x7FC00000u) : a;
}

// ----------------------------------------------------------------------------------------- kernels

struct Args {
  const void* x;
  void* out;           // fake: T; cast: uint8 codes (fp8 bytes or packed E2M1)
  void* scale;         // cast: fp32 d (fp8 blockwise) or uint8 (E8M0 / E4M3 byte)
  const float* amax;   // static block amax (or nullptr)
  const float* gamax;  // NVFP4 global amax (1 element)
  float* s2;           // NVFP4 cast: the global scale (0-dim)
  int64_t R, C, NB, VR;    // 1-D: rows, cols, blocks per row, 16-byte vectors per row
  int64_t L, M, K, MB, KB; // 2-D: batch, rows, cols, blocks
  uint64_t nb_magic;       // ceil(2^44 / NB), exact for b / NB while b * NB < 2^44 (0: divide)
  int TPR;                 // row kernel: threads a row (32..256, a power of two)
  float lo, hi, eps;
};

constexpr int kThreads = 256;

// max of m over each run of `warps` consecutive warps of the CTA (a divisor of its 8), for every
// thread; red: the CTA's shared scratch of one word a warp. Contains a __syncthreads.
QL_DEV uint32_t warps_max(uint32_t m, uint32_t* red, int warps) {
  m = group_max<32>(m);
  if (threadIdx.x % 32 == 0) red[threadIdx.x / 32] = m;
  __syncthreads();
  const int w0 = int(threadIdx.x / 32) / warps * warps;  // first warp of the run
  m = red[w0];
  for (int i = 1; i < warps; ++i) m = max(m, red[w0 + i]);
  return m;
}

// How block1d_kernel lays B elements of T out over threads: a block is VPB 16-byte vectors, LANES
// threads share it, each holding NVT of them (vector k * LANES + lane, so that adjacent lanes read
// adjacent vectors: two lanes at least fill a 32-byte sector); a thread owns UNROLL blocks, all
// loaded before the first is used. Fewer lanes a block mean fewer copies of the per-block scale math.
template <typename T, int B>
struct Layout1d {
  static constexpr int VEC = 16 / sizeof(T);
  static constexpr int VPB = B / VEC;
  static constexpr int NVT = VPB / 2 < 1 ? 1 : (VPB / 2 > 4 ? 4 : VPB / 2);
  static constexpr int LANES = VPB / NVT;
  static constexpr int UNROLL = 4 / NVT;
  static constexpr int GROUPS = kThreads / LANES;
  static constexpr int PER_CTA = GROUPS * UNROLL;  // blocks per CTA
  static_assert(B % VEC == 0 && VPB % NVT == 0 && LANES <= 32, "block must hold whole vectors");
};

QL_DEV int64_t div_nb(int64_t b, const Args& a) {
  return a.nb_magic ? int64_t(__umul64hi(uint64_t(b), a.nb_magic << 20)) : b / a.NB;
}

// Index (in 16-byte vectors) of vector j of block b, or -1 past the end of the tensor or of its row.
// FLAT: the rows hold whole blocks (C % B == 0), so block b is vectors [b * VPB, (b + 1) * VPB).
template <bool FLAT, int VPB>
QL_DEV int64_t block_vector(int64_t b, int j, const Args& a) {
  if (b >= a.R * a.NB) return -1;
  if (FLAT) return b * VPB + j;
  const int64_t row = div_nb(b, a);
  const int64_t v = (b - row * a.NB) * VPB + j;
  return v < a.VR ? row * a.VR + v : -1;
}

// Blocks of B along the last dim; see Layout1d. A cast writes CODE_BYTES a vector: its codes sit at
// the vector's index times CODE_BYTES, since the rows have no padding.
template <typename T, int KIND, int OP, int B, bool STATIC, bool POW2, bool E2M1, bool FLOOR, bool FLAT>
__global__ void __launch_bounds__(kThreads) block1d_kernel(Args args) {
  using L = Layout1d<T, B>;
  using S = BlockScale<KIND, POW2, E2M1, FLOOR>;
  constexpr int CODE_BYTES = S::kNibbles ? L::VEC / 2 : L::VEC;

  const uint4* __restrict__ x = static_cast<const uint4*>(args.x);  // in 16-byte vectors
  const int lane = threadIdx.x % L::LANES;
  const int64_t first = int64_t(blockIdx.x) * L::PER_CTA + threadIdx.x / L::LANES;

  uint4 w[L::UNROLL][L::NVT];
#pragma unroll
  for (int u = 0; u < L::UNROLL; ++u) {
#pragma unroll
    for (int k = 0; k < L::NVT; ++k) {
      const int64_t i = block_vector<FLAT, L::VPB>(first + u * L::GROUPS, k * L::LANES + lane, args);
      w[u][k] = i >= 0 ? x[i] : make_uint4(0u, 0u, 0u, 0u);
    }
  }

  float s2 = 1.0f;
  Divisor six_s2{};
  if (KIND == kNvfp4) {
    s2 = nvfp4_s2(__ldg(args.gamax));
    six_s2 = make_divisor(__fmul_rn(6.0f, s2), 0.0f);
    if (OP == kCast && blockIdx.x == 0 && threadIdx.x == 0) *args.s2 = s2;
  }

#pragma unroll
  for (int u = 0; u < L::UNROLL; ++u) {
    const int64_t b = first + u * L::GROUPS;
    uint32_t m = 0;
#pragma unroll
    for (int k = 0; k < L::NVT; ++k) m = max(m, Elems<T>::absmax_bits(w[u][k]));
    m = group_max<L::LANES>(m);
    if (b >= args.R * args.NB) continue;
    const S s(group_amax<KIND, STATIC>(args.amax, b, m), u2f(m), args.eps, args.lo, args.hi, six_s2, s2);
    if (OP == kCast && lane == 0) {
      if (KIND == kFp8Block) static_cast<uint32_t*>(args.scale)[b] = s.stored;
      else static_cast<uint8_t*>(args.scale)[b] = uint8_t(s.stored);
    }
#pragma unroll
    for (int k = 0; k < L::NVT; ++k) {
      const int64_t i = block_vector<FLAT, L::VPB>(b, k * L::LANES + lane, args);
      if (i < 0) continue;
      uint32_t code[2];
      quantize_vec<T, OP>(s, w[u][k], code);
      if (OP == kFake) static_cast<uint4*>(args.out)[i] = w[u][k];
      else store_code_bytes<CODE_BYTES>(static_cast<uint8_t*>(args.out) + i * CODE_BYTES, code);
    }
  }
}

// INT fake quant with one group a row of [R, C] (C = VR vectors): a static amax per row (per channel)
// or a dynamic one. TPR threads share a row, each holding NV of its vectors (vector k * TPR + t) in
// registers, so the row is read once: its amax is reduced across them (shuffles, then shared memory
// over the row's TPR / 32 warps) before any element is quantized. A CTA holds 256 / TPR rows.
template <typename T, int NV, bool STATIC>
__global__ void __launch_bounds__(kThreads) row_int_kernel(Args args) {
  __shared__ uint32_t red[kThreads / 32];
  const uint4* __restrict__ x = static_cast<const uint4*>(args.x);
  const int t = threadIdx.x % args.TPR;
  const int64_t row = int64_t(blockIdx.x) * (kThreads / args.TPR) + threadIdx.x / args.TPR;
  const bool live = row < args.R;

  uint4 w[NV];
  uint32_t m = 0;
#pragma unroll
  for (int k = 0; k < NV; ++k) {
    const int v = k * args.TPR + t;
    w[k] = (live && v < args.VR) ? x[row * args.VR + v] : make_uint4(0u, 0u, 0u, 0u);
  }
#pragma unroll
  for (int k = 0; k < NV; ++k) m = max(m, Elems<T>::absmax_bits(w[k]));
  m = warps_max(m, red, args.TPR / 32);
  if (!live) return;

  const BlockScale<kInt, false, false, false> s(group_amax<kInt, STATIC>(args.amax, row, m), u2f(m), 0.0f, args.lo, args.hi,
                                                Divisor{}, 1.0f);
#pragma unroll
  for (int k = 0; k < NV; ++k) {
    const int v = k * args.TPR + t;
    if (v >= args.VR) continue;
    quantize_vec<T, kFake>(s, w[k], nullptr);
    static_cast<uint4*>(args.out)[row * args.VR + v] = w[k];
  }
}

}  // namespace cuda
}  // namespace quantlib
