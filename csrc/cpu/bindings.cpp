// The one Python module of quantlib's compiled kernels, quantlib._C. CPU kernels are `cpu_*`
// (csrc/cpu/ops.h); CUDA kernels (csrc/cuda) are added as `cuda_*` in the QUANTLIB_WITH_CUDA block.
// Kernels run without the GIL.
#include <torch/extension.h>

#include "ops.h"

namespace {

bool has_cuda() {
#ifdef QUANTLIB_WITH_CUDA
  return true;
#else
  return false;
#endif
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  namespace py = pybind11;
  namespace qc = quantlib::cpu;
  using py::arg;
  const auto nogil = py::call_guard<py::gil_scoped_release>();
  m.doc() = "quantlib compiled kernels (bit-exact to quantlib.formats)";

  m.def("has_cuda", &has_cuda, "Whether this build has the CUDA kernels.");

  // ------------------------------------------------------------------ CPU (csrc/cpu)
  m.def("cpu_block_amax", &qc::block_amax, nogil, arg("x"), arg("block"));
  m.def("cpu_fake_quant_int", &qc::fake_quant_int, nogil, arg("x"), arg("amax"), arg("block"), arg("dynamic"),
        arg("num_bits"), arg("unsigned"), arg("narrow_range"));
  m.def("cpu_fake_quant_fp8", &qc::fake_quant_fp8, nogil, arg("x"), arg("amax"), arg("element"), arg("dynamic"));
  m.def("cpu_fake_quant_fp8_blockwise", &qc::fake_quant_fp8_blockwise, nogil, arg("x"), arg("amax"), arg("block"),
        arg("element"), arg("eps"), arg("pow2"));
  m.def("cpu_fake_quant_mx", &qc::fake_quant_mx, nogil, arg("x"), arg("elem"), arg("block"), arg("floor"));
  m.def("cpu_fake_quant_nvfp4", &qc::fake_quant_nvfp4, nogil, arg("x"), arg("global_amax"), arg("block"), arg("block_amax") = py::none());
  m.def("cpu_fp8_blockwise_cast", &qc::fp8_blockwise_cast, nogil, arg("x"), arg("block"), arg("eps"), arg("pow2"),
        arg("element"));
  m.def("cpu_fp8_cast", &qc::fp8_cast, nogil, arg("x"), arg("scale"), arg("element"));
  m.def("cpu_mx_cast", &qc::mx_cast, nogil, arg("x"), arg("elem"), arg("block"), arg("floor"));
  m.def("cpu_nvfp4_cast", &qc::nvfp4_cast, nogil, arg("x"), arg("global_amax"), arg("block"), arg("block_amax") = py::none());
  m.def("cpu_isa", &qc::isa, "Instruction set the CPU kernels run with.");
  m.def("cpu_available_isas", &qc::available_isas, "Compiled variants this CPU runs, widest first.");
  m.def("cpu_set_isa", &qc::set_isa, arg("name"), "Pick a variant (tests compare each with the reference).");

#ifdef QUANTLIB_WITH_CUDA
  // ------------------------------------------------------------------ CUDA (csrc/cuda)
  // cuda_fake_quant_{fp8_blockwise,mx,nvfp4,int_block}, cuda_{fp8_blockwise,mx,nvfp4}_cast:
  // defined in csrc/cuda/bind_cuda.cu (ops in csrc/cuda/ops_cuda.h).
  void quantlib_cuda_bind(pybind11::module_ & m);
  quantlib_cuda_bind(m);
#endif
}
