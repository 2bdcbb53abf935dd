// The cuda_* functions of quantlib._C, registered from the QUANTLIB_WITH_CUDA block of
// csrc/cpu/bindings.cpp through quantlib_cuda_bind(m).
#include <torch/extension.h>

#include "ops_cuda.h"

void quantlib_cuda_bind(pybind11::module_& m) {
  namespace py = pybind11;
  namespace qc = quantlib::cuda;
  using py::arg;
  const auto nogil = py::call_guard<py::gil_scoped_release>();
  m.def("cuda_fake_quant_fp8_blockwise", &qc::fake_quant_fp8_blockwise, nogil, arg("x"), arg("amax"), arg("block"),
        arg("eps"), arg("pow2"));
  m.def("cuda_fp8_blockwise_cast", &qc::fp8_blockwise_cast, nogil, arg("x"), arg("block"), arg("eps"), arg("pow2"));
  m.def("cuda_fp8_blockwise_cast_static", &qc::fp8_blockwise_cast_static, nogil, arg("x"), arg("amax"), arg("block"),
        arg("eps"), arg("pow2"));
  m.def("cuda_fake_quant_mx", &qc::fake_quant_mx, nogil, arg("x"), arg("e2m1"), arg("floor"));
  m.def("cuda_mx_cast", &qc::mx_cast, nogil, arg("x"), arg("e2m1"), arg("floor"));
  m.def("cuda_fake_quant_nvfp4", &qc::fake_quant_nvfp4, nogil, arg("x"), arg("global_amax"));
  m.def("cuda_nvfp4_cast", &qc::nvfp4_cast, nogil, arg("x"), arg("global_amax"));
  m.def("cuda_fake_quant_int_block", &qc::fake_quant_int_block, nogil, arg("x"), arg("amax"), arg("block"), arg("lo"),
        arg("hi"));
  m.def("cuda_fake_quant_int_row", &qc::fake_quant_int_row, nogil, arg("x"), arg("amax"), arg("lo"), arg("hi"));
  m.attr("cuda_int_row_max_vectors") = qc::kMaxRowVectors;
}
