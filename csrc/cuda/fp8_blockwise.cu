// FP8 blockwise (1x128 and 128x128, the DeepSeek / TE recipe): fused block amax + scale + E4M3 cast.
#include "launch.cuh"
#include "ops_cuda.h"

namespace quantlib {
namespace cuda {
namespace {

bool is_2d(const std::vector<int64_t>& block) {
  if (block.size() == 1 && block[0] == 128) return false;
  if (block.size() == 2 && block[0] == 1 && block[1] == 128) return false;
  QL_CHECK(block.size() == 2 && block[0] == 128 && block[1] == 128,
              "fp8_blockwise (CUDA): block must be (128,) or (128, 128), got ", at::IntArrayRef(block));
  return true;
}

template <int OP, bool STATIC, bool POW2>
void run(const at::Tensor& x, bool two_d, Args& a) {
  if (two_d) launch_2d<kFp8Block, OP, STATIC, POW2>(x, a);
  else launch_1d<kFp8Block, OP, 128, STATIC, POW2, false, false>(x, a);
}

}  // namespace

at::Tensor fake_quant_fp8_blockwise(const at::Tensor& x_, const std::optional<at::Tensor>& amax,
                                    const std::vector<int64_t>& block, double eps, bool pow2) {
  const at::Tensor x = checked_input(x_, "fake_quant fp8_block");
  c10::cuda::CUDAGuard guard(x.device());
  const bool two_d = is_2d(block);
  Args a = two_d ? args_2d(x) : args_1d(x, 128);
  at::Tensor keep;
  a.amax = static_amax(amax, two_d ? blocked_sizes(x, 128, 128) : blocked_sizes(x, 0, 128), keep);
  a.eps = float(eps);
  at::Tensor out = at::empty_like(x);
  a.out = out.data_ptr();
  const bool st = a.amax != nullptr;
  if (st && pow2) run<kFake, true, true>(x, two_d, a);
  else if (st) run<kFake, true, false>(x, two_d, a);
  else if (pow2) run<kFake, false, true>(x, two_d, a);
  else run<kFake, false, false>(x, two_d, a);
  return out;
}

std::tuple<at::Tensor, at::Tensor> fp8_blockwise_cast(const at::Tensor& x_, const std::vector<int64_t>& block, double eps,
                                                      bool pow2) {
  return fp8_blockwise_cast_static(x_, std::nullopt, block, eps, pow2);
}

// With a static amax (an exported quantizer's calibrated one) the kernel reads each block's amax
// instead of reducing the block: same single pass, no comparison on the host.
std::tuple<at::Tensor, at::Tensor> fp8_blockwise_cast_static(const at::Tensor& x_, const std::optional<at::Tensor>& amax,
                                                             const std::vector<int64_t>& block, double eps, bool pow2) {
  const at::Tensor x = checked_input(x_, "fp8_blockwise_cast");
  c10::cuda::CUDAGuard guard(x.device());
  const bool two_d = is_2d(block);
  Args a = two_d ? args_2d(x) : args_1d(x, 128);
  at::Tensor keep;
  const std::vector<int64_t> grid = two_d ? blocked_sizes(x, 128, 128) : blocked_sizes(x, 0, 128);
  a.amax = static_amax(amax, grid, keep);
  a.eps = float(eps);
  at::Tensor codes = at::empty(x.sizes(), x.options().dtype(at::kFloat8_e4m3fn));
  at::Tensor scale = at::empty(grid, x.options().dtype(at::kFloat));
  a.out = codes.data_ptr();
  a.scale = scale.data_ptr();
  const bool st = a.amax != nullptr;
  if (st && pow2) run<kCast, true, true>(x, two_d, a);
  else if (st) run<kCast, true, false>(x, two_d, a);
  else if (pow2) run<kCast, false, true>(x, two_d, a);
  else run<kCast, false, false>(x, two_d, a);
  return {codes, scale};
}

}  // namespace cuda
}  // namespace quantlib
