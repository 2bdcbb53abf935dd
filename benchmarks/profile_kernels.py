"""One launch of a few kernels at 8192 x 8192 bf16 for Nsight Compute (untuned first config).

``ncu --clock-control none --section SpeedOfLight -k regex:block1d python benchmarks/profile_kernels.py``
"""

import torch

from quantlib.formats import Rounding
from quantlib.kernels.backends import has_cuda_kernels, implementation
from quantlib.kernels.triton import _launch

_launch.TUNE_MIN_NUMEL = 1 << 62  # one config, no tuning launches
x = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
for be in (["cuda"] if has_cuda_kernels() else []) + ["triton"]:
    implementation("fp8_blockwise_cast", be)(x, (128,), 1e-10, False)
    implementation("mx_cast", be)(x, "e4m3", 32, Rounding.RCEIL)
    implementation("nvfp4_cast", be)(x, x.float().abs().amax())
torch.cuda.synchronize()
