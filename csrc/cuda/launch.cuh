// Host side of the CUDA kernels: argument checks, views and launches (shared by the *.cu files).
#pragma once

#include <ATen/ATen.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAFunctions.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include "../check.h"

#include <atomic>
#include <cstdint>
#include <optional>
#include <vector>

#include "block2d.cuh"
#include "qcuda.cuh"

namespace quantlib {
namespace cuda {

inline int vec_of(const at::Tensor& x) { return 16 / int(x.element_size()); }

// The contiguous input, checked: CUDA, fp32/bf16/fp16, last dim a whole number of 16-byte vectors.
inline at::Tensor checked_input(const at::Tensor& x, const char* op) {
  QL_CHECK(x.is_cuda(), op, ": expected a CUDA tensor");
  QL_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kHalf, op,
              ": input must be float32, bfloat16 or float16, got ", x.scalar_type());
  QL_CHECK(x.dim() >= 1, op, ": input must have rank >= 1");
  at::Tensor xc = x.contiguous();
  QL_CHECK(xc.size(-1) % vec_of(xc) == 0, op, ": the last dim (", xc.size(-1), ") must be a multiple of ",
              vec_of(xc), " for the CUDA kernels (16-byte vectors); the Triton backend takes any shape");
  QL_CHECK(reinterpret_cast<uintptr_t>(xc.data_ptr()) % 16 == 0, op, ": input must be 16-byte aligned");
  return xc;
}

inline std::vector<int64_t> blocked_sizes(const at::Tensor& x, int64_t bm, int64_t bk) {
  std::vector<int64_t> s(x.sizes().begin(), x.sizes().end());
  if (bm == 0) {
    s.back() = (s.back() + bk - 1) / bk;
  } else {
    s[s.size() - 2] = (s[s.size() - 2] + bm - 1) / bm;
    s.back() = (s.back() + bk - 1) / bk;
  }
  return s;
}

inline Args args_1d(const at::Tensor& x, int64_t B) {
  Args a{};
  a.x = x.data_ptr();
  a.C = x.size(-1);
  a.R = a.C ? x.numel() / a.C : 0;
  a.NB = (a.C + B - 1) / B;
  a.VR = a.C / vec_of(x);
  // row = b / NB as (b * ceil(2^44 / NB)) >> 44: exact when b * NB < 2^44 for every block b (the
  // error b * (M - 2^44 / NB) / 2^44 stays below 1 / NB); else a plain division.
  const double blocks = double(a.R) * double(a.NB);
  a.nb_magic = (a.NB >= 2 && blocks * double(a.NB) < 17592186044416.0) ? (uint64_t(1) << 44) / uint64_t(a.NB) + 1 : 0;
  return a;
}

inline Args args_2d(const at::Tensor& x) {
  QL_CHECK(x.dim() >= 2, "a 2-D block needs an input of rank >= 2");
  Args a{};
  a.x = x.data_ptr();
  a.M = x.size(-2);
  a.K = x.size(-1);
  a.L = (a.M && a.K) ? x.numel() / (a.M * a.K) : 0;
  a.MB = (a.M + 127) / 128;
  a.KB = (a.K + 127) / 128;
  return a;
}

inline const float* static_amax(const std::optional<at::Tensor>& amax, const std::vector<int64_t>& expect, at::Tensor& keep) {
  if (!amax.has_value()) return nullptr;
  keep = amax->to(at::kFloat).contiguous();
  QL_CHECK(keep.is_cuda(), "static amax must be on the input's device");
  QL_CHECK(keep.sizes().vec() == expect, "static block amax of shape ", keep.sizes(), " does not fit the input: expected ",
              at::IntArrayRef(expect));
  return keep.data_ptr<float>();
}

template <typename T, int KIND, int OP, int B, bool STATIC, bool POW2, bool E2M1, bool FLOOR>
void launch_1d_t(const Args& a) {
  constexpr int per_cta = Layout1d<T, B>::PER_CTA;
  const int64_t total = a.R * a.NB;
  if (total == 0) return;
  const int64_t grid = (total + per_cta - 1) / per_cta;
  QL_CHECK(grid < (int64_t(1) << 31), "input too large");
  auto stream = c10::cuda::getCurrentCUDAStream();
  if (a.C % B == 0) block1d_kernel<T, KIND, OP, B, STATIC, POW2, E2M1, FLOOR, true><<<unsigned(grid), kThreads, 0, stream>>>(a);
  else block1d_kernel<T, KIND, OP, B, STATIC, POW2, E2M1, FLOOR, false><<<unsigned(grid), kThreads, 0, stream>>>(a);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

template <int KIND, int OP, int B, bool STATIC, bool POW2, bool E2M1, bool FLOOR>
void launch_1d(const at::Tensor& x, const Args& a) {
  switch (x.scalar_type()) {
    case at::kFloat: return launch_1d_t<float, KIND, OP, B, STATIC, POW2, E2M1, FLOOR>(a);
    case at::kBFloat16: return launch_1d_t<__nv_bfloat16, KIND, OP, B, STATIC, POW2, E2M1, FLOOR>(a);
    default: return launch_1d_t<__half, KIND, OP, B, STATIC, POW2, E2M1, FLOOR>(a);
  }
}

template <typename T, int KIND, int OP, bool STATIC, bool POW2>
void launch_2d_t(const Args& a, int64_t grid) {
  constexpr int smem = block2d_smem_bytes<T>();
  auto kernel = block2d_kernel<T, KIND, OP, STATIC, POW2>;
  if constexpr (smem > 48 * 1024) {
    // past 48 KB (an fp32 block) a kernel must opt in to its dynamic shared memory, once on each device it runs on;
    // one bit a device (this instantiation's own) keeps the call off every later launch
    static std::atomic<uint64_t> opted{0};
    const int dev = c10::cuda::current_device();
    const uint64_t bit = dev < 64 ? uint64_t(1) << dev : 0;
    if (bit == 0 || !(opted.load(std::memory_order_acquire) & bit)) {
      C10_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
      opted.fetch_or(bit, std::memory_order_release);
    }
  }
  kernel<<<unsigned(grid), kThreads, smem, c10::cuda::getCurrentCUDAStream()>>>(a);
}

template <int KIND, int OP, bool STATIC, bool POW2>
void launch_2d(const at::Tensor& x, const Args& a) {
  const int64_t grid = a.L * a.MB * a.KB;
  if (grid == 0) return;
  QL_CHECK(grid < (int64_t(1) << 31), "input too large");
  switch (x.scalar_type()) {
    case at::kFloat: launch_2d_t<float, KIND, OP, STATIC, POW2>(a, grid); break;
    case at::kBFloat16: launch_2d_t<__nv_bfloat16, KIND, OP, STATIC, POW2>(a, grid); break;
    default: launch_2d_t<__half, KIND, OP, STATIC, POW2>(a, grid); break;
  }
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

// 1-element fp32 tensor holding the global amax of |x| (NaN if any NaN), computed on the device.
at::Tensor global_amax(const at::Tensor& x);

}  // namespace cuda
}  // namespace quantlib
