// INT fake quant of block formats (INT4 / INT8 blocks of 16..128 along the last dim, or 128 x 128).
#include "launch.cuh"
#include "ops_cuda.h"

namespace quantlib {
namespace cuda {
namespace {

template <bool STATIC>
void run(const at::Tensor& x, const Args& a, int64_t B, bool two_d) {
  if (two_d) return launch_2d<kInt, kFake, STATIC, false>(x, a);
  switch (B) {
    case 16: return launch_1d<kInt, kFake, 16, STATIC, false, false, false>(x, a);
    case 32: return launch_1d<kInt, kFake, 32, STATIC, false, false, false>(x, a);
    case 64: return launch_1d<kInt, kFake, 64, STATIC, false, false, false>(x, a);
    default: return launch_1d<kInt, kFake, 128, STATIC, false, false, false>(x, a);
  }
}

// row_int_kernel with nv (1, 2, 4 or 8) vectors a thread.
template <typename T, bool STATIC>
void launch_row_nv(const Args& a, int nv, int64_t grid, cudaStream_t stream) {
  switch (nv) {
    case 1: row_int_kernel<T, 1, STATIC><<<unsigned(grid), kThreads, 0, stream>>>(a); break;
    case 2: row_int_kernel<T, 2, STATIC><<<unsigned(grid), kThreads, 0, stream>>>(a); break;
    case 4: row_int_kernel<T, 4, STATIC><<<unsigned(grid), kThreads, 0, stream>>>(a); break;
    default: row_int_kernel<T, 8, STATIC><<<unsigned(grid), kThreads, 0, stream>>>(a); break;
  }
}

template <typename T>
void launch_row(const Args& a, int nv, int64_t grid, cudaStream_t stream) {
  if (a.amax) launch_row_nv<T, true>(a, nv, grid, stream);
  else launch_row_nv<T, false>(a, nv, grid, stream);
}

}  // namespace

at::Tensor fake_quant_int_block(const at::Tensor& x_, const std::optional<at::Tensor>& amax,
                                const std::vector<int64_t>& block, double lo, double hi) {
  const at::Tensor x = checked_input(x_, "fake_quant int (block)");
  c10::cuda::CUDAGuard guard(x.device());
  std::vector<int64_t> b = block;
  if (b.size() == 2 && b[0] == 1) b = {b[1]};
  const bool two_d = b.size() == 2;
  QL_CHECK((two_d && b[0] == 128 && b[1] == 128) || (!two_d && b.size() == 1 && (b[0] == 16 || b[0] == 32 || b[0] == 64 || b[0] == 128)),
              "fake_quant int (CUDA): block must be (16|32|64|128,) or (128, 128), got ", at::IntArrayRef(block));
  QL_CHECK(two_d || b[0] % vec_of(x) == 0, "fake_quant int (CUDA): block ", b[0], " is smaller than a vector");
  Args a = two_d ? args_2d(x) : args_1d(x, b[0]);
  at::Tensor keep;
  a.amax = static_amax(amax, two_d ? blocked_sizes(x, 128, 128) : blocked_sizes(x, 0, b[0]), keep);
  a.lo = float(lo);
  a.hi = float(hi);
  at::Tensor out = at::empty_like(x);
  a.out = out.data_ptr();
  if (a.amax) run<true>(x, a, two_d ? 0 : b[0], two_d);
  else run<false>(x, a, two_d ? 0 : b[0], two_d);
  return out;
}

at::Tensor fake_quant_int_row(const at::Tensor& x_, const std::optional<at::Tensor>& amax, double lo, double hi) {
  const at::Tensor x = checked_input(x_, "fake_quant int (per row)");
  c10::cuda::CUDAGuard guard(x.device());
  Args a = args_1d(x, x.size(-1));
  QL_CHECK(a.VR <= kMaxRowVectors, "fake_quant int (per row, CUDA): rows of ", a.C, " elements are longer than ",
              kMaxRowVectors * vec_of(x), "; the Triton backend takes them");
  at::Tensor keep;
  a.amax = static_amax(amax, {a.R}, keep);
  a.lo = float(lo);
  a.hi = float(hi);
  at::Tensor out = at::empty_like(x);
  a.out = out.data_ptr();
  if (a.R == 0) return out;
  int nv = 1;
  while (nv < 8 && int64_t(kThreads) * nv < a.VR) nv *= 2;
  a.TPR = kThreads;
  if (nv == 1) {  // short rows: several a CTA, a warp at least each
    a.TPR = 32;
    while (a.TPR < a.VR) a.TPR *= 2;
  }
  const int64_t grid = (a.R + kThreads / a.TPR - 1) / (kThreads / a.TPR);
  QL_CHECK(grid < (int64_t(1) << 31), "input too large");
  auto stream = c10::cuda::getCurrentCUDAStream();
  switch (x.scalar_type()) {
    case at::kFloat: launch_row<float>(a, nv, grid, stream); break;
    case at::kBFloat16: launch_row<__nv_bfloat16>(a, nv, grid, stream); break;
    default: launch_row<__half>(a, nv, grid, stream); break;
  }
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return out;
}

}  // namespace cuda
}  // namespace quantlib
