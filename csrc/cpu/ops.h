// Tensor-level CPU kernels of quantlib._C (bit-exact to quantlib.formats). Inputs: float32, bfloat16
// or float16 CPU tensors of any rank and layout (made contiguous here); amax tensors of any float dtype.
#pragma once

#include <ATen/core/Tensor.h>

#include <optional>
#include <string>
#include <tuple>
#include <vector>

namespace quantlib {
namespace cpu {

// fp32 amax of every block ((B,) along the last dim, or (BM, BK) over the last two); NaN propagates.
at::Tensor block_amax(const at::Tensor& x, const std::vector<int64_t>& block);

// INT fake quant: no block -> `amax` broadcasts against x (per tensor / channel), or dynamic per row
// (last dim); with a block -> static block amax (shape of block_amax) or dynamic.
at::Tensor fake_quant_int(const at::Tensor& x, const std::optional<at::Tensor>& amax, const std::vector<int64_t>& block,
                          bool dynamic, int64_t num_bits, bool is_unsigned, bool narrow_range);

// FP8 (element (4, 3) or (5, 2)) fake quant: static broadcast amax, or dynamic per row.
at::Tensor fake_quant_fp8(const at::Tensor& x, const std::optional<at::Tensor>& amax, const std::vector<int64_t>& element,
                          bool dynamic);

// FP8 blockwise fake quant, static block amax or (none) dynamic.
at::Tensor fake_quant_fp8_blockwise(const at::Tensor& x, const std::optional<at::Tensor>& amax,
                                    const std::vector<int64_t>& block, const std::vector<int64_t>& element, double eps,
                                    bool pow2);

// MX fake quant, elem "e4m3", "e2m1", "e3m2", "e2m3" or "int8", blocks of `block` along the last dim.
at::Tensor fake_quant_mx(const at::Tensor& x, const std::string& elem, int64_t block, bool floor_rounding);

// NVFP4 fake quant; no global amax -> dynamic (the amax of x); one value, or one per row (broadcasting to
// x.shape[:-1] + (1,), e.g. (E, 1, 1) for stacked experts).
at::Tensor fake_quant_nvfp4(const at::Tensor& x, const std::optional<at::Tensor>& global_amax, int64_t block,
                            const std::optional<at::Tensor>& block_amax);

// FP8 codes (shape of x) and fp32 dequant scales d per block.
std::tuple<at::Tensor, at::Tensor> fp8_blockwise_cast(const at::Tensor& x, const std::vector<int64_t>& block, double eps,
                                                      bool pow2, const std::vector<int64_t>& element);

// FP8 codes (shape of x) of clamp(x * scale, -Q, Q): one fp32 quantization scale (Q / amax), or one per
// row of the last dim (x.shape[:-1] + (1,)).
at::Tensor fp8_cast(const at::Tensor& x, const at::Tensor& scale, const std::vector<int64_t>& element);

// MX codes (float8_e4m3fn, uint8 with two E2M1 per byte, uint8 FP6 codes or int8) and uint8 E8M0 bytes per block.
std::tuple<at::Tensor, at::Tensor> mx_cast(const at::Tensor& x, const std::string& elem, int64_t block,
                                           bool floor_rounding);

// Packed E2M1 (uint8), float8_e4m3fn block scales, fp32 global scale s2 (0-dim; with a global amax per row,
// of its shape).
std::tuple<at::Tensor, at::Tensor, at::Tensor> nvfp4_cast(const at::Tensor& x, const std::optional<at::Tensor>& global_amax,
                                                          int64_t block, const std::optional<at::Tensor>& block_amax);

// The instruction set the kernels run with ("avx512", "avx2" or "base"); set_isa picks one (tests
// compare every compiled variant with the reference) and raises where this CPU or build lacks it.
std::string isa();
std::vector<std::string> available_isas();
void set_isa(const std::string& name);

}  // namespace cpu
}  // namespace quantlib
