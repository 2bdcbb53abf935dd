"""One launch of each kernel named below at 8192 x 8192 bf16, for Nsight Compute (untuned first config).

``ncu --clock-control none --section SpeedOfLight --section LaunchStats --section Occupancy
--section WarpStateStats -k regex:'block1d|rowwise' python benchmarks/profile_kernels.py``
"""

import torch

from quantlib.formats import FormatSpec, Kind
from quantlib.kernels.backends import has_cuda_kernels, implementation
from quantlib.kernels.triton import _launch

_launch.TUNE_MIN_NUMEL = 1 << 62  # one config, no tuning launches
x = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
g = x.float().abs().amax()
row_amax = x.float().abs().amax(1, keepdim=True)
for be in (["cuda"] if has_cuda_kernels() else []) + ["triton"]:
    fq = implementation("fake_quant", be)
    fq(x, FormatSpec(Kind.FP8_BLOCK, element=(4, 3), block=(128,), dynamic=True), None)
    fq(x, FormatSpec(Kind.NVFP4, element=(2, 1), block=(16,)), g)
    fq(x, FormatSpec(Kind.INT, num_bits=4, block=(128,), dynamic=True), None)
    implementation("fp8_blockwise_cast", be)(x, (128,), 1e-10, False)
    implementation("nvfp4_cast", be)(x, g)
implementation("fake_quant", "triton")(x, FormatSpec(Kind.INT, num_bits=8), row_amax)
implementation("fake_quant", "triton")(x, FormatSpec(Kind.FP8, element=(4, 3)), g)
torch.cuda.synchronize()
