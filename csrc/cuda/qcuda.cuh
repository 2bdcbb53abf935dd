// CUDA kernels of quantlib's block formats: one pass over device memory (16-byte vector loads, block
// amax + scale + cast fused), bit-exact to quantlib.formats (DESIGN §3).
//
// Every fp32 operation the contract names is an explicit round-to-nearest intrinsic (__fdiv_rn,
// __fmul_rn, __fadd_rn), so neither fast-math nor FMA contraction can change a result; FP8, E2M1 and
// E8M0 rounding is done on the fp32 bits with integer operations. The same formulas as the Triton
// kernels (quantlib/kernels/triton/_numerics.py), line for line.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>
#include <stdint.h>

namespace quantlib {
namespace cuda {

// ------------------------------------------------------------------------------------------ numerics

#define QL_DEV __device__ __forceinline__

constexpr float kTiny = 5.9604644775390625e-08f;  // 2^-24
constexpr float kMinNormal = 1.1754943508222875e-38f;  // 2^-126
constexpr float kTwo126 = 8.507059173023462e37f;

QL_DEV uint32_t f2u(float f) { return __float_as_uint(f); }
QL_DEV float u2f(uint32_t u) { return __uint_as_float(u); }
QL_DEV bool is_nan(float v) { return (f2u(v) & 0x7FFFFFFFu) > 0x7F800000u; }

// torch.clamp: NaN stays NaN.
QL_DEV float clamp_nan(float v, float lo, float hi) { return v < lo ? lo : (v > hi ? hi : v); }

// torch.round (half to even); |v| >= 2^22 is already an integer.
QL_DEV float rint_even(float v) {
  const float r = __fsub_rn(__fadd_rn(v, 12582912.0f), 12582912.0f);
  return fabsf(v) < 4194304.0f ? r : v;
}

// fp32 value of cast_rne_fp8(v) for |v| <= Q or NaN; FP8E 0 = E4M3, 1 = E5M2. Sign of zero kept.
// E4M3 byte of |v| <= 448 (or NaN) by the hardware's round-to-nearest-even conversion (sm_89+;
// emulated bit-exactly by cuda_fp8.h elsewhere), and its exact fp32 value.
QL_DEV uint32_t e4m3_code(float v) { return __nv_cvt_float_to_fp8(v, __NV_SATFINITE, __NV_E4M3); }
QL_DEV float e4m3_value(uint32_t byte) {
  return __half2float(__half(__nv_cvt_fp8_to_halfraw(__nv_fp8_storage_t(byte), __NV_E4M3)));
}

template <int FP8E>
QL_DEV float round_fp8(float v) {
  if (FP8E == 0) return e4m3_value(e4m3_code(v));
  const uint32_t u = f2u(v), mag = u & 0x7FFFFFFFu;
  uint32_t res;
  if (FP8E == 0) {
    const uint32_t rn = (mag + 0x7FFFFu + ((mag >> 20) & 1u)) & 0xFFF00000u;
    const float sub = __fsub_rn(__fadd_rn(u2f(mag), 16384.0f), 16384.0f);  // step 2^-9 below 2^-6
    res = mag < 0x3C800000u ? f2u(sub) : rn;
  } else {
    const uint32_t rn = (mag + 0xFFFFFu + ((mag >> 21) & 1u)) & 0xFFE00000u;
    const float sub = __fsub_rn(__fadd_rn(u2f(mag), 128.0f), 128.0f);  // step 2^-16 below 2^-14
    res = mag < 0x38800000u ? f2u(sub) : rn;
  }
  res = mag > 0x7F800000u ? mag : res;
  return u2f(res | (u & 0x80000000u));
}

// The FP8 byte of a value already on the FP8 grid; NaN gives 0x7F | sign.
template <int FP8E>
QL_DEV uint32_t fp8_byte(float r) {
  if (FP8E == 0) return e4m3_code(r);
  const uint32_t u = f2u(r), mag = u & 0x7FFFFFFFu;
  uint32_t b;
  if (FP8E == 0) {
    b = mag < 0x3C800000u ? uint32_t(__fmul_rn(u2f(mag), 512.0f)) : (mag >> 20) - 960u;
  } else {
    b = mag < 0x38800000u ? uint32_t(__fmul_rn(u2f(mag), 65536.0f)) : (mag >> 21) - 448u;
  }
  b = mag > 0x7F800000u ? 0x7Fu : b;
  return b | ((u >> 24) & 0x80u);
}

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
// which is all the callers use. Other divisors (0, Inf and NaN excepted, whose q is already the
// quotient) take __fdiv_rn. Same as div_exact in quantlib/kernels/triton/_numerics.py.
struct Divisor {
  float b, nb, y;
  bool fast;
};

QL_DEV Divisor make_divisor(float b) {
  Divisor d;
  d.b = b;
  d.nb = -b;
  d.fast = !(b > 0.0f && (b < 8.673617379884035e-19f || (b > 1.152921504606847e18f && f2u(b) < 0x7F800000u)));
  d.y = __fdiv_rn(1.0f, b);
  return d;
}

QL_DEV float divide(float x, const Divisor& d) {
  if (!d.fast) return __fdiv_rn(x, d.b);
  const float q = __fmul_rn(x, d.y);
  const float q1 = __fmaf_rn(__fmaf_rn(q, d.nb, x), d.y, q);
  const float q2 = __fmaf_rn(__fmaf_rn(q1, d.nb, x), d.y, q1);
  return (q == 0.0f || (f2u(q) & 0x7FFFFFFFu) >= 0x7F800000u) ? q : q2;
}

// E2M1 (grid {0, .5, 1, 1.5, 2, 3, 4, 6}, RNE, saturating; NaN -> code 0 / value 0): |y| saturated at
// 6, rounded below 1 to the step 0.5 by adding 2^22 (whose ulp is 0.5: the fp32 addition is the RNE),
// from 1 up to one mantissa bit by the integer round-half-even of the bits.
struct E2m1Parts {
  float m, sub;
  uint32_t nrm;
};

QL_DEV E2m1Parts e2m1_parts(float y) {
  E2m1Parts p;
  p.m = fminf(fabsf(y), 6.0f);
  p.sub = __fadd_rn(p.m, 4194304.0f);
  const uint32_t b = f2u(p.m);
  p.nrm = b + 0x1FFFFFu + ((b >> 22) & 1u);
  return p;
}

QL_DEV uint32_t e2m1_code(float y) {
  const E2m1Parts p = e2m1_parts(y);
  const uint32_t idx = p.m < 1.0f ? f2u(p.sub) - 0x4A800000u : (p.nrm >> 22) - 252u;
  return is_nan(y) ? 0u : idx | ((f2u(y) >> 28) & 8u);
}

// The value of e2m1_code(y), without forming the code.
QL_DEV float e2m1_round(float y) {
  const E2m1Parts p = e2m1_parts(y);
  const uint32_t mag = p.m < 1.0f ? f2u(__fsub_rn(p.sub, 4194304.0f)) : p.nrm & 0xFFC00000u;
  return is_nan(y) ? 0.0f : u2f(mag | (f2u(y) & 0x80000000u));
}

// INT fake quant of one group: q / (Q / a), the code through an integer dtype (NaN and -0 -> 0).
struct IntGroup {
  float a, scale, lo, hi;
  Divisor div;
};

QL_DEV IntGroup int_group(float a, float lo, float hi) {
  IntGroup g;
  g.a = a;
  g.lo = lo;
  g.hi = hi;
  g.scale = __fdiv_rn(hi, a);
  g.div = make_divisor(g.scale);
  return g;
}

QL_DEV float int_fake(float x, const IntGroup& g) {
  float q = clamp_nan(rint_even(__fmul_rn(x, g.scale)), g.lo, g.hi);
  q = (g.a <= kTiny || is_nan(q) || q == 0.0f) ? 0.0f : q;
  return divide(q, g.div);
}

template <bool POW2>
QL_DEV float fp8_block_scale(float a, float eps, float qmax) {
  const float m = is_nan(a) ? a : (a > eps ? a : eps);
  const float d = __fdiv_rn(m, qmax);
  return POW2 ? pow2_ceil(d) : d;
}

// Per-block factors of x / d: with pow2, x * (1 / d) (exact), a subnormal d scaled by 2^126 first.
struct BlockDiv {
  float mul, pre;  // y = pow2 ? (x * pre) * mul : divide(x, div)
  Divisor div;
};

template <bool POW2>
QL_DEV BlockDiv block_div(float d) {
  BlockDiv r;
  const bool sub = d < kMinNormal;
  r.pre = sub ? kTwo126 : 1.0f;
  r.mul = POW2 ? __fdiv_rn(1.0f, sub ? __fmul_rn(d, kTwo126) : d) : 0.0f;
  if (!POW2) r.div = make_divisor(d);
  return r;
}

template <bool POW2, int FP8E>
QL_DEV float fp8_block_round(float x, const BlockDiv& bd, float qmax) {
  const float y = POW2 ? __fmul_rn(__fmul_rn(x, bd.pre), bd.mul) : divide(x, bd.div);
  return round_fp8<FP8E>(clamp_nan(y, -qmax, qmax));
}

template <bool POW2>
QL_DEV uint32_t fp8_block_code(float x, const BlockDiv& bd, float qmax) {
  const float y = POW2 ? __fmul_rn(__fmul_rn(x, bd.pre), bd.mul) : divide(x, bd.div);
  return e4m3_code(clamp_nan(y, -qmax, qmax));
}

QL_DEV float nvfp4_s2(float A) { return A <= kTiny ? 1.0f : __fdiv_rn(A, 2688.0f); }

QL_DEV float nvfp4_sb8(float a, float s2) {
  float sb = __fdiv_rn(a, __fmul_rn(6.0f, s2));
  sb = sb == 0.0f ? 1.0f : sb;
  return round_fp8<0>(clamp_nan(sb, 0.001953125f, 448.0f));
}

// ------------------------------------------------------------------------------------ vector access

template <typename T>
QL_DEV float to_f32(T v);
template <>
QL_DEV float to_f32<float>(float v) { return v; }
template <>
QL_DEV float to_f32<__nv_bfloat16>(__nv_bfloat16 v) { return __bfloat162float(v); }
template <>
QL_DEV float to_f32<__half>(__half v) { return __half2float(v); }

template <typename T>
QL_DEV T from_f32(float v);
template <>
QL_DEV float from_f32<float>(float v) { return v; }
template <>
QL_DEV __nv_bfloat16 from_f32<__nv_bfloat16>(float v) { return __float2bfloat16_rn(v); }
template <>
QL_DEV __half from_f32<__half>(float v) { return __float2half_rn(v); }

template <typename T, int N>
struct alignas(sizeof(T) * N) Pack {
  T v[N];
};

template <int N>
struct alignas(N) Bytes {
  uint8_t b[N];
};

// Load N elements (one vector of N * sizeof(T) bytes) as fp32; streaming (read once).
template <typename T, int N>
QL_DEV void load_vec(const T* p, float* out) {
  const Pack<T, N> pk = *reinterpret_cast<const Pack<T, N>*>(p);
#pragma unroll
  for (int i = 0; i < N; ++i) out[i] = to_f32<T>(pk.v[i]);
}

template <typename T, int N>
QL_DEV void store_vec(T* p, const float* v) {
  Pack<T, N> pk;
#pragma unroll
  for (int i = 0; i < N; ++i) pk.v[i] = from_f32<T>(v[i]);
  *reinterpret_cast<Pack<T, N>*>(p) = pk;
}

template <int N>
QL_DEV void store_bytes(uint8_t* p, const uint32_t* b) {
  Bytes<N> pk;
#pragma unroll
  for (int i = 0; i < N; ++i) pk.b[i] = uint8_t(b[i]);
  *reinterpret_cast<Bytes<N>*>(p) = pk;
}

// max over aligned groups of LANES lanes (LANES a power of two <= 32), on abs bits (NaN sorts high).
template <int LANES>
QL_DEV uint32_t group_max(uint32_t v) {
#pragma unroll
  for (int off = LANES / 2; off > 0; off >>= 1) v = max(v, __shfl_xor_sync(0xFFFFFFFFu, v, off));
  return v;
}

// ----------------------------------------------------------------------------------------- kernels

enum Kind : int { kInt = 0, kFp8Block = 1, kMx = 2, kNvfp4 = 3 };
enum Op : int { kFake = 1, kCast = 2 };

struct Args {
  const void* x;
  void* out;           // fake: T; cast: uint8 codes (fp8 bytes or packed E2M1)
  void* scale;         // cast: fp32 d (fp8 blockwise) or uint8 (E8M0 / E4M3 byte)
  const float* amax;   // static block amax (or nullptr)
  const float* gamax;  // NVFP4 global amax (1 element)
  float* s2;           // NVFP4 cast: the global scale (0-dim)
  int64_t R, C, NB, OUTC;  // 1-D: rows, cols, blocks per row, packed bytes per row
  int64_t L, M, K, MB, KB; // 2-D: batch, rows, cols, blocks
  uint64_t nb_magic;       // ceil(2^44 / NB), exact for b / NB while b * NB < 2^44 (0: divide)
  float lo, hi, eps;
};

constexpr int kThreads = 256;
constexpr int kUnroll = 4;

// Blocks of B along the last dim of [R, C]. A group of LANES threads owns one block, each thread EPT
// contiguous elements (16-byte vectors); a CTA owns kUnroll * (256 / LANES) consecutive blocks,
// whose loads are all issued before the first use. Needs C % (16 / sizeof(T)) == 0.
QL_DEV int64_t div_nb(int64_t b, const Args& a) {
  return a.nb_magic ? int64_t(__umul64hi(uint64_t(b), a.nb_magic << 20)) : b / a.NB;
}

template <typename T, int KIND, int OP, int B, bool STATIC, bool POW2, bool E2M1, bool FLOOR>
__global__ void __launch_bounds__(kThreads) block1d_kernel(Args args) {
  constexpr int VEC = 16 / sizeof(T);
  constexpr int LANES = (B / VEC) < 32 ? (B / VEC) : 32;
  constexpr int EPT = B / LANES;
  constexpr int NV = EPT / VEC;
  constexpr int GROUPS = kThreads / LANES;
  constexpr float QMAX = KIND == kMx ? (E2M1 ? 6.0f : 448.0f) : (KIND == kNvfp4 ? 6.0f : 448.0f);
  constexpr int EMAX = E2M1 ? 2 : 8;
  static_assert(EPT % VEC == 0, "block must hold whole vectors");

  const T* __restrict__ x = static_cast<const T*>(args.x);
  const int lane = threadIdx.x % LANES;
  const int grp = threadIdx.x / LANES;
  const int64_t total = args.R * args.NB;
  const int64_t first = int64_t(blockIdx.x) * GROUPS * kUnroll + grp;

  float v[kUnroll][EPT];
#pragma unroll
  for (int u = 0; u < kUnroll; ++u) {
    const int64_t b = first + int64_t(u) * GROUPS;
    const int64_t row = div_nb(b, args);
    const int64_t col0 = (b - row * args.NB) * B + lane * EPT;
#pragma unroll
    for (int k = 0; k < NV; ++k) {
      if (b < total && col0 + k * VEC < args.C) {
        load_vec<T, VEC>(x + row * args.C + col0 + k * VEC, &v[u][k * VEC]);
      } else {
#pragma unroll
        for (int i = 0; i < VEC; ++i) v[u][k * VEC + i] = 0.0f;
      }
    }
  }

  float s2 = 1.0f;
  if (KIND == kNvfp4) {
    s2 = nvfp4_s2(__ldg(args.gamax));
    if (OP == kCast && blockIdx.x == 0 && threadIdx.x == 0) *args.s2 = s2;
  }

#pragma unroll
  for (int u = 0; u < kUnroll; ++u) {
    const int64_t b = first + int64_t(u) * GROUPS;
    uint32_t m = 0;
#pragma unroll
    for (int i = 0; i < EPT; ++i) m = max(m, f2u(v[u][i]) & 0x7FFFFFFFu);
    m = group_max<LANES>(m);
    if (b >= total) continue;
    const int64_t row = div_nb(b, args);
    const int64_t col0 = (b - row * args.NB) * B + lane * EPT;
    float a = u2f(m);
    if (STATIC) {
      a = __ldg(args.amax + b);
      if (KIND == kInt && m > 0x7F800000u) a = u2f(0x7FC00000u);  // INT: NaN in a group -> NaN scale
    }

    float r[EPT];
    uint32_t c[EPT];
    if (KIND == kInt) {
      const IntGroup g = int_group(a, args.lo, args.hi);
#pragma unroll
      for (int i = 0; i < EPT; ++i) r[i] = int_fake(v[u][i], g);
    } else if (KIND == kFp8Block) {
      const float d = fp8_block_scale<POW2>(a, args.eps, 448.0f);
      const BlockDiv bd = block_div<POW2>(d);
      if (OP == kCast && lane == 0) static_cast<float*>(args.scale)[b] = d;
#pragma unroll
      for (int i = 0; i < EPT; ++i) {
        if (OP == kCast) c[i] = fp8_block_code<POW2>(v[u][i], bd, 448.0f);
        else r[i] = __fmul_rn(fp8_block_round<POW2, 0>(v[u][i], bd, 448.0f), d);
      }
    } else if (KIND == kMx) {
      const int byte = e8m0_byte<FLOOR>(a, QMAX, EMAX);
      const float inv = e8m0_inverse(byte), sc = e8m0_value(byte);
      if (OP == kCast && lane == 0) static_cast<uint8_t*>(args.scale)[b] = uint8_t(byte);
#pragma unroll
      for (int i = 0; i < EPT; ++i) {
        const float y = clamp_nan(__fmul_rn(v[u][i], inv), -QMAX, QMAX);
        if (E2M1) {
          if (OP == kCast) c[i] = e2m1_code(y); else r[i] = __fmul_rn(e2m1_round(y), sc);
        } else {
          if (OP == kCast) c[i] = e4m3_code(y); else r[i] = __fmul_rn(round_fp8<0>(y), sc);
        }
      }
    } else {  // NVFP4
      const float sb8 = nvfp4_sb8(a, s2);
      const float p = __fmul_rn(sb8, s2);
      const Divisor dp = make_divisor(p);
      if (OP == kCast && lane == 0) static_cast<uint8_t*>(args.scale)[b] = uint8_t(fp8_byte<0>(sb8));
#pragma unroll
      for (int i = 0; i < EPT; ++i) {
        const float y = divide(v[u][i], dp);
        if (OP == kCast) c[i] = e2m1_code(y); else r[i] = __fmul_rn(e2m1_round(y), p);
      }
    }

#pragma unroll
    for (int k = 0; k < NV; ++k) {
      const int64_t col = col0 + k * VEC;
      if (col >= args.C) continue;
      if (OP == kFake) {
        store_vec<T, VEC>(static_cast<T*>(args.out) + row * args.C + col, &r[k * VEC]);
      } else if (KIND == kFp8Block || (KIND == kMx && !E2M1)) {
        store_bytes<VEC>(static_cast<uint8_t*>(args.out) + row * args.C + col, &c[k * VEC]);
      } else {
        uint32_t pk[VEC / 2];
#pragma unroll
        for (int i = 0; i < VEC / 2; ++i) pk[i] = c[k * VEC + 2 * i] | (c[k * VEC + 2 * i + 1] << 4);
        store_bytes<VEC / 2>(static_cast<uint8_t*>(args.out) + row * args.OUTC + col / 2, pk);
      }
    }
  }
}

// 128 x 128 blocks over the last two dims of [L, M, K]: one CTA per block, 64 elements per thread
// in registers (P passes of 16-byte vectors), amax by warp shuffles + shared memory.
template <typename T, int KIND, int OP, bool STATIC, bool POW2>
__global__ void __launch_bounds__(kThreads) block2d_kernel(Args args) {
  constexpr int VEC = 16 / sizeof(T);
  constexpr int VPR = 128 / VEC;        // vectors per row
  constexpr int RPP = kThreads / VPR;   // rows per pass
  constexpr int P = 128 / RPP;          // passes
  __shared__ uint32_t red[kThreads / 32];

  const T* __restrict__ x = static_cast<const T*>(args.x);
  const int64_t blk = blockIdx.x;  // ((l * MB) + mb) * KB + kb
  const int64_t kb = blk % args.KB;
  const int64_t lm = blk / args.KB;
  const int64_t mb = lm % args.MB;
  const int64_t l = lm / args.MB;
  const int vr = threadIdx.x / VPR, vc = threadIdx.x % VPR;
  const int64_t col = kb * 128 + vc * VEC;
  const bool col_ok = col < args.K;

  float v[P][VEC];
#pragma unroll
  for (int p = 0; p < P; ++p) {
    const int64_t row = mb * 128 + p * RPP + vr;
    if (col_ok && row < args.M) {
      load_vec<T, VEC>(x + (l * args.M + row) * args.K + col, v[p]);
    } else {
#pragma unroll
      for (int i = 0; i < VEC; ++i) v[p][i] = 0.0f;
    }
  }
  uint32_t m = 0;
#pragma unroll
  for (int p = 0; p < P; ++p)
#pragma unroll
    for (int i = 0; i < VEC; ++i) m = max(m, f2u(v[p][i]) & 0x7FFFFFFFu);
  m = group_max<32>(m);
  if (threadIdx.x % 32 == 0) red[threadIdx.x / 32] = m;
  __syncthreads();
  m = red[0];
#pragma unroll
  for (int w = 1; w < kThreads / 32; ++w) m = max(m, red[w]);

  float a = u2f(m);
  if (STATIC) {
    a = __ldg(args.amax + blk);
    if (KIND == kInt && m > 0x7F800000u) a = u2f(0x7FC00000u);
  }
  float d = 0.0f;
  BlockDiv bd;
  IntGroup g;
  if (KIND == kInt) g = int_group(a, args.lo, args.hi);
  if (KIND == kFp8Block) {
    d = fp8_block_scale<POW2>(a, args.eps, 448.0f);
    bd = block_div<POW2>(d);
    if (OP == kCast && threadIdx.x == 0) static_cast<float*>(args.scale)[blk] = d;
  }
#pragma unroll
  for (int p = 0; p < P; ++p) {
    const int64_t row = mb * 128 + p * RPP + vr;
    if (!col_ok || row >= args.M) continue;
    const int64_t off = (l * args.M + row) * args.K + col;
    if (OP == kCast) {
      uint32_t c[VEC];
#pragma unroll
      for (int i = 0; i < VEC; ++i) c[i] = fp8_block_code<POW2>(v[p][i], bd, 448.0f);
      store_bytes<VEC>(static_cast<uint8_t*>(args.out) + off, c);
    } else {
      float r[VEC];
#pragma unroll
      for (int i = 0; i < VEC; ++i) {
        r[i] = KIND == kInt ? int_fake(v[p][i], g) : __fmul_rn(fp8_block_round<POW2, 0>(v[p][i], bd, 448.0f), d);
      }
      store_vec<T, VEC>(static_cast<T*>(args.out) + off, r);
    }
  }
}

// amax bits of |x| over the whole tensor into *out (zeroed first): NaN-propagating (NaN sorts high).
template <typename T>
__global__ void __launch_bounds__(kThreads) absmax_kernel(const T* __restrict__ x, int64_t nvec, uint32_t* out) {
  constexpr int VEC = 16 / sizeof(T);
  uint32_t m = 0;
  for (int64_t i = int64_t(blockIdx.x) * kThreads + threadIdx.x; i < nvec; i += int64_t(gridDim.x) * kThreads) {
    float v[VEC];
    load_vec<T, VEC>(x + i * VEC, v);
#pragma unroll
    for (int k = 0; k < VEC; ++k) m = max(m, f2u(v[k]) & 0x7FFFFFFFu);
  }
  m = group_max<32>(m);
  __shared__ uint32_t red[kThreads / 32];
  if (threadIdx.x % 32 == 0) red[threadIdx.x / 32] = m;
  __syncthreads();
  if (threadIdx.x == 0) {
    for (int w = 1; w < kThreads / 32; ++w) m = max(m, red[w]);
    m = max(m, red[0]);
    atomicMax(out, m);
  }
}

}  // namespace cuda
}  // namespace quantlib
