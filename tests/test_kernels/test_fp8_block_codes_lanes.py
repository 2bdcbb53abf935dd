"""The C++ FP8-block code loop (csrc/cpu/kernels_impl.h: AVX2 intrinsics, eight lanes, 32 codes per store, the
rest of a run by the scalar element function) byte for byte against the torch reference: blocks whose elements
span forty binades under their amax (normal, subnormal and zero codes, both signs), NaN / Inf / -0.0 blocks,
runs ending in a partial group of 32, every input dtype, in each compiled variant of the kernels."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("quantlib._C", reason="the C++ extension quantlib._C is not built")

from quantlib.kernels import cpu_impl as CPU, reference_impl as REF  # noqa: E402

from ._compare import assert_same  # noqa: E402
from .test_cpu_kernels import isa  # noqa: E402,F401 - the fixture: each compiled variant of the kernels


def wide_range(shape: tuple[int, int], dtype: torch.dtype, seed: int) -> torch.Tensor:
    """Random signs and mantissas times 2^e, e uniform in [-30, 10] (fp16: [-24, 10]); special values in a few blocks."""
    g = torch.Generator().manual_seed(seed)
    low = -24 if dtype == torch.float16 else -30
    e = torch.randint(low, 11, shape, generator=g).float()
    x = (torch.rand(shape, generator=g) + 1.0) * torch.exp2(e) * torch.where(torch.rand(shape, generator=g) < 0.5, -1.0, 1.0)
    x[0, :5] = torch.tensor([0.0, -0.0, 1e-45, -1e-40, 2.0**-149])
    x[1, 3] = float("nan")
    x[2, 7] = float("inf")
    x[3, :] = -x[3, :].abs().max()  # a row at -amax: codes of -Q
    return x.to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=lambda d: str(d).split(".")[1])
@pytest.mark.parametrize("block", [(1, 128), (128, 128), (1, 32), (1, 100), (16, 48)], ids=lambda b: "x".join(map(str, b)))
@pytest.mark.parametrize("pow2", [False, True])
@pytest.mark.usefixtures("isa")
def test_fp8_block_codes_equal_the_reference_bytes(dtype, block, pow2):
    for seed, shape in ((0, (256, 384)), (1, (130, 1000))):
        x = wide_range(shape, dtype, seed)
        codes, d = CPU.fp8_blockwise_cast(x, block, 1e-10, pow2)
        ref_codes, ref_d = REF.fp8_blockwise_cast(x, block, 1e-10, pow2)
        assert_same(d, ref_d, f"{block} {seed}")  # NaN scales of NaN blocks: payloads not compared
        ref = ref_codes.view(torch.uint8)
        ref = torch.where(torch.isnan(ref_codes.float()), torch.full_like(ref, 0x7F), ref)  # every NaN code is 0x7F (the NaN rule)
        assert torch.equal(codes.view(torch.uint8), ref), (block, seed, int((codes.view(torch.uint8) != ref).sum()))
        assert (codes.view(torch.uint8) == 0x7F).sum() > 0 and (codes.view(torch.uint8) & 0x7F).lt(8).sum() > 0  # NaN and subnormal codes
