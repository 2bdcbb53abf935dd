"""One launch of each kernel named below at 8192 x 8192 bf16, for Nsight Compute (untuned first config).

``ncu --clock-control none --csv --metrics gpu__time_duration.sum,dram__throughput.avg.pct_of_peak_sustained_elapsed,
sm__throughput.avg.pct_of_peak_sustained_elapsed,smsp__inst_executed.sum,launch__registers_per_thread,
sm__maximum_warps_per_active_cycle_pct -k regex:'block1d|block2d|row_int|rowwise|fp4_cast|absmax' python benchmarks/profile_kernels.py``

``smsp__inst_executed.sum`` counts warp instructions: times 32 over 2^26 elements it is the thread
instructions per element that benchmarks/RESULTS.md's profile table reports.
"""

import torch

from quantlib.formats import FormatSpec, Kind, Rounding
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
    fq(x, FormatSpec(Kind.INT, num_bits=8), row_amax)
    implementation("fp8_blockwise_cast", be)(x, (128,), 1e-10, False)
    implementation("fp8_blockwise_cast", be)(x, (128, 128), 1e-10, False)
    implementation("mx_cast", be)(x, "e2m1", 32, Rounding.RCEIL)
    implementation("nvfp4_cast", be)(x, g)
    implementation("nvfp4_cast", be)(x, None)  # the global amax pass, then the cast
implementation("fake_quant", "triton")(x, FormatSpec(Kind.FP8, element=(4, 3)), g)
torch.cuda.synchronize()
