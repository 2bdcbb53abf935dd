"""The C++ CPU kernels (quantlib._C, backend "cpu") bit for bit against the torch reference.

Every op and format on a grid of shapes and dtypes, each compiled instruction-set variant of the
kernels (baseline x86-64, AVX2, AVX-512: whichever this CPU runs), the edge cases of docs/design.md §3
(zero, NaN, Inf, subnormals, power-of-two boundaries, partial blocks, non-contiguous inputs) and a
hypothesis fuzz. "Bit for bit" means: same dtype and shape, NaN at the same places, identical bits
everywhere else (-0.0 differs from 0.0); NaN payloads are not compared (torch's own vectorized and
scalar paths disagree on them).
"""

from __future__ import annotations

import pytest
import torch

C = pytest.importorskip("quantlib._C", reason="the C++ extension quantlib._C is not built")

from hypothesis import given, settings, strategies as st  # noqa: E402

from quantlib import kernels  # noqa: E402
from quantlib.formats import FormatSpec, Kind, Rounding  # noqa: E402
from quantlib.kernels import cpu_impl as CPU, reference_impl as REF  # noqa: E402

from ._compare import assert_same, assert_same_all  # noqa: E402,F401

NAN, INF = float("nan"), float("inf")
DTYPES = (torch.float32, torch.bfloat16, torch.float16)
ISAS = tuple(C.cpu_available_isas())


@pytest.fixture(params=ISAS)
def isa(request):
    """Run the test with one compiled variant of the kernels, then go back to the widest."""
    C.cpu_set_isa(request.param)
    yield request.param
    C.cpu_set_isa(ISAS[0])


# --------------------------------------------------------------------------- comparison


def check_fake_quant(x: torch.Tensor, spec: FormatSpec, amax: torch.Tensor | None = None, what: str = "") -> torch.Tensor:
    got = CPU.fake_quant(x, spec, amax)
    assert_same(got, REF.fake_quant(x, spec, amax), what or f"{spec}")
    return got


# --------------------------------------------------------------------------- inputs

# Values at the edges of the formats: zeros, subnormals (fp32, fp16, E4M3), powers of two, E4M3 / E2M1
# grid points and midpoints, the largest finite values.
SPECIALS = [0.0, -0.0, 1e-45, -3e-44, 1e-39, 2.0**-126, 2.0**-24, -(2.0**-25), 2.0**-14, 2.0**-10, 2.0**-9, 2.0**-7, 2.0**-6,
            0.25, -0.75, 1.25, 1.75, -2.5, 3.5, 5.0, 6.0, 1.0, -1.0, 3.0, 448.0, -448.0, 464.0, 480.0, 0.0625, 240.0, 57344.0, 65504.0]


def sample(shape: tuple[int, ...], dtype: torch.dtype = torch.float32, seed: int = 0, scale: float = 3.0) -> torch.Tensor:
    """Normal values times ``scale`` with SPECIALS at random places and a zero run at the start."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g) * scale
    flat = x.view(-1)
    n = flat.numel()
    if n >= 4:
        k = min(len(SPECIALS), n // 2)
        idx = torch.randperm(n, generator=g)[:k]
        flat[idx] = torch.tensor(SPECIALS[:k]) * (scale / 3.0 if scale < 1 else 1.0)
        flat[: min(n // 4, 20)] = 0.0
    return x.to(dtype)


def _scaled(a: torch.Tensor, f: float) -> torch.Tensor:
    return (a.float() * f).contiguous()


def amax_tensor(x):
    return _scaled(x.float().abs().amax(), 0.8)


def amax_rows(x):  # per channel along dim 0 (weights), keepdim shape
    return _scaled(x.float().abs().amax(dim=tuple(range(1, x.dim())), keepdim=True), 0.9)


def amax_last(x):  # per channel along the last dim (activations)
    return _scaled(x.float().abs().amax(dim=tuple(range(x.dim() - 1)), keepdim=True), 1.1)


def amax_blocks(block):
    def fn(x):
        a = _scaled(REF.block_amax(x, block), 0.9).view(-1)
        a[0] = 0.0  # an all-zero group (INT gives zeros, blockwise falls back to eps)
        if a.numel() > 2:
            a[1] = 2.0**-25  # below TINY_AMAX
        return a.view(REF.block_amax(x, block).shape)

    return fn


def amax_global(x):
    return _scaled(x.float().abs().amax(), 0.5)


INT, FP8, FPB, MX, NV = Kind.INT, Kind.FP8, Kind.FP8_BLOCK, Kind.MX, Kind.NVFP4
E4M3, E5M2, E2M1 = (4, 3), (5, 2), (2, 1)

# (id, spec, amax from x or None, rank needed)
FAKE_QUANT_CASES = [
    ("int8_tensor", FormatSpec(INT, 8), amax_tensor, 1),
    ("int8_full_range_rows", FormatSpec(INT, 8, narrow_range=False), amax_rows, 1),
    ("uint4_last", FormatSpec(INT, 4, unsigned=True), amax_last, 1),
    ("int16_tensor", FormatSpec(INT, 16), amax_tensor, 1),
    ("int8_dynamic_row", FormatSpec(INT, 8, dynamic=True), None, 1),
    ("int4_dynamic_block16", FormatSpec(INT, 4, block=(16,), dynamic=True), None, 1),
    ("int4_static_block16", FormatSpec(INT, 4, block=(16,)), amax_blocks((16,)), 1),
    ("int4_dynamic_block8x16", FormatSpec(INT, 4, block=(8, 16), dynamic=True), None, 2),
    ("int8_static_block4x8", FormatSpec(INT, 8, block=(4, 8)), amax_blocks((4, 8)), 2),
    ("fp8_e4m3_tensor", FormatSpec(FP8, element=E4M3), amax_tensor, 1),
    ("fp8_e5m2_rows", FormatSpec(FP8, element=E5M2), amax_rows, 1),
    ("fp8_e4m3_last", FormatSpec(FP8, element=E4M3), amax_last, 1),
    ("fp8_e4m3_dynamic_row", FormatSpec(FP8, element=E4M3, dynamic=True), None, 1),
    ("fp8_e5m2_dynamic_row", FormatSpec(FP8, element=E5M2, dynamic=True), None, 1),
    ("fp8blk_1x32", FormatSpec(FPB, element=E4M3, block=(32,), dynamic=True), None, 1),
    ("fp8blk_1x16_as_2d", FormatSpec(FPB, element=E4M3, block=(1, 16), dynamic=True), None, 2),
    ("fp8blk_16x16_pow2", FormatSpec(FPB, element=E4M3, block=(16, 16), dynamic=True, pow2=True), None, 2),
    ("fp8blk_e5m2_static_1x16", FormatSpec(FPB, element=E5M2, block=(16,)), amax_blocks((16,)), 1),
    ("fp8blk_big_eps", FormatSpec(FPB, element=E4M3, block=(8,), dynamic=True, eps=0.5), None, 1),
    ("fp8blk_static_pow2_8x8", FormatSpec(FPB, element=E4M3, block=(8, 8), pow2=True), amax_blocks((8, 8)), 2),
    ("mxfp8_rceil", FormatSpec(MX, element=E4M3, block=(32,)), None, 1),
    ("mxfp8_floor", FormatSpec(MX, element=E4M3, block=(32,), rounding=Rounding.FLOOR), None, 1),
    ("mxfp4_rceil", FormatSpec(MX, element=E2M1, block=(32,)), None, 1),
    ("mxfp4_floor", FormatSpec(MX, element=E2M1, block=(32,), rounding=Rounding.FLOOR), None, 1),
    ("mxfp4_block16", FormatSpec(MX, element=E2M1, block=(16,)), None, 1),
    ("nvfp4_dynamic", FormatSpec(NV, element=E2M1, block=(16,)), None, 1),
    ("nvfp4_static", FormatSpec(NV, element=E2M1, block=(16,)), amax_global, 1),
]
SHAPES = [(7,), (3, 40), (5, 33), (2, 9, 50), (33, 17)]


def _amax(fn, x):
    return None if fn is None else fn(x)


# --------------------------------------------------------------------------- the grid


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).split(".")[1])
@pytest.mark.parametrize("case", FAKE_QUANT_CASES, ids=lambda c: c[0])
def test_fake_quant_matches_reference(case, dtype, isa):
    name, spec, amax_fn, rank = case
    for shape in SHAPES:
        if len(shape) >= rank:
            x = sample(shape, dtype, seed=len(shape) * 31 + shape[-1])
            check_fake_quant(x, spec, _amax(amax_fn, x), f"{name} {dtype} {shape} {isa}")


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).split(".")[1])
@pytest.mark.parametrize("block", [(1, 32), (16, 16), (32,), (128, 128)], ids=lambda b: "x".join(map(str, b)))
@pytest.mark.parametrize("pow2", [False, True])
def test_fp8_blockwise_cast_matches_reference(block, pow2, dtype, isa):
    x = sample((40, 70), dtype, seed=3)
    assert_same(CPU.fp8_blockwise_cast(x, block, 1e-10, pow2), REF.fp8_blockwise_cast(x, block, 1e-10, pow2), f"{block} {pow2}")


@pytest.mark.parametrize("block", [(1, 32), (128, 128)], ids=lambda b: "x".join(map(str, b)))
def test_fp8_blockwise_cast_static_amax_matches_reference(block, isa):
    x = sample((40, 70), torch.bfloat16, seed=4)
    own = REF.block_amax(x, block)
    for amax in (own, own * 2.0, own * 0.5):  # the cast's own scales, then the formula's
        assert_same(CPU.fp8_blockwise_cast(x, block, 1e-10, False, amax), REF.fp8_blockwise_cast(x, block, 1e-10, False, amax), f"{block}")
    with pytest.raises(ValueError, match="static amax of shape"):
        kernels.fp8_blockwise_cast(x, block, amax=torch.ones(7, 7))


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).split(".")[1])
@pytest.mark.parametrize("elem", ["e4m3", "e2m1"])
@pytest.mark.parametrize("rounding", [Rounding.RCEIL, Rounding.FLOOR], ids=lambda r: r.value)
@pytest.mark.parametrize("shape", [(3, 64), (5, 45), (2, 3, 33), (31,)], ids=lambda s: "x".join(map(str, s)))
def test_mx_cast_matches_reference(elem, rounding, dtype, shape, isa):
    x = sample(shape, dtype, seed=4)
    assert_same(CPU.mx_cast(x, elem, 32, rounding), REF.mx_cast(x, elem, 32, rounding), f"{elem} {rounding}")


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).split(".")[1])
@pytest.mark.parametrize("global_amax", [None, 2.5, 0.0, 1e-30, 1e6], ids=lambda a: f"A={a}")
@pytest.mark.parametrize("shape", [(4, 48), (3, 37), (17,)], ids=lambda s: "x".join(map(str, s)))
def test_nvfp4_cast_matches_reference(global_amax, dtype, shape, isa):
    x = sample(shape, dtype, seed=5)
    a = None if global_amax is None else torch.tensor(global_amax)
    assert_same(CPU.nvfp4_cast(x, a), REF.nvfp4_cast(x, a), f"A={global_amax}")


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).split(".")[1])
@pytest.mark.parametrize("block", [(16,), (32,), (5,), (8, 16), (3, 7), (128, 128)], ids=lambda b: "x".join(map(str, b)))
def test_block_amax_matches_reference(block, dtype, isa):
    x = sample((2, 19, 45), dtype, seed=6)
    x[0, 0, 3] = NAN
    x[1, 5, 40] = -INF
    assert_same(CPU.block_amax(x, block), REF.block_amax(x, block), f"{block}")


# --------------------------------------------------------------------------- edge cases


ALL_OPS_INPUT_SHAPE = (6, 64)


def _check_every_op(x: torch.Tensor, what: str) -> None:
    """fake_quant of every case plus every cast on ``x``."""
    for name, spec, amax_fn, _ in FAKE_QUANT_CASES:
        check_fake_quant(x, spec, _amax(amax_fn, x), f"{what}: {name}")
    for args in [((1, 32), 1e-10, False), ((16, 16), 1e-10, True)]:
        assert_same(CPU.fp8_blockwise_cast(x, *args), REF.fp8_blockwise_cast(x, *args), f"{what}: fp8_blockwise_cast {args}")
    for elem in ("e4m3", "e2m1"):
        for rounding in Rounding:
            assert_same(CPU.mx_cast(x, elem, 32, rounding), REF.mx_cast(x, elem, 32, rounding), f"{what}: mx_cast {elem} {rounding}")
    assert_same(CPU.nvfp4_cast(x, None), REF.nvfp4_cast(x, None), f"{what}: nvfp4_cast")
    assert_same(CPU.block_amax(x, (16,)), REF.block_amax(x, (16,)), f"{what}: block_amax")


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).split(".")[1])
def test_all_zero_block(dtype, isa):
    x = sample(ALL_OPS_INPUT_SHAPE, dtype, seed=7)
    x[:, :32] = 0.0
    x[2, :32] = -0.0
    _check_every_op(x, "zero blocks")
    _check_every_op(torch.zeros(ALL_OPS_INPUT_SHAPE, dtype=dtype), "all zero")


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).split(".")[1])
def test_nan_block(dtype, isa):
    x = sample(ALL_OPS_INPUT_SHAPE, dtype, seed=8)
    x[1, 3] = NAN
    x[4, 40] = -NAN
    _check_every_op(x, "NaN")
    # NaN makes its group NaN: the block for blocks, the row for per-row, the channel, the tensor.
    out = check_fake_quant(x, FormatSpec(INT, 4, block=(16,), dynamic=True))
    assert out[1, :16].isnan().all() and not out[1, 16:].isnan().any()
    assert check_fake_quant(x, FormatSpec(INT, 8), amax_tensor(x)).isnan().all()


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).split(".")[1])
def test_inf_block(dtype, isa):
    x = sample(ALL_OPS_INPUT_SHAPE, dtype, seed=9)
    x[0, 5] = INF
    x[3, 50] = -INF
    _check_every_op(x, "Inf")
    # An infinite static amax, too.
    check_fake_quant(x, FormatSpec(INT, 8), torch.tensor(INF))
    check_fake_quant(x, FormatSpec(FP8, element=E4M3), torch.tensor(INF))
    check_fake_quant(x, FormatSpec(NV, element=E2M1, block=(16,)), torch.tensor(INF))


def test_nan_static_amax(isa):
    x = sample((5, 40), seed=10)
    for spec in (FormatSpec(INT, 8), FormatSpec(FP8, element=E4M3), FormatSpec(NV, element=E2M1, block=(16,))):
        check_fake_quant(x, spec, torch.tensor(NAN), f"{spec.kind} NaN amax")
    a = amax_rows(x)
    a[2] = NAN
    check_fake_quant(x, FormatSpec(INT, 8), a, "int NaN channel amax")
    check_fake_quant(x, FormatSpec(FP8, element=E5M2), a, "fp8 NaN channel amax")


def test_nan_in_one_channel_of_static_per_channel_int(isa):
    x = sample((6, 50), seed=11)
    x[2, 7] = NAN
    out = check_fake_quant(x, FormatSpec(INT, 8), amax_rows(x))
    assert out[2].isnan().all() and not out[[0, 1, 3, 4, 5]].isnan().any()
    out = check_fake_quant(x, FormatSpec(INT, 8), amax_last(x))
    assert out[:, 7].isnan().all() and out.isnan().sum() == 6


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).split(".")[1])
def test_subnormal_inputs(dtype, isa):
    tiny = {torch.float32: 2.0**-140, torch.bfloat16: 2.0**-130, torch.float16: 2.0**-20}[dtype]
    x = (sample(ALL_OPS_INPUT_SHAPE, seed=12) * tiny).to(dtype)
    assert (x.float().abs() < torch.finfo(dtype).tiny).any()  # really subnormal in its own dtype
    _check_every_op(x, "subnormal")
    _check_every_op((sample(ALL_OPS_INPUT_SHAPE, seed=13, scale=1e-3)).to(dtype), "E4M3 subnormal range")


def _grid_with_neighbours(values: list[float]) -> torch.Tensor:
    v = torch.tensor(values, dtype=torch.float32)
    up = torch.nextafter(v, torch.full_like(v, INF))
    down = torch.nextafter(v, torch.full_like(v, -INF))
    return torch.cat([v, up, down, -v, -up, -down])


def test_pow2_boundaries(isa):
    # Block amax at powers of two, one ulp either side: E8M0 rceil / floor, pow2 ceil, NVFP4 scales.
    powers = [2.0**e for e in range(-140, 128, 3)] + [448.0 * 2.0**e for e in range(-20, 20)] + [6.0 * 2.0**e for e in range(-20, 20)]
    amaxes = _grid_with_neighbours(powers).abs()
    x = sample((amaxes.numel(), 32), seed=14).clamp(-1, 1) * amaxes[:, None]
    x[:, 0] = amaxes  # each row's amax exactly
    for spec in (FormatSpec(MX, element=E4M3, block=(32,)), FormatSpec(MX, element=E2M1, block=(32,), rounding=Rounding.FLOOR),
                 FormatSpec(FPB, element=E4M3, block=(32,), dynamic=True, pow2=True), FormatSpec(NV, element=E2M1, block=(16,)),
                 FormatSpec(INT, 8, dynamic=True), FormatSpec(FP8, element=E4M3, dynamic=True)):
        check_fake_quant(x, spec, None if spec.kind != NV else torch.tensor(1.0), f"{spec}")
    for rounding in Rounding:
        assert_same(CPU.mx_cast(x, "e4m3", 32, rounding), REF.mx_cast(x, "e4m3", 32, rounding), f"mx_cast {rounding}")
    assert_same(CPU.fp8_blockwise_cast(x, (32,), 1e-10, True), REF.fp8_blockwise_cast(x, (32,), 1e-10, True), "pow2")


@pytest.mark.parametrize("eps", [1e-45, 1e-40], ids=lambda e: f"eps={e}")
def test_pow2_of_subnormal_scale(eps, isa):
    # An eps below MIN_EPS (which configs and the public API refuse, but the reference defines) lets
    # d = max(a, eps) / Q be subnormal, or underflow to 0 (pow2 then gives 2^-149).
    x = sample((8, 64), seed=28) * 2.0**-130
    x[0] = 0.0
    x[1, :32] = 2.0**-149
    for block in [(32,), (4, 16)]:
        spec = FormatSpec(FPB, element=E4M3, block=block, dynamic=True, pow2=True, eps=eps)
        check_fake_quant(x, spec, what=f"{block} eps={eps}")
        assert_same(CPU.fp8_blockwise_cast(x, block, eps, True), REF.fp8_blockwise_cast(x, block, eps, True), f"cast {block}")
    d = CPU.fp8_blockwise_cast(x, (32,), eps, True)[1]
    assert (d < 2.0**-126).any()  # the subnormal scales really occur


def _e4m3_grid() -> list[float]:
    codes = torch.arange(0, 0x7F, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    mids = ((codes[1:] + codes[:-1]) / 2).tolist()
    return codes.tolist() + mids


def test_e4m3_cast_equals_torch_cast(isa):
    # d = 1 in every block (its first element is 448), so the codes are cast_rne(x) itself: every
    # E4M3 grid point and midpoint, one fp32 ulp either side, subnormals.
    v = _grid_with_neighbours(_e4m3_grid() + [448.0, 2.0**-10, 2.0**-11, 3 * 2.0**-11, 1e-45]).clamp(-448, 448)
    pad = (-v.numel()) % 31
    body = torch.cat([v, torch.zeros(pad)]).view(-1, 31)
    x = torch.cat([torch.full((body.shape[0], 1), 448.0), body], dim=1)
    codes, d = CPU.fp8_blockwise_cast(x, (32,), 1e-10, False)
    assert torch.equal(d, torch.ones_like(d))
    assert_same(codes, torch.clamp(x, -448, 448).to(torch.float8_e4m3fn), "vs torch cast")
    assert_same((codes, d), REF.fp8_blockwise_cast(x, (32,), 1e-10, False), "vs reference")
    # Saturation: per-tensor FP8 with amax = Q has s = 1, so fake quant is float(cast(clamp(x))).
    sat = torch.cat([x.view(-1), torch.tensor([460.0, 464.0, 470.0, 1e4, 3e38, INF, -INF, -1e4, -464.0])])
    out = check_fake_quant(sat, FormatSpec(FP8, element=E4M3), torch.tensor(448.0))
    assert_same(out, torch.clamp(sat, -448, 448).to(torch.float8_e4m3fn).float(), "saturation vs torch cast")
    # E5M2 through fake quant (codes * d with d = 1).
    x5 = torch.cat([torch.full((body.shape[0], 1), 57344.0), body * 64], dim=1)
    check_fake_quant(x5, FormatSpec(FPB, element=E5M2, block=(32,), dynamic=True))


def test_every_bf16_value(isa):
    # All 65,536 bf16 bit patterns (NaN, Inf, subnormals included) in blocks of 32.
    x = torch.arange(-32768, 32768, dtype=torch.int32).to(torch.int16).view(torch.bfloat16).reshape(-1, 32)
    _check_every_op(x.reshape(-1, 64), "every bf16")


def test_e2m1_ties_to_even(isa):
    # MX E2M1 with a block amax of 6 has scale 1: the elements are the E2M1 rounding of x itself.
    points = [0.0, 0.25, 0.5, 0.75, 1.0, 1.25, 1.5, 1.75, 2.0, 2.5, 3.0, 3.5, 4.0, 5.0, 6.0]
    v = _grid_with_neighbours(points).clamp(-6, 6)
    pad = (-v.numel()) % 31
    x = torch.cat([torch.full((-(-v.numel() // 31), 1), 6.0), torch.cat([v, torch.zeros(pad)]).view(-1, 31)], dim=1)
    codes, scales = CPU.mx_cast(x, "e2m1", 32, Rounding.RCEIL)
    assert torch.equal(scales, torch.full_like(scales, 127))
    assert_same((codes, scales), REF.mx_cast(x, "e2m1", 32, Rounding.RCEIL))
    check_fake_quant(x, FormatSpec(MX, element=E2M1, block=(32,)))
    check_fake_quant(x, FormatSpec(NV, element=E2M1, block=(16,)), torch.tensor(6.0 * 448.0))


@pytest.mark.parametrize("shape", [(3, 1), (2, 15), (4, 17), (2, 33), (5, 127), (129, 3), (130, 131)], ids=lambda s: "x".join(map(str, s)))
def test_partial_last_block(shape, isa):
    x = sample(shape, seed=15)
    for block in [(16,), (32,), (128,), (16, 16), (128, 128), (3, 5)]:
        assert_same(CPU.block_amax(x, block), REF.block_amax(x, block), f"amax {block}")
        assert_same(CPU.fp8_blockwise_cast(x, block, 1e-10, False), REF.fp8_blockwise_cast(x, block, 1e-10, False), f"{block}")
        check_fake_quant(x, FormatSpec(INT, 4, block=block, dynamic=True), what=f"int {block}")
        check_fake_quant(x, FormatSpec(INT, 4, block=block), amax_blocks(block)(x), f"static int {block}")
    for elem in ("e4m3", "e2m1"):
        assert_same(CPU.mx_cast(x, elem, 32, Rounding.RCEIL), REF.mx_cast(x, elem, 32, Rounding.RCEIL), f"mx {elem}")
    assert_same(CPU.nvfp4_cast(x, None), REF.nvfp4_cast(x, None), "nvfp4")


def _non_contiguous(x: torch.Tensor) -> list[torch.Tensor]:
    """Views equal to ``x``: column-major, a strided last dim, rows with a gap after each."""
    views = [x.transpose(-1, -2).contiguous().transpose(-1, -2), torch.stack([x, x], dim=-1)[..., 0],
             torch.cat([x, x], dim=-1)[..., : x.shape[-1]]]
    for v in views:
        assert not v.is_contiguous()
        assert_same(v, x)
    return views


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).split(".")[1])
def test_non_contiguous_matches_contiguous(dtype, isa):
    x = sample((6, 64), dtype, seed=16)
    for v in _non_contiguous(x):
        for name, spec, amax_fn, _ in FAKE_QUANT_CASES:
            a = _amax(amax_fn, x)
            got = CPU.fake_quant(v, spec, a)
            assert_same(got, CPU.fake_quant(x, spec, a), f"{name} vs contiguous")
            assert_same(got, REF.fake_quant(x, spec, a), f"{name} vs reference")
        assert_same(CPU.fp8_blockwise_cast(v, (16, 16), 1e-10, False), REF.fp8_blockwise_cast(x, (16, 16), 1e-10, False))
        assert_same(CPU.mx_cast(v, "e2m1", 32, Rounding.RCEIL), REF.mx_cast(x, "e2m1", 32, Rounding.RCEIL))
        assert_same(CPU.nvfp4_cast(v, None), REF.nvfp4_cast(x, None))
        assert_same(CPU.block_amax(v, (8, 16)), REF.block_amax(x, (8, 16)))
    # A non-contiguous static amax too.
    a = torch.stack([amax_last(x), amax_last(x)], dim=-1)[..., 0]
    assert not a.is_contiguous()
    check_fake_quant(_non_contiguous(x)[0], FormatSpec(INT, 8), a)
    check_fake_quant(x, FormatSpec(INT, 4, block=(16,)), amax_blocks((16,))(x).t().contiguous().t())


def test_rank_0_and_rank_4(isa):
    s = torch.tensor(1.7)
    check_fake_quant(s, FormatSpec(INT, 8), torch.tensor(2.0))
    check_fake_quant(s, FormatSpec(FP8, element=E4M3), torch.tensor(2.0))
    check_fake_quant(s, FormatSpec(INT, 8, dynamic=True))
    check_fake_quant(s, FormatSpec(FP8, element=E4M3, dynamic=True))
    # Conv weight per output channel, conv input per input channel (amax of shape [1, C, 1, 1]).
    w = sample((8, 3, 3, 5), seed=17)
    check_fake_quant(w, FormatSpec(INT, 8), amax_rows(w))
    check_fake_quant(w, FormatSpec(FP8, element=E4M3), amax_rows(w))
    x = sample((2, 4, 5, 6), seed=18)
    a = x.abs().amax(dim=(0, 2, 3), keepdim=True)
    check_fake_quant(x, FormatSpec(INT, 8), a)
    check_fake_quant(x, FormatSpec(INT, 8), x.abs().amax(dim=(1, 3), keepdim=True))  # two kept axes
    check_fake_quant(x, FormatSpec(FP8, element=E5M2), x.abs().amax(dim=(0, 1), keepdim=True))
    for name, spec, amax_fn, _ in FAKE_QUANT_CASES:
        check_fake_quant(x, spec, _amax(amax_fn, x), f"rank 4 {name}")


def test_amax_broadcast_that_grows_the_output():
    # The reference broadcasts x against amax; an amax of higher rank gives the broadcast shape.
    x = sample((5,), seed=19)
    check_fake_quant(x, FormatSpec(INT, 8), torch.tensor([[2.0], [3.0]]))


@pytest.mark.parametrize("shape", [(300, 257), (1, 100_003), (70_001, 1), (3, 40_000)], ids=lambda s: "x".join(map(str, s)))
def test_parallel_split_matches_reference(shape):
    # Large enough for the threaded path; long rows split into segments; single-element rows.
    x = sample(shape, seed=20)
    for spec, amax in [(FormatSpec(INT, 8), amax_tensor(x)), (FormatSpec(INT, 8), amax_last(x)), (FormatSpec(FP8, element=E4M3),
                                                                                                  amax_rows(x)),
                       (FormatSpec(INT, 8, dynamic=True), None), (FormatSpec(NV, element=E2M1, block=(16,)), None)]:
        check_fake_quant(x, spec, amax, f"{spec} {shape}")
    assert_same(CPU.mx_cast(x, "e2m1", 32, Rounding.RCEIL), REF.mx_cast(x, "e2m1", 32, Rounding.RCEIL))


def test_thread_count_does_not_change_results():
    x = sample((256, 1000), torch.bfloat16, seed=21)
    x[7, 9] = NAN
    threads = torch.get_num_threads()
    outs = []
    try:
        for n in (1, max(2, threads)):
            torch.set_num_threads(n)
            outs.append([CPU.fake_quant(x, FormatSpec(INT, 8), amax_last(x)), CPU.nvfp4_cast(x, None),
                         CPU.fake_quant(x, FormatSpec(MX, element=E2M1, block=(32,)), None)])
    finally:
        torch.set_num_threads(threads)
    for a, b in zip(*outs):
        assert_same(a, b)


def test_empty_input():
    x = torch.empty(0, 32)
    check_fake_quant(x, FormatSpec(INT, 8), torch.tensor(1.0))
    check_fake_quant(x, FormatSpec(FP8, element=E4M3), torch.tensor(1.0))
    assert_same(CPU.block_amax(x, (8, 16)), REF.block_amax(x, (8, 16)))
    # The reference cannot reshape an empty tensor into 1-D blocks; the kernels give the shapes the
    # ops' fake kernels promise.
    codes, scales = CPU.mx_cast(x, "e2m1", 32, Rounding.RCEIL)
    assert codes.shape == (0, 16) and codes.dtype == torch.uint8 and scales.shape == (0, 1)
    assert CPU.fake_quant(x, FormatSpec(INT, 4, block=(16,), dynamic=True), None).shape == (0, 32)
    packed, sb, s2 = CPU.nvfp4_cast(x, None)
    assert packed.shape == (0, 16) and sb.shape == (0, 2) and sb.dtype == torch.float8_e4m3fn and s2.item() == 1.0


def test_dequantize_of_cast_equals_fake_quant():
    x = sample((9, 80), torch.bfloat16, seed=22)
    codes, d = kernels.fp8_blockwise_cast(x, (16, 16), backend="cpu")
    fq = CPU.fake_quant(x, FormatSpec(FPB, element=E4M3, block=(16, 16), dynamic=True), None)
    assert_same(kernels.dequantize(codes, d, "fp8_blockwise", block=(16, 16), dtype=x.dtype), fq)
    for elem, fmt in (("e4m3", "mxfp8"), ("e2m1", "mxfp4")):
        codes, e = kernels.mx_cast(x, elem, backend="cpu")
        fq = CPU.fake_quant(x, FormatSpec(MX, element=E4M3 if elem == "e4m3" else E2M1, block=(32,)), None)
        assert_same(kernels.dequantize(codes, e, fmt, n=x.shape[-1], dtype=x.dtype), fq)
    packed, sb, s2 = kernels.nvfp4_cast(x, backend="cpu")
    fq = CPU.fake_quant(x, FormatSpec(NV, element=E2M1, block=(16,)), None)
    assert_same(kernels.dequantize(packed, sb, "nvfp4", global_scale=s2, n=x.shape[-1], dtype=x.dtype), fq)


# --------------------------------------------------------------------------- errors and dispatch


def test_static_amax_errors_like_reference():
    x = sample((4, 32), seed=23)
    for spec in (FormatSpec(INT, 8), FormatSpec(FP8, element=E4M3), FormatSpec(FPB, element=E4M3, block=(16,)),
                 FormatSpec(INT, 4, block=(16,))):
        with pytest.raises(ValueError, match="needs an amax"):
            REF.fake_quant(x, spec, None)
        with pytest.raises(ValueError, match="needs an amax"):
            CPU.fake_quant(x, spec, None)
    for spec in (FormatSpec(INT, 4, block=(16,)), FormatSpec(FPB, element=E4M3, block=(16,))):
        bad = torch.ones(4, 3)
        with pytest.raises(ValueError):
            REF.fake_quant(x, spec, bad)
        with pytest.raises(ValueError, match="does not fit"):
            CPU.fake_quant(x, spec, bad)


def test_bad_arguments_raise():
    x = sample((4, 32), seed=24)
    with pytest.raises(ValueError, match="block"):
        CPU.block_amax(x, (0,))
    with pytest.raises(ValueError, match="rank"):
        CPU.block_amax(torch.ones(8), (4, 4))
    with pytest.raises(TypeError, match="float32, bfloat16 or float16"):
        CPU.block_amax(x.to(torch.float64), (16,))
    with pytest.raises(NotImplementedError, match="fp8_block"):
        CPU.fake_quant(x, FormatSpec(FP8, element=E4M3, block=(16,), dynamic=True), None)
    with pytest.raises(ValueError, match="element"):
        CPU.fake_quant(x, FormatSpec(FP8, element=(3, 4)), torch.tensor(1.0))
    with pytest.raises(ValueError, match="not compiled in or not supported"):
        C.cpu_set_isa("sse9")


def test_ops_dispatch_to_cpu_backend():
    from quantlib.kernels.backends import resolve

    x = sample((4, 64), torch.bfloat16, seed=25)
    assert resolve("auto", x.device) == "cpu"
    spec = FormatSpec(NV, element=E2M1, block=(16,))
    for backend in ("cpu", "auto"):
        assert_same(kernels.fake_quant(x, spec, backend=backend), REF.fake_quant(x, spec, None))
        assert_same(kernels.block_amax(x, (1, 16), backend=backend), REF.block_amax(x, (16,)))
        assert_same(kernels.fp8_blockwise_cast(x, (1, 32), backend=backend), REF.fp8_blockwise_cast(x, (32,), 1e-10, False))
        assert_same(kernels.mx_cast(x, "e2m1", rounding="floor", backend=backend), REF.mx_cast(x, "e2m1", 32, Rounding.FLOOR))
        assert_same(kernels.nvfp4_cast(x, torch.tensor(3.0), backend=backend), REF.nvfp4_cast(x, torch.tensor(3.0)))


def test_compile_fullgraph_with_cpu_backend():
    x = sample((4, 64), seed=26)
    spec = FormatSpec(MX, element=E2M1, block=(32,))

    def fn(t):
        return kernels.fake_quant(t, spec, backend="cpu"), kernels.nvfp4_cast(t, backend="cpu"), kernels.block_amax(t, (16,), backend="cpu")

    assert_same(torch.compile(fn, fullgraph=True, backend="aot_eager")(x), fn(x))


def test_straight_through_gradient_with_cpu_backend():
    x = sample((4, 32), seed=27).requires_grad_()
    amax = torch.tensor(2.0)
    kernels.fake_quant(x, FormatSpec(INT, 8), amax, backend="cpu").sum().backward()
    assert torch.equal(x.grad, (x.detach().abs() <= amax).float())


# --------------------------------------------------------------------------- fuzz

FUZZ_SPECS = [c[1:3] for c in FAKE_QUANT_CASES if c[3] == 1]


@settings(max_examples=60, deadline=None)
@given(rows=st.integers(1, 12), cols=st.integers(1, 200), spec_i=st.integers(0, len(FUZZ_SPECS) - 1), dtype_i=st.integers(0, 2),
       exp=st.integers(-40, 40), seed=st.integers(0, 2**31 - 1))
def test_fuzz_fake_quant(rows, cols, spec_i, dtype_i, exp, seed):
    spec, amax_fn = FUZZ_SPECS[spec_i]
    x = (sample((rows, cols), seed=seed) * 2.0**exp).to(DTYPES[dtype_i])
    check_fake_quant(x, spec, _amax(amax_fn, x), f"{spec} {tuple(x.shape)} {x.dtype} 2^{exp}")


@settings(max_examples=30, deadline=None)
@given(rows=st.integers(1, 8), cols=st.integers(1, 150), exp=st.integers(-30, 30), seed=st.integers(0, 2**31 - 1),
       dtype_i=st.integers(0, 2))
def test_fuzz_casts(rows, cols, exp, seed, dtype_i):
    x = (sample((rows, cols), seed=seed) * 2.0**exp).to(DTYPES[dtype_i])
    assert_same(CPU.fp8_blockwise_cast(x, (1, 32), 1e-10, True), REF.fp8_blockwise_cast(x, (1, 32), 1e-10, True))
    assert_same(CPU.mx_cast(x, "e4m3", 32, Rounding.RCEIL), REF.mx_cast(x, "e4m3", 32, Rounding.RCEIL))
    assert_same(CPU.mx_cast(x, "e2m1", 32, Rounding.FLOOR), REF.mx_cast(x, "e2m1", 32, Rounding.FLOOR))
    assert_same(CPU.nvfp4_cast(x, None), REF.nvfp4_cast(x, None))


@pytest.mark.parametrize("x_shape", [(0, 32), (4, 6), (1, 6), (2, 4, 6)])
@pytest.mark.parametrize("amax_shape", [(), (1,), (4, 1), (1, 6), (0, 1), (2, 1, 1), (3, 1)])
def test_broadcast_of_the_amax_follows_torch(x_shape, amax_shape):
    """The CPU backend broadcasts by hand (torch.broadcast_shapes imports sympy): same shapes, same refusals."""
    from quantlib.kernels.cpu_impl import _broadcast_input

    x, amax = torch.zeros(x_shape), torch.ones(amax_shape)
    try:
        expected = torch.broadcast_shapes(x.shape, amax.shape)
    except RuntimeError:
        with pytest.raises(ValueError, match="does not broadcast"):
            _broadcast_input(x, amax)
        return
    assert _broadcast_input(x, amax).shape == expected
