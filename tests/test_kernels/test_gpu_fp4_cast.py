"""The CUDA FP4 cast kernel (csrc/cuda/fp4_cast.cuh: nvfp4_cast and mx_cast MXFP4 of bf16 / fp16 rows
of whole blocks) against the reference, bit for bit, on its every path: several grid-stride rounds
(forward, and backward after a dynamic global amax), partial last rounds, blocks with NaN / Inf (MX: all
codes 0; NVFP4: the per-element division), NVFP4 divisors above 2^60 (table entries off the fast
path), and the one-correction quotient of bf16 inputs near every E2M1 threshold.
"""

from __future__ import annotations

import pytest
import torch

from quantlib.formats import Rounding
from quantlib.kernels import reference_impl as R

from ._compare import assert_same_all

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

DTYPES = (torch.bfloat16, torch.float16)
# rows of whole blocks of 32 (both kernels take them); 1024 x 7168 takes more than one round of the
# persistent grid on an H200
SHAPES = ((1, 32), (3, 64), (4099, 32), (2, 5, 96), (1024, 7168))


def _cuda(op: str):
    from quantlib.kernels.backends import has_cuda_kernels, implementation

    if not has_cuda_kernels():
        pytest.skip("the CUDA extension is not built")
    return implementation(op, "cuda")


def _input(shape, dtype, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g) * torch.exp2(torch.randint(-12, 12, shape, generator=g).float())
    rows = x.view(-1, shape[-1])
    if rows.shape[0] > 8:
        rows[1] *= 1e-6  # tiny blocks (block scale clamped at 2^-9)
        rows[2, 5] = float("nan")
        rows[3, 40 % shape[-1]] = float("inf")
        rows[4, 7] = float("-inf")
        rows[5] = 0.0
        rows[6, :16] = -0.0
    return x.to(dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_fp4_casts_match_the_reference(shape, dtype):
    mx, nv = _cuda("mx_cast"), _cuda("nvfp4_cast")
    x = _input(shape, dtype, seed=sum(shape))
    xc = x.cuda()
    for rd in (Rounding.RCEIL, Rounding.FLOOR):
        assert_same_all(mx(xc, "e2m1", 32, rd), R.mx_cast(x, "e2m1", 32, rd), f"mx {rd} {shape}")
    finite = x.float().nan_to_num(0.0, 0.0, 0.0).abs().amax()
    for g in (None, torch.tensor(30.0), finite, torch.tensor(1e30)):  # dynamic, static, static above 2^60 / 448
        assert_same_all(nv(xc, None if g is None else g.cuda()), R.nvfp4_cast(x, g), f"nvfp4 {g} {shape}")


def test_bf16_quotients_at_every_threshold():
    """bf16 dividends whose quotients straddle each E2M1 threshold by a bf16 ulp, in blocks whose amax
    gives them the block scale they were made for, over many global scales (many divisors
    b = sb8 * s2): the one-correction quotient must give the reference's codes."""
    nv = _cuda("nvfp4_cast")
    t = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0])
    g = torch.Generator().manual_seed(3)
    for _ in range(40):
        A = float(torch.rand((), generator=g) * 1000 + 1)
        s2 = A / 2688.0
        blocks = []
        for sb in torch.tensor([448.0, 1.0, 0.5, 3.0, 104.0, 0.015625, 0.002]).to(torch.float8_e4m3fn).float().tolist():
            b = float(torch.tensor(sb, dtype=torch.float32) * torch.tensor(s2, dtype=torch.float32))
            x = (t * b).to(torch.bfloat16)
            bits = x.view(torch.int16)
            x = torch.cat([x, (bits + 1).view(torch.bfloat16), (bits - 1).view(torch.bfloat16)])  # 21 values
            amax = torch.tensor(6.0 * b).to(torch.bfloat16)
            for part in (x[:15], x[15:]):
                blk = torch.cat([amax.reshape(1), part, torch.zeros(15 - part.numel(), dtype=x.dtype)])
                blocks += [blk, -blk]
        x = torch.stack(blocks).contiguous()
        assert_same_all(nv(x.cuda(), torch.tensor(A).cuda()), R.nvfp4_cast(x, torch.tensor(A)), f"A={A}")
