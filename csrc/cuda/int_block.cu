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

}  // namespace

at::Tensor fake_quant_int_block(const at::Tensor& x_, const std::optional<at::Tensor>& amax,
                                const std::vector<int64_t>& block, double lo, double hi) {
  const at::Tensor x = checked_input(x_, "fake_quant int (block)");
  c10::cuda::CUDAGuard guard(x.device());
  std::vector<int64_t> b = block;
  if (b.size() == 2 && b[0] == 1) b = {b[1]};
  const bool two_d = b.size() == 2;
  TORCH_CHECK((two_d && b[0] == 128 && b[1] == 128) || (!two_d && b.size() == 1 && (b[0] == 16 || b[0] == 32 || b[0] == 64 || b[0] == 128)),
              "fake_quant int (CUDA): block must be (16|32|64|128,) or (128, 128), got ", at::IntArrayRef(block));
  TORCH_CHECK(two_d || b[0] % vec_of(x) == 0, "fake_quant int (CUDA): block ", b[0], " is smaller than a vector");
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

}  // namespace cuda
}  // namespace quantlib
