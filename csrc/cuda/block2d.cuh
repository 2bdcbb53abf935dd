// The 128 x 128 block kernel (FP8 blockwise 2-D, the DeepSeek / TE weight recipe): one CTA per block of
// the last two dims of [L, M, K], the block's amax, scale and cast fused in one pass over device memory.
#pragma once

#include "qcuda.cuh"

namespace quantlib {
namespace cuda {

// Copies 16 bytes from global to shared memory without passing through registers (cp.async, sm_80+),
// or writes zeros when !ok. Older GPUs load and store.
QL_DEV void copy16_async(uint4* smem, const uint4* gmem, bool ok) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  const unsigned dst = static_cast<unsigned>(__cvta_generic_to_shared(smem));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(gmem), "r"(ok ? 16 : 0) : "memory");
#else
  *smem = ok ? *gmem : make_uint4(0u, 0u, 0u, 0u);
#endif
}

// Waits for this thread's copy16_async copies (which only this thread reads back: no barrier needed).
QL_DEV void wait_copies() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm volatile("cp.async.wait_all;\n" ::: "memory");
#endif
}

// Bytes of dynamic shared memory block2d_kernel<T> takes: the whole 128 x 128 block.
template <typename T>
__host__ __device__ constexpr int block2d_smem_bytes() { return 128 * 128 * int(sizeof(T)); }

// The block travels to shared memory by cp.async, each thread's P vectors in flight at once without
// holding a register: holding them (64 elements a thread) took 72 registers, 3 CTAs an SM, too few bytes
// in flight for HBM3e; in shared memory (32 KB a bf16 block) 6 CTAs fit. Thread t's vector p sits at
// tile[p * kThreads + t], so a warp's shared reads are 512 contiguous bytes (no bank conflict).
// The amax: warp shuffles + shared memory. A static amax other than INT's needs no block reduction (no
// barrier): the largest |x| then only chooses the reciprocal or the division, which give the same bits,
// so each thread chooses for its own elements. INT keeps it: a NaN anywhere in its group makes the whole
// group NaN.
template <typename T, int KIND, int OP, bool STATIC, bool POW2>
__global__ void __launch_bounds__(kThreads) block2d_kernel(Args args) {
  using S = BlockScale<KIND, POW2, false, false>;
  constexpr int VEC = 16 / sizeof(T);
  constexpr int VPR = 128 / VEC;        // vectors per row
  constexpr int RPP = kThreads / VPR;   // rows per pass
  constexpr int P = 128 / RPP;          // passes
  static_assert(P * kThreads * 16 == block2d_smem_bytes<T>(), "the tile is the whole block");
  extern __shared__ uint4 tile[];
  __shared__ uint32_t red[kThreads / 32];

  const uint4* __restrict__ x = static_cast<const uint4*>(args.x);
  const int64_t blk = blockIdx.x;  // ((l * MB) + mb) * KB + kb
  const int64_t kb = blk % args.KB;
  const int64_t lm = blk / args.KB;
  const int64_t mb = lm % args.MB;
  const int64_t l = lm / args.MB;
  const int vr = threadIdx.x / VPR, vc = threadIdx.x % VPR;
  const int64_t vrow = args.K / VEC;
  const int64_t v = kb * VPR + vc;  // this thread's vector within its rows
  const bool col_ok = v < vrow;
  const int64_t base = (l * args.M + mb * 128 + vr) * vrow + v;  // vector of pass 0, in vectors
  const int64_t rows_left = args.M - mb * 128 - vr;               // passes p with p * RPP < rows_left are rows

  constexpr bool LOCAL = STATIC && KIND != kInt;
  const float a_static = LOCAL ? __ldg(args.amax + blk) : 0.0f;  // in flight with the copies below
#pragma unroll
  for (int p = 0; p < P; ++p) {
    const bool ok = col_ok && p * RPP < rows_left;
    copy16_async(tile + p * kThreads + threadIdx.x, ok ? x + base + int64_t(p) * RPP * vrow : x, ok);
  }
  wait_copies();
  uint32_t m = 0;
#pragma unroll
  for (int p = 0; p < P; ++p) m = max(m, Elems<T>::absmax_bits(tile[p * kThreads + threadIdx.x]));
  if (!LOCAL) m = warps_max(m, red, kThreads / 32);

  const float a = LOCAL ? a_static : group_amax<KIND, STATIC>(args.amax, blk, m);
  const S s(a, u2f(m), args.eps, args.lo, args.hi, Divisor{}, 1.0f);
  if (OP == kCast && threadIdx.x == 0) static_cast<uint32_t*>(args.scale)[blk] = s.stored;
  if (!col_ok) return;
#pragma unroll
  for (int p = 0; p < P; ++p) {
    if (p * RPP >= rows_left) break;
    const int64_t off = base + int64_t(p) * RPP * vrow;
    uint4 w = tile[p * kThreads + threadIdx.x];
    uint32_t code[2];
    quantize_vec<T, OP>(s, w, code);
    if (OP == kCast) store_code_bytes<VEC>(static_cast<uint8_t*>(args.out) + off * VEC, code);
    else static_cast<uint4*>(args.out)[off] = w;
  }
}

}  // namespace cuda
}  // namespace quantlib
