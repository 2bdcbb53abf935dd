"""The C++ FP8 code loops of the FP8-block and MXFP8 casts (csrc/cpu/fp8_lanes.h: AVX2 eight lanes, AVX-512
sixteen, 32 codes per store, the rest of a run by the scalar element function) byte for byte against the torch
reference, in each compiled variant of the kernels: blocks whose elements span forty binades under their amax
(normal, subnormal and zero codes, both signs), NaN / Inf / -0.0 blocks, runs ending in a partial group of 32,
every input dtype; every bf16 bit pattern in three layouts; a million fp32 bit patterns."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("quantlib._C", reason="the C++ extension quantlib._C is not built")

from quantlib._C import cpu_fp8_blockwise_cast, cpu_mx_cast  # noqa: E402
from quantlib.formats import Rounding  # noqa: E402
from quantlib.formats.fp8_blockwise import fp8_blockwise_quantize  # noqa: E402
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
    got = cpu_fp8_blockwise_cast(x, list(block), 1e-10, pow2, list(element))
    assert_same(raw(got), raw(fp8_blockwise_quantize(x, block, element, 1e-10, pow2)), what)


@pytest.mark.parametrize("element", [(4, 3), (5, 2)], ids=["e4m3", "e5m2"])
@pytest.mark.parametrize("block", [(1, 128), (128, 128), (1, 32), (16, 16)], ids=lambda b: "x".join(map(str, b)))
@pytest.mark.usefixtures("isa")
def test_every_bf16_pattern(block, element):
    for name, x in bf16_layouts().items():
        check(x, block, element, False, f"{block} {name}")


@pytest.mark.parametrize("pow2", [False, True])
@pytest.mark.parametrize("block", [(1, 128), (128, 128)], ids=lambda b: "x".join(map(str, b)))
@pytest.mark.usefixtures("isa")
def test_random_fp32_bits(block, pow2):
    x = fp32_bits()
    check(x, block, (4, 3), pow2, f"{block}")
    check(x[:, 3:250], block, (4, 3), pow2, f"{block} partial blocks")  # rows of 247: vector loops with scalar tails


@pytest.mark.parametrize("rounding", [Rounding.RCEIL, Rounding.FLOOR], ids=lambda r: r.value)
@pytest.mark.usefixtures("isa")
def test_mxfp8_codes(rounding):
    """MXFP8's codes (a power-of-two scale; a NaN's code keeps its sign) in the same loops."""
    xs = dict(bf16_layouts(), fp32=fp32_bits(), fp32_tails=fp32_bits()[:, 3:250])
    nan = fp32_bits().reshape(-1)  # NaN blocks: a NaN of either sign in 1 of 1001 elements
    nan.view(torch.int32)[::1001] = 0x7FC00000
    nan.view(torch.int32)[500::1001] = torch.tensor(0xFFC00000, dtype=torch.int64).to(torch.int32)
    xs["fp32_nan"] = nan.reshape(-1, 256)
    for name, x in xs.items():
        got = cpu_mx_cast(x, "e4m3", 32, rounding == Rounding.FLOOR)
        assert_same(raw(got), raw(REF.mx_cast(x, "e4m3", 32, rounding)), f"{name}")
