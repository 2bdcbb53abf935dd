// Tensor-level CUDA kernels of quantlib._C (bound as cuda_* in csrc/cpu/bindings.cpp). Inputs: CUDA
// float32 / bfloat16 / float16 tensors of any rank (made contiguous) whose last dim is a multiple of
// 16 / element_size; quantlib/kernels/cuda_impl.py routes every other case to the Triton backend.
#pragma once

#include <ATen/core/Tensor.h>

#include <optional>
#include <tuple>
#include <vector>

namespace quantlib {
namespace cuda {

// FP8 (E4M3) blockwise, block (128,) or (128, 128): fake quant (static amax or dynamic) and cast.
at::Tensor fake_quant_fp8_blockwise(const at::Tensor& x, const std::optional<at::Tensor>& amax,
                                    const std::vector<int64_t>& block, double eps, bool pow2);
std::tuple<at::Tensor, at::Tensor> fp8_blockwise_cast(const at::Tensor& x, const std::vector<int64_t>& block, double eps,
                                                      bool pow2);
std::tuple<at::Tensor, at::Tensor> fp8_blockwise_cast_static(const at::Tensor& x, const std::optional<at::Tensor>& amax,
                                                             const std::vector<int64_t>& block, double eps, bool pow2);

// MXFP8 (e2m1 = false) / MXFP4, blocks of 32, rceil or floor exponents.
at::Tensor fake_quant_mx(const at::Tensor& x, bool e2m1, bool floor_rounding);
std::tuple<at::Tensor, at::Tensor> mx_cast(const at::Tensor& x, bool e2m1, bool floor_rounding);

// NVFP4, blocks of 16; no global amax -> dynamic.
at::Tensor fake_quant_nvfp4(const at::Tensor& x, const std::optional<at::Tensor>& global_amax);
std::tuple<at::Tensor, at::Tensor, at::Tensor> nvfp4_cast(const at::Tensor& x, const std::optional<at::Tensor>& global_amax);

// INT block fake quant, block (16|32|64|128,) or (128, 128), static amax or dynamic; codes in [lo, hi].
at::Tensor fake_quant_int_block(const at::Tensor& x, const std::optional<at::Tensor>& amax,
                                const std::vector<int64_t>& block, double lo, double hi);

// INT fake quant with one group a row (the last dim): static amax of R elements, or dynamic per row.
// Rows of at most kMaxRowVectors 16-byte vectors (16384 16-bit or 8192 fp32 elements).
constexpr int64_t kMaxRowVectors = 2048;
at::Tensor fake_quant_int_row(const at::Tensor& x, const std::optional<at::Tensor>& amax, double lo, double hi);

}  // namespace cuda
}  // namespace quantlib
