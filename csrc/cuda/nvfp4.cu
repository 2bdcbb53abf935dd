// NVFP4: E2M1 elements in blocks of 16, E4M3 block scales, fp32 global scale (static or dynamic).
#include "fp4_cast.cuh"
#include "launch.cuh"
#include "ops_cuda.h"

namespace quantlib {
namespace cuda {

at::Tensor global_amax(const at::Tensor& x) {
  at::Tensor bits = at::zeros({1}, x.options().dtype(at::kInt));
  const int64_t nvec = x.numel() / vec_of(x);
  if (nvec > 0) {
    const int64_t want = (nvec + kThreads - 1) / kThreads;
    const int64_t fill = sm_count() * (2048 / kThreads);
    const unsigned grid = unsigned(want < fill ? want : fill);
    auto stream = c10::cuda::getCurrentCUDAStream();
    uint32_t* out = reinterpret_cast<uint32_t*>(bits.data_ptr<int32_t>());
    const uint4* vecs = static_cast<const uint4*>(x.data_ptr());
    switch (x.scalar_type()) {
      case at::kFloat: absmax_kernel<float><<<grid, kThreads, 0, stream>>>(vecs, nvec, out); break;
      case at::kBFloat16:
        absmax_kernel<__nv_bfloat16><<<grid, kThreads, 0, stream>>>(vecs, nvec, out);
        break;
      default: absmax_kernel<__half><<<grid, kThreads, 0, stream>>>(vecs, nvec, out); break;
    }
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }
  return bits.view(at::kFloat);
}

namespace {

at::Tensor global_of(const at::Tensor& x, const std::optional<at::Tensor>& global_amax_) {
  if (!global_amax_.has_value()) return global_amax(x);
  at::Tensor g = global_amax_->to(x.device(), at::kFloat).reshape({1}).contiguous();
  return g;
}

}  // namespace

at::Tensor fake_quant_nvfp4(const at::Tensor& x_, const std::optional<at::Tensor>& global_amax_) {
  const at::Tensor x = checked_input(x_, "fake_quant nvfp4");
  c10::cuda::CUDAGuard guard(x.device());
  Args a = args_1d(x, 16);
  at::Tensor g = global_of(x, global_amax_);
  a.gamax = g.data_ptr<float>();
  at::Tensor out = at::empty_like(x);
  a.out = out.data_ptr();
  launch_1d<kNvfp4, kFake, 16, false, false, false, false>(x, a);
  return out;
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> nvfp4_cast(const at::Tensor& x_, const std::optional<at::Tensor>& global_amax_) {
  const at::Tensor x = checked_input(x_, "nvfp4_cast");
  c10::cuda::CUDAGuard guard(x.device());
  Args a = args_1d(x, 16);
  at::Tensor g = global_of(x, global_amax_);
  a.gamax = g.data_ptr<float>();
  std::vector<int64_t> s(x.sizes().begin(), x.sizes().end());
  s.back() = (s.back() + 1) / 2;
  at::Tensor codes = at::empty(s, x.options().dtype(at::kByte));
  at::Tensor sb8 = at::empty(blocked_sizes(x, 0, 16), x.options().dtype(at::kFloat8_e4m3fn));
  at::Tensor s2 = at::empty({}, x.options().dtype(at::kFloat));
  a.out = codes.data_ptr();
  a.scale = sb8.data_ptr();
  a.s2 = s2.data_ptr<float>();
  if (x.numel() == 0) s2.fill_(1.0);
  if (fp4_cast_fits(x, 16)) {
    Fp4Args f{};
    f.codes = static_cast<uint32_t*>(a.out);
    f.scale = static_cast<uint8_t*>(a.scale);
    f.gamax = a.gamax;
    f.s2 = a.s2;
    f.reverse = !global_amax_.has_value();  // start where the amax pass ended (in L2)
    launch_fp4_cast<true, false, 16>(x, f);
    return {codes, sb8, s2};
  }
  launch_1d<kNvfp4, kCast, 16, false, false, false, false>(x, a);
  return {codes, sb8, s2};
}

}  // namespace cuda
}  // namespace quantlib
