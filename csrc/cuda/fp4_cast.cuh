// Casts to packed E2M1 (NVFP4 blocks of 16, MXFP4 blocks of 32) of bfloat16 / float16 inputs whose rows
// hold whole blocks: what export runs, written to stay memory bound (the general block1d_kernel takes
// every other case and the fake quant). The same numbers as block1d_kernel, with fewer instructions:
//
// - one thread a block (2 or 4 contiguous 16-byte loads, one 8- or 16-byte store of codes): the block
//   amax needs no shuffle, and its scale is computed once, not once a lane;
// - a persistent grid walking the blocks, so that the per-thread setup (the global scale, the
//   reciprocal of 6 s2, NVFP4's divisor table) is paid once for many blocks;
// - NVFP4's divisor b = RN(sb8 * s2) and its reciprocal RN(1 / b) depend on the block only through the
//   E4M3 byte of sb8: a 128-entry table in shared memory, filled once a CTA, replaces a reciprocal
//   (a multi-instruction sequence with a slow-path branch) and its range checks per block;
// - E2M1 codes of eight elements packed into one word at once (e2m1_pack.cuh);
// - for bf16 NVFP4, x / b by one FMA correction instead of two (its codes are those of the correctly
//   rounded quotient: e2m1_pack.cuh's quotient_bf16, checked for every divisor mantissa);
// - with a dynamic global amax, the walk goes from the end of the tensor back, so that the part the
//   amax pass read last is still in L2 when the cast starts.
#pragma once

#include <type_traits>

#include "launch.cuh"

namespace quantlib {
namespace cuda {

struct Fp4Args {
  const uint4* x;      // 16-byte vectors
  uint32_t* codes;     // one word a vector (8 E2M1 nibbles)
  uint8_t* scale;      // one E4M3 / E8M0 byte a block
  const float* gamax;  // NVFP4: the global amax (1 element)
  float* s2;           // NVFP4: the global scale written (0-dim)
  int64_t blocks;
  int reverse;         // walk from the last block
};

constexpr int kFp4Threads = 256;

// Divisor of one NVFP4 block scale byte: b, RN(1 / b), and lim: 2^126 when b is in the range where
// the reciprocal division is exact ([2^-60, 2^60]), else -inf, so that a block is fast iff
// RN(m / b) < lim (make_divisor's test, with m its largest |x|).
QL_DEV float4 nvfp4_table_entry(uint32_t byte, float s2) {
  const float b = __fmul_rn(e4m3x2_value(byte).x, s2);
  const bool range = b >= kTwoM60 && b <= kTwo60;
  return make_float4(b, __frcp_rn(b), range ? kTwo126 : -INFINITY, 0.0f);
}

// y = x / b of an NVFP4 block on the fast path, as far as its E2M1 code goes: one correction for
// bfloat16 (e2m1_pack.cuh), the correctly rounded two-correction division for float16.
template <typename T>
QL_DEV float nvfp4_quotient(float x, const Divisor& d) {
  if (std::is_same<T, __nv_bfloat16>::value) return e2m1::quotient_bf16(x, d.b, d.y);
  return divide<true, false>(x, d);
}

// Codes of one 16-byte vector of a block on its fast path: y = x / b (NVFP4) or x * 2^-e (MX), no
// element NaN, the sign from x.
template <typename T, bool NV>
QL_DEV uint32_t fast_codes(const uint4& w, const Divisor& d, float mul) {
  uint32_t s[8];
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const float2 v = Elems<T>::pair(w, i);
    s[2 * i] = e2m1::point(NV ? nvfp4_quotient<T>(v.x, d) : __fmul_rn(v.x, mul));
    s[2 * i + 1] = e2m1::point(NV ? nvfp4_quotient<T>(v.y, d) : __fmul_rn(v.y, mul));
  }
  return e2m1::nibbles(s) | e2m1::signs16(w.x, w.y, w.z, w.w);
}

// NVFP4 codes of one vector of a block with NaN or Inf, or a divisor outside the fast range: IEEE
// divisions, NaN elements to code 0 (block1d_kernel's slow path).
template <typename T>
QL_DEV uint32_t slow_codes_nvfp4(const uint4& w, float b) {
  uint32_t out = 0;
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const float2 v = Elems<T>::pair(w, i);
    const uint32_t c = e2m1_code<true>(__fdiv_rn(v.x, b), v.x) | (e2m1_code<true>(__fdiv_rn(v.y, b), v.y) << 4);
    out |= c << (8 * i);
  }
  return out;
}

// fp32 bits of the largest |x| of V 16-byte vectors of 16-bit elements (NaN sorts high): the max of
// the 16-bit magnitudes first, widened once.
template <typename T, int V>
QL_DEV uint32_t absmax_bits16(const uint4 (&w)[V]) {
  constexpr uint32_t kAbs = 0x7FFF7FFFu;
  uint32_t m = 0;
#pragma unroll
  for (int k = 0; k < V; ++k) {
    m = __vmaxu2(m, __vmaxu2(__vmaxu2(w[k].x & kAbs, w[k].y & kAbs), __vmaxu2(w[k].z & kAbs, w[k].w & kAbs)));
  }
  const uint32_t m16 = max(m & 0xFFFFu, m >> 16);
  if (std::is_same<T, __half>::value) return f2u(__half2float(__ushort_as_half(static_cast<unsigned short>(m16))));
  return m16 << 16;
}

template <int N>
QL_DEV void store_words(uint32_t* p, const uint32_t (&c)[N]) {
  if (N == 4) *reinterpret_cast<uint4*>(p) = make_uint4(c[0], c[1], c[2], c[3]);
  else *reinterpret_cast<uint2*>(p) = make_uint2(c[0], c[1]);
}

// B elements a block (16 or 32: V = B / 8 vectors), NV: NVFP4, else MXFP4 (FLOOR: floor exponents).
// Each thread takes U blocks an iteration, all loaded before the first is used.
template <typename T, bool NV, bool FLOOR, int B>
__global__ void __launch_bounds__(kFp4Threads) fp4_cast_kernel(Fp4Args a) {
  constexpr int V = B / 8;
  constexpr int U = V == 2 ? 2 : 1;
  __shared__ float4 table[NV ? 128 : 1];
  float s2 = 1.0f;
  Divisor six_s2{};
  if (NV) {
    s2 = nvfp4_s2(__ldg(a.gamax));
    six_s2 = make_divisor(__fmul_rn(6.0f, s2), 0.0f);
    if (blockIdx.x == 0 && threadIdx.x == 0) *a.s2 = s2;
    if (threadIdx.x < 128) table[threadIdx.x] = nvfp4_table_entry(threadIdx.x, s2);
    __syncthreads();
  }
  // this thread's iterations, first to last or (reverse) last to first
  const int64_t stride = int64_t(gridDim.x) * kFp4Threads * U;
  const int64_t first = int64_t(blockIdx.x) * kFp4Threads * U + threadIdx.x;
  const int64_t n = first < a.blocks ? (a.blocks - 1 - first) / stride + 1 : 0;
  const int64_t step = a.reverse ? -stride : stride;
  int64_t i0 = a.reverse ? first + (n - 1) * stride : first;
  for (int64_t it = 0; it < n; ++it, i0 += step) {
    int64_t blk[U];
    uint4 w[U][V];
#pragma unroll
    for (int u = 0; u < U; ++u) {
      blk[u] = i0 + u * kFp4Threads < a.blocks ? i0 + u * kFp4Threads : -1;
      const uint4* p = a.x + (i0 + u * kFp4Threads) * V;
#pragma unroll
      for (int k = 0; k < V; ++k) w[u][k] = blk[u] >= 0 ? p[k] : make_uint4(0u, 0u, 0u, 0u);
    }
#pragma unroll
    for (int u = 0; u < U; ++u) {
      if (blk[u] < 0) continue;
      const uint32_t mb = absmax_bits16<T, V>(w[u]);
      const float m = u2f(mb);
      uint32_t c[V];
      uint32_t byte;
      if (NV) {
        // nvfp4_sb8's scale, its E4M3 byte taken directly (the byte of the rounded value is the same)
        const bool quick = six_s2.fast && __fmul_rn(m, six_s2.y) < kTwo126;
        float sb = quick ? divide<true, false>(m, six_s2) : __fdiv_rn(m, six_s2.b);
        sb = sb == 0.0f ? 1.0f : sb;
        byte = e4m3_byte(clamp_nan(sb, 0.001953125f, 448.0f));
        const float4 e = table[byte & 0x7Fu];
        Divisor d;
        d.b = e.x;
        d.nb = -e.x;
        d.y = e.y;
        d.fast = __fmul_rn(m, e.y) < e.z;
        if (d.fast) {
#pragma unroll
          for (int k = 0; k < V; ++k) c[k] = fast_codes<T, true>(w[u][k], d, 1.0f);
        } else {
#pragma unroll
          for (int k = 0; k < V; ++k) c[k] = slow_codes_nvfp4<T>(w[u][k], d.b);
        }
      } else {
        byte = uint32_t(e8m0_byte<FLOOR>(m, 6.0f, 2));
        const float mul = e8m0_inverse(int(byte));
        const bool finite = mb < 0x7F800000u;  // else every element is NaN over the NaN scale: code 0
#pragma unroll
        for (int k = 0; k < V; ++k) c[k] = finite ? fast_codes<T, false>(w[u][k], Divisor{}, mul) : 0u;
      }
      store_words<V>(a.codes + blk[u] * V, c);
      a.scale[blk[u]] = uint8_t(byte);
    }
  }
}

// amax bits of |x| over the whole tensor into *out (zeroed first): NaN-propagating (NaN sorts high).
// Four independent 16-byte loads a step, so that a thread keeps 64 bytes in flight; one atomic a CTA.
template <typename T>
__global__ void __launch_bounds__(kThreads) absmax_kernel(const uint4* __restrict__ x, int64_t nvec, uint32_t* out) {
  uint32_t m = 0;
  const int64_t stride = int64_t(gridDim.x) * kThreads;
  int64_t i = int64_t(blockIdx.x) * kThreads + threadIdx.x;
  for (; i + 3 * stride < nvec; i += 4 * stride) {
    const uint4 a = x[i], b = x[i + stride], c = x[i + 2 * stride], d = x[i + 3 * stride];
    m = max(max(m, max(Elems<T>::absmax_bits(a), Elems<T>::absmax_bits(b))), max(Elems<T>::absmax_bits(c), Elems<T>::absmax_bits(d)));
  }
  for (; i < nvec; i += stride) m = max(m, Elems<T>::absmax_bits(x[i]));
  __shared__ uint32_t red[kThreads / 32];
  m = warps_max(m, red, kThreads / 32);
  if (threadIdx.x == 0) atomicMax(out, m);
}

// Streaming multiprocessors of the current device (a cheap attribute query).
inline int64_t sm_count() {
  int n = 0;
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&n, cudaDevAttrMultiProcessorCount, c10::cuda::current_device()));
  return n > 0 ? n : 1;
}

// Whether fp4_cast_kernel takes x: 16-bit, rows of whole blocks of B.
inline bool fp4_cast_fits(const at::Tensor& x, int64_t B) {
  return x.element_size() == 2 && x.numel() > 0 && x.size(-1) % B == 0;
}

template <typename T, bool NV, bool FLOOR, int B>
void launch_fp4_cast_t(const Fp4Args& a) {
  static int per_sm = [] {
    int n = 0;
    C10_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&n, fp4_cast_kernel<T, NV, FLOOR, B>, kFp4Threads, 0));
    return n > 0 ? n : 1;
  }();
  constexpr int U = B == 16 ? 2 : 1;
  const int64_t want = (a.blocks + int64_t(kFp4Threads) * U - 1) / (int64_t(kFp4Threads) * U);
  const int64_t fill = sm_count() * per_sm;
  const unsigned grid = unsigned(want < fill ? want : fill);
  fp4_cast_kernel<T, NV, FLOOR, B><<<grid, kFp4Threads, 0, c10::cuda::getCurrentCUDAStream()>>>(a);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

template <bool NV, bool FLOOR, int B>
void launch_fp4_cast(const at::Tensor& x, Fp4Args a) {
  a.x = static_cast<const uint4*>(x.data_ptr());
  a.blocks = x.numel() / B;
  if (x.scalar_type() == at::kBFloat16) launch_fp4_cast_t<__nv_bfloat16, NV, FLOOR, B>(a);
  else launch_fp4_cast_t<__half, NV, FLOOR, B>(a);
}

}  // namespace cuda
}  // namespace quantlib
