"""The FP8-block and MXFP8 codes of every compiled variant of the C++ kernels (the AVX2 eight-lane and AVX-512
sixteen-lane intrinsic loops, the plain loop) over every bf16 bit pattern and a million fp32 ones, bit for
bit against the torch reference: the divisions, the clamp, the NaN rule, the subnormal steps and the
narrowing to bytes of the vector loops, at the scales a block's own amax gives and at scales that clip."""

from __future__ import annotations

import pytest
import torch

C = pytest.importorskip("quantlib._C", reason="the C++ extension quantlib._C is not built")

from quantlib.formats import Rounding  # noqa: E402
from quantlib.formats.fp8_blockwise import fp8_blockwise_quantize  # noqa: E402
from quantlib.kernels import reference_impl as REF  # noqa: E402

from ._compare import assert_same  # noqa: E402

ISAS = tuple(C.cpu_available_isas())


@pytest.fixture(params=ISAS)
def isa(request):
    C.cpu_set_isa(request.param)
    yield request.param
    C.cpu_set_isa(ISAS[0])


def bf16_layouts() -> dict[str, torch.Tensor]:
    """The 65536 bf16 bit patterns (NaN and Inf among them) in three layouts of 128-wide rows: one exponent a
    row (codes near the format's max), eight exponents a row (normal and subnormal codes), and 128 exponents
    a row (most codes subnormal or zero); the blocks holding Inf or NaN take the format's rules."""
    x = torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)
    eight = x.reshape(2, 32, 8, 8, 16).permute(0, 1, 3, 2, 4).reshape(512, 128)  # sign, exponent group, mantissa group
    return {"one_exponent": x.reshape(512, 128), "eight_exponents": eight, "all_exponents": x.reshape(512, 128).t().contiguous()}


def fp32_bits(n: int = 2**20, seed: int = 0) -> torch.Tensor:
    """``n`` finite fp32 values of random bits, exponents drawn over 2^-40..2^19 (and 1 in 97 anywhere:
    subnormals and zeros), [n / 256, 256]."""
    g = torch.Generator().manual_seed(seed)
    mant = torch.randint(0, 2**23, (n,), generator=g, dtype=torch.int64)
    exp = torch.randint(127 - 40, 127 + 20, (n,), generator=g, dtype=torch.int64)
    exp[::97] = torch.randint(0, 255, exp[::97].shape, generator=g)
    sign = torch.randint(0, 2, (n,), generator=g, dtype=torch.int64) << 31
    return (sign | (exp << 23) | mant).to(torch.uint32).view(torch.int32).view(torch.float32).reshape(-1, 256)


def raw(cast: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
    """The codes as their bytes, the rest as is: assert_same takes any NaN for any NaN (NaN payloads differ
    between torch's own paths and devices), but the sign of MXFP8's NaN code is fp8_code's rule, which the
    lanes must keep, and on x86 the reference's division gives the same NaN as the kernels'."""
    return (cast[0].view(torch.uint8), *cast[1:])


def check(x: torch.Tensor, block: tuple[int, int], element: tuple[int, int], pow2: bool, what: str) -> None:
    got = C.cpu_fp8_blockwise_cast(x, list(block), 1e-10, pow2, list(element))
    assert_same(raw(got), raw(fp8_blockwise_quantize(x, block, element, 1e-10, pow2)), what)


@pytest.mark.parametrize("element", [(4, 3), (5, 2)], ids=["e4m3", "e5m2"])
@pytest.mark.parametrize("block", [(1, 128), (128, 128), (1, 32), (16, 16)], ids=lambda b: "x".join(map(str, b)))
def test_every_bf16_pattern(block, element, isa):
    for name, x in bf16_layouts().items():
        check(x, block, element, False, f"{isa} {block} {name}")


@pytest.mark.parametrize("pow2", [False, True])
@pytest.mark.parametrize("block", [(1, 128), (128, 128)], ids=lambda b: "x".join(map(str, b)))
def test_random_fp32_bits(block, pow2, isa):
    x = fp32_bits()
    check(x, block, (4, 3), pow2, f"{isa} {block}")
    check(x[:, 3:250], block, (4, 3), pow2, f"{isa} {block} partial blocks")  # rows of 247: vector loops with scalar tails


@pytest.mark.parametrize("rounding", [Rounding.RCEIL, Rounding.FLOOR], ids=lambda r: r.value)
def test_mxfp8_codes(rounding, isa):
    """MXFP8's codes (a power-of-two scale; a NaN's code keeps its sign) in the same loops."""
    xs = dict(bf16_layouts(), fp32=fp32_bits(), fp32_tails=fp32_bits()[:, 3:250])
    nan = fp32_bits().reshape(-1)  # NaN blocks: a NaN of either sign in 1 of 1001 elements
    nan.view(torch.int32)[::1001] = 0x7FC00000
    nan.view(torch.int32)[500::1001] = torch.tensor(0xFFC00000, dtype=torch.int64).to(torch.int32)
    xs["fp32_nan"] = nan.reshape(-1, 256)
    for name, x in xs.items():
        got = C.cpu_mx_cast(x, "e4m3", 32, rounding == Rounding.FLOOR)
        assert_same(raw(got), raw(REF.mx_cast(x, "e4m3", 32, rounding)), f"{isa} {name}")
