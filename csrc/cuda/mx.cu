// MXFP8 / MXFP4: blocks of 32, E8M0 shared exponent (rceil or floor), fused amax + exponent + cast.
#include "fp4_cast.cuh"
#include "launch.cuh"
#include "ops_cuda.h"

namespace quantlib {
namespace cuda {
namespace {

template <int OP>
void run(const at::Tensor& x, const Args& a, bool e2m1, bool floor_rounding) {
  if (e2m1 && floor_rounding) launch_1d<kMx, OP, 32, false, false, true, true>(x, a);
  else if (e2m1) launch_1d<kMx, OP, 32, false, false, true, false>(x, a);
  else if (floor_rounding) launch_1d<kMx, OP, 32, false, false, false, true>(x, a);
  else launch_1d<kMx, OP, 32, false, false, false, false>(x, a);
}

}  // namespace

at::Tensor fake_quant_mx(const at::Tensor& x_, bool e2m1, bool floor_rounding) {
  const at::Tensor x = checked_input(x_, "fake_quant mx");
  c10::cuda::CUDAGuard guard(x.device());
  Args a = args_1d(x, 32);
  at::Tensor out = at::empty_like(x);
  a.out = out.data_ptr();
  run<kFake>(x, a, e2m1, floor_rounding);
  return out;
}

std::tuple<at::Tensor, at::Tensor> mx_cast(const at::Tensor& x_, bool e2m1, bool floor_rounding) {
  const at::Tensor x = checked_input(x_, "mx_cast");
  c10::cuda::CUDAGuard guard(x.device());
  Args a = args_1d(x, 32);
  at::Tensor scales = at::empty(blocked_sizes(x, 0, 32), x.options().dtype(at::kByte));
  at::Tensor codes;
  if (e2m1) {
    std::vector<int64_t> s(x.sizes().begin(), x.sizes().end());
    s.back() = (s.back() + 1) / 2;
    codes = at::empty(s, x.options().dtype(at::kByte));
  } else {
    codes = at::empty(x.sizes(), x.options().dtype(at::kFloat8_e4m3fn));
  }
  a.out = codes.data_ptr();
  a.scale = scales.data_ptr();
  if (e2m1 && fp4_cast_fits(x, 32)) {
    Fp4Args f{};
    f.codes = static_cast<uint32_t*>(a.out);
    f.scale = static_cast<uint8_t*>(a.scale);
    if (floor_rounding) launch_fp4_cast<false, true, 32>(x, f);
    else launch_fp4_cast<false, false, 32>(x, f);
    return {codes, scales};
  }
  run<kCast>(x, a, e2m1, floor_rounding);
  return {codes, scales};
}

}  // namespace cuda
}  // namespace quantlib
