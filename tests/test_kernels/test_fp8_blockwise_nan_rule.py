"""FP8 blockwise casts write every NaN code as 0x7F, whatever the sign of the NaN (docs/numerics.md):
a block whose amax is NaN is 0x7F throughout, an Inf element of an Inf block (Inf / Inf) is 0x7F.

The reference wrote 0xFF for elements whose quotient was a negative NaN (a -NaN input, or the
hardware's default NaN) and 0x7F for the rest. The Triton kernels' copy of this test runs in
tests/kernels/test_triton_kernels.py (under the interpreter); the GPU one needs a CUDA device.
"""

from __future__ import annotations

import pytest
import torch

from quantlib import kernels

NAN, INF = float("nan"), float("inf")


def nan_rule_input(block: tuple[int, int], dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Rows of 256 (two blocks along the last dim): block column 0 of block row 0 holds +NaN and -NaN,
    block column 1 of the last block row holds +Inf and -Inf; everything else is finite."""
    rows = 4 if block[0] == 1 else 2 * block[0]
    x = torch.randn(rows, 256, generator=torch.Generator().manual_seed(3))
    x[0, 5], x[block[0] - 1, 77] = NAN, -NAN
    x[-1, 130], x[-1, 131] = INF, -INF
    return x.to(dtype)


def assert_nan_rule(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, block: tuple[int, int]) -> None:
    """The NaN block is 0x7F everywhere with a NaN scale; the Inf elements are 0x7F; nothing else is NaN."""
    b = codes.cpu().view(torch.uint8)
    bm = block[0]
    nan_block = b[:bm, :128]
    assert (nan_block == 0x7F).all(), f"NaN block bytes {sorted(set(nan_block.flatten().tolist()))}"
    assert torch.isnan(scales.cpu()[0, 0])
    assert b[-1, 130] == 0x7F and b[-1, 131] == 0x7F
    isnan = torch.isnan(codes.cpu().float())
    assert (b[isnan] == 0x7F).all()
    assert int(isnan.sum()) == nan_block.numel() + 2


def _cases():
    return [pytest.param(blk, dt, id=f"{'x'.join(map(str, blk))}-{str(dt)[6:]}") for blk in ((1, 128), (128, 128))
            for dt in (torch.float32, torch.bfloat16)]


@pytest.mark.parametrize("backend", ["reference", "cpu"])
@pytest.mark.parametrize("block, dtype", _cases())
def test_nan_block_codes_are_0x7f_for_every_element(backend, block, dtype):
    x = nan_rule_input(block, dtype)
    codes, scales = kernels.fp8_blockwise_cast(x, block, backend=backend)
    assert_nan_rule(x, codes, scales, block)


@pytest.mark.parametrize("backend", ["reference", "cpu"])
def test_negative_nan_alone_gives_0x7f(backend):
    x = torch.ones(1, 128)
    x[0, 0] = -NAN
    codes, _ = kernels.fp8_blockwise_cast(x, (1, 128), backend=backend)
    assert (codes.view(torch.uint8) == 0x7F).all()


@pytest.mark.parametrize("backend", ["reference", "cpu"])
def test_fake_quant_of_a_nan_block_is_nan_and_others_unchanged(backend):
    """The rule is about code bytes: fake quantization keeps NaN exactly in the NaN block."""
    from quantlib.formats import FormatSpec, Kind

    x = nan_rule_input((1, 128))
    spec = FormatSpec(Kind.FP8_BLOCK, element=(4, 3), block=(128,), dynamic=True)
    out = kernels.fake_quant(x, spec, None, backend=backend)
    assert torch.isnan(out[0, :128]).all() and torch.isnan(out[-1, 128:]).all()
    assert not torch.isnan(out[1:-1]).any()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("backend", ["triton", "cuda"])
@pytest.mark.parametrize("block, dtype", _cases())
def test_nan_block_codes_are_0x7f_for_every_element_on_the_gpu(backend, block, dtype):
    from quantlib.kernels.backends import has_cuda_kernels

    if backend == "cuda" and not has_cuda_kernels():
        pytest.skip("the CUDA extension is not built")
    x = nan_rule_input(block, dtype)
    codes, scales = kernels.fp8_blockwise_cast(x.cuda(), block, backend=backend)
    assert_nan_rule(x, codes, scales, block)
