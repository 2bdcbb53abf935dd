"""The Triton kernels under Triton's interpreter on the CPU, bit for bit against the torch reference.

The interpreter is switched on for this module only (TRITON_INTERPRET=1 while it runs, the kernel
modules reloaded so their ``@triton.jit`` functions become interpreted ones, and reloaded back after).
The kernels do every rounding with IEEE fp32 operations or integer bit operations, so the
interpreter runs exactly the arithmetic the GPU runs (FACTS.md: its float8 / bfloat16 casts are not
used). Shapes are small: every test runs in well under a second.
"""

from __future__ import annotations

import pytest
import torch  # noqa: E402

from . import _interpreted  # noqa: E402

_FRESH = _interpreted.start()

triton = pytest.importorskip("triton")

from quantlib.formats import FormatSpec, Kind, Rounding  # noqa: E402
from quantlib.kernels import reference_impl as R  # noqa: E402

from ._compare import assert_same, assert_same_all, e2m1_probe  # noqa: E402,F401

NAN, INF = float("nan"), float("inf")
DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@pytest.fixture(autouse=True)
def interpreted(request):
    """Run in this process only when triton came up interpreted; else the subprocess test runs all."""
    _interpreted.skip_unless_fresh(request, _FRESH)


def test_module_in_a_fresh_interpreter():
    _interpreted.run_in_subprocess(__file__, _FRESH)


def T():
    from quantlib.kernels.triton import impl

    return impl


# --------------------------------------------------------------------------- comparison





# --------------------------------------------------------------------------- inputs


def edge_input(shape, dtype, seed=0, scale=3.0) -> torch.Tensor:
    """Random values plus zeros, a zero block, subnormals, powers of two and E4M3 carry values."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g) * scale
    flat = x.view(-1)
    n = flat.numel()
    specials = torch.tensor([0.0, -0.0, 2.0**-130, -(2.0**-140), 2.0**-9, 448.0, -448.0, 124.0, 127.9, 1.5 * 2**-7, 6.0, 5.0, 0.25, 0.75,
                             2.0**-24])
    k = min(n, specials.numel())
    pos = torch.randperm(n, generator=g)[:k]
    flat[pos] = specials[:k] * (scale if dtype != torch.float16 else 1.0)
    if x.dim() >= 1 and x.shape[-1] >= 40:
        x[..., 0:40] = 0.0 if x.dim() == 1 else x[..., 0:40]
        if x.dim() >= 2:
            x[0, :40] = 0.0  # an all-zero block (of every block size) in the first row
    return x.to(dtype)


SPECS_DYNAMIC = [
    FormatSpec(Kind.INT, num_bits=8, dynamic=True),
    FormatSpec(Kind.INT, num_bits=4, block=(128,), dynamic=True),
    FormatSpec(Kind.INT, num_bits=4, unsigned=True, block=(16,), dynamic=True),
    FormatSpec(Kind.INT, num_bits=8, narrow_range=False, block=(32,), dynamic=True),
    FormatSpec(Kind.FP8, element=(4, 3), dynamic=True),
    FormatSpec(Kind.FP8, element=(5, 2), dynamic=True),
    FormatSpec(Kind.FP8_BLOCK, element=(4, 3), block=(128,), dynamic=True),
    FormatSpec(Kind.FP8_BLOCK, element=(4, 3), block=(1, 128), dynamic=True, pow2=True),
    FormatSpec(Kind.FP8_BLOCK, element=(5, 2), block=(128,), dynamic=True, pow2=True),
    FormatSpec(Kind.MX, element=(4, 3), block=(32,)),
    FormatSpec(Kind.MX, element=(4, 3), block=(32,), rounding=Rounding.FLOOR),
    FormatSpec(Kind.MX, element=(2, 1), block=(32,)),
    FormatSpec(Kind.MX, element=(2, 1), block=(32,), rounding=Rounding.FLOOR),
    FormatSpec(Kind.MX, element=(3, 2), block=(32,)),
    FormatSpec(Kind.MX, element=(2, 3), block=(32,), rounding=Rounding.FLOOR),
    FormatSpec(Kind.MX, num_bits=8, block=(32,)),
    FormatSpec(Kind.MX, num_bits=8, block=(32,), rounding=Rounding.FLOOR),
    FormatSpec(Kind.NVFP4, element=(2, 1), block=(16,)),
]


def _id(spec: FormatSpec) -> str:
    parts = [spec.kind.value, str(spec.num_bits) if spec.kind == Kind.INT else "".join(map(str, spec.element or ()))]
    if spec.block:
        parts.append("x".join(map(str, spec.block)))
    if spec.pow2:
        parts.append("pow2")
    if spec.kind == Kind.MX:
        parts.append(Rounding(spec.rounding).value)
    if spec.unsigned:
        parts.append("u")
    return "-".join(parts)


# --------------------------------------------------------------------------- fake quant


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("spec", SPECS_DYNAMIC, ids=_id)
def test_fake_quant_dynamic_matches_reference(spec, dtype):
    x = edge_input((5, 300), dtype)
    assert_same(T().fake_quant(x, spec, None), R.fake_quant(x, spec, None), _id(spec))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("spec", [FormatSpec(Kind.INT, num_bits=4, block=(128, 128), dynamic=True),
                                  FormatSpec(Kind.FP8_BLOCK, element=(4, 3), block=(128, 128), dynamic=True),
                                  FormatSpec(Kind.FP8_BLOCK, element=(4, 3), block=(128, 128), dynamic=True, pow2=True)], ids=_id)
def test_fake_quant_2d_blocks_partial(spec, dtype):
    x = edge_input((130, 136), dtype, seed=1)
    x[128:, 128:] = 0.0  # an all-zero partial corner block
    assert_same(T().fake_quant(x, spec, None), R.fake_quant(x, spec, None), _id(spec))


def _static_cases():
    x = edge_input((6, 40), torch.float32, seed=2)
    col = x.abs().amax(0, keepdim=True)
    row = x.abs().amax(1, keepdim=True)
    return [
        ("int8-tensor", FormatSpec(Kind.INT, num_bits=8), torch.tensor(2.5)),
        ("int8-row", FormatSpec(Kind.INT, num_bits=8), row),
        ("int4-col", FormatSpec(Kind.INT, num_bits=4), col * 0.5),
        ("uint8-tensor", FormatSpec(Kind.INT, num_bits=8, unsigned=True), torch.tensor(3.0)),
        ("int16-tensor", FormatSpec(Kind.INT, num_bits=16), torch.tensor(4.0)),
        ("fp8-tensor", FormatSpec(Kind.FP8, element=(4, 3)), torch.tensor(1.7)),
        ("fp8-row", FormatSpec(Kind.FP8, element=(4, 3)), row),
        ("fp8e5m2-col", FormatSpec(Kind.FP8, element=(5, 2)), col),
        ("fp8-zero-amax", FormatSpec(Kind.FP8, element=(4, 3)), torch.tensor(0.0)),
        ("nvfp4-static", FormatSpec(Kind.NVFP4, element=(2, 1), block=(16,)), torch.tensor(4.0)),
        ("nvfp4-zero-global", FormatSpec(Kind.NVFP4, element=(2, 1), block=(16,)), torch.tensor(0.0)),
        ("int4-block-static", FormatSpec(Kind.INT, num_bits=4, block=(16,)), torch.full((6, 3), 1.5)),
        ("fp8block-static", FormatSpec(Kind.FP8_BLOCK, element=(4, 3), block=(16,)), torch.full((6, 3), 2.0)),
    ]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", _static_cases(), ids=lambda c: c[0])
def test_fake_quant_static_matches_reference(case, dtype):
    _, spec, amax = case
    x = edge_input((6, 40), dtype, seed=2)
    x[2, 5] = 1e6  # beyond the static amax: saturates
    assert_same(T().fake_quant(x, spec, amax), R.fake_quant(x, spec, amax), case[0])


@pytest.mark.parametrize("spec", [FormatSpec(Kind.INT, num_bits=8), FormatSpec(Kind.FP8, element=(4, 3)),
                                  FormatSpec(Kind.INT, num_bits=4, block=(16,))], ids=_id)
@pytest.mark.parametrize("where", ["tensor", "row", "col"])
def test_nan_group(spec, where):
    x = edge_input((6, 48), torch.float32, seed=3)
    x[2, 7] = NAN
    x[4, 20] = INF
    if spec.block:
        amax = torch.full((6, 3), 2.0)
    else:
        amax = {"tensor": torch.tensor(2.0), "row": torch.full((6, 1), 2.0), "col": torch.full((1, 48), 2.0)}[where]
    assert_same(T().fake_quant(x, spec, amax), R.fake_quant(x, spec, amax), where)


def test_broadcast_amax_without_2d_view():
    """amax (B, 1, 1) of a (B, T, H) input cannot be viewed as [B*T, H]: the group-index path."""
    x = edge_input((3, 4, 40), torch.bfloat16, seed=4)
    x[1, 2, 3] = NAN
    amax = torch.tensor([1.0, 2.0, 3.0]).view(3, 1, 1)
    for spec in (FormatSpec(Kind.INT, num_bits=8), FormatSpec(Kind.FP8, element=(4, 3))):
        amax3 = amax.expand(3, 1, 1).clone()
        ref = R.fake_quant(x, spec, amax3)
        assert_same(T().fake_quant(x, spec, amax3), ref, _id(spec))
    amax_th = torch.arange(1, 5, dtype=torch.float32).view(1, 4, 1)  # per (T) channel of a 3-D input
    assert_same(T().fake_quant(x, FormatSpec(Kind.INT, num_bits=8), amax_th), R.fake_quant(x, FormatSpec(Kind.INT, num_bits=8), amax_th))


def test_dynamic_row_longer_than_one_tile():
    x = edge_input((2, 9000), torch.float32, seed=5)
    for spec in (FormatSpec(Kind.INT, num_bits=8, dynamic=True), FormatSpec(Kind.FP8, element=(4, 3), dynamic=True)):
        assert_same(T().fake_quant(x, spec, None), R.fake_quant(x, spec, None), _id(spec))


def test_all_zero_block():
    x = torch.zeros(2, 64)
    for spec in SPECS_DYNAMIC:
        assert_same(T().fake_quant(x, spec, None), R.fake_quant(x, spec, None), _id(spec))
    assert_same_all(T().nvfp4_cast(x, None), R.nvfp4_cast(x, None), "nvfp4_cast")
    assert_same_all(T().fp8_blockwise_cast(x, (128,), 1e-10, True), R.fp8_blockwise_cast(x, (128,), 1e-10, True))


def test_nan_block():
    x = edge_input((3, 64), torch.float32, seed=6)
    x[1, 40] = NAN
    for spec in SPECS_DYNAMIC:
        assert_same(T().fake_quant(x, spec, None), R.fake_quant(x, spec, None), _id(spec))
    for elem in ("e4m3", "e2m1"):
        assert_same_all(T().mx_cast(x, elem, 32, Rounding.RCEIL), R.mx_cast(x, elem, 32, Rounding.RCEIL), elem)


@pytest.mark.parametrize("block", [(1, 128), (128, 128)])
def test_fp8_blockwise_nan_block_codes_are_0x7f_for_every_element(block):
    """docs/numerics.md: every NaN code of an FP8 blockwise cast is 0x7F, whatever the NaN's sign."""
    from .test_fp8_blockwise_nan_rule import assert_nan_rule, nan_rule_input

    x = nan_rule_input(block)
    codes, scales = T().fp8_blockwise_cast(x, block, 1e-10, False)
    assert_nan_rule(x, codes, scales, block)


def test_inf_block():
    x = edge_input((3, 64), torch.float32, seed=7)
    x[2, 3] = -INF
    for spec in SPECS_DYNAMIC:
        assert_same(T().fake_quant(x, spec, None), R.fake_quant(x, spec, None), _id(spec))


def test_subnormal_inputs():
    g = torch.Generator().manual_seed(8)
    x = (torch.rand(4, 64, generator=g) - 0.5) * 2.0**-128  # fp32 subnormals only
    for spec in SPECS_DYNAMIC:
        assert_same(T().fake_quant(x, spec, None), R.fake_quant(x, spec, None), _id(spec))
    xb = (torch.randn(4, 64, generator=g) * 2.0**-130).bfloat16()  # bf16 subnormals
    for spec in SPECS_DYNAMIC:
        assert_same(T().fake_quant(xb, spec, None), R.fake_quant(xb, spec, None), _id(spec))
    assert_same_all(T().fp8_blockwise_cast(x, (32,), 1e-45, True), R.fp8_blockwise_cast(x, (32,), 1e-45, True), "tiny eps pow2")


def test_pow2_boundaries():
    """Block amax exactly at and one ulp around Q * 2^k (the exponent rules' edges) and E4M3 carries."""
    rows = []
    for k in (-20, -3, 0, 1, 7):
        for q in (448.0, 6.0, 2688.0):
            a = torch.tensor(q * 2.0**k)
            for v in (a, torch.nextafter(a, torch.tensor(0.0)), torch.nextafter(a, torch.tensor(INF))):
                rows.append(torch.linspace(-1, 1, 64) * v)
    x = torch.stack(rows)
    x[:, 5] = torch.linspace(120, 130, x.shape[0])
    for spec in SPECS_DYNAMIC:
        assert_same(T().fake_quant(x, spec, None), R.fake_quant(x, spec, None), _id(spec))
    for rd in (Rounding.RCEIL, Rounding.FLOOR):
        for elem in ("e4m3", "e2m1"):
            assert_same_all(T().mx_cast(x, elem, 32, rd), R.mx_cast(x, elem, 32, rd), f"{elem}-{rd.value}")


def test_e4m3_carry_values_exact():
    """124..128 and their negatives: the interpreter's own float8 cast gets these wrong (FACTS.md)."""
    x = torch.linspace(-460, 460, 8192).reshape(64, 128)
    spec = FormatSpec(Kind.FP8, element=(4, 3))
    assert_same(T().fake_quant(x, spec, torch.tensor(448.0)), R.fake_quant(x, spec, torch.tensor(448.0)))
    assert_same_all(T().fp8_blockwise_cast(x, (128,), 1e-10, False), R.fp8_blockwise_cast(x, (128,), 1e-10, False))


def test_partial_last_block():
    for n in (1, 15, 17, 33, 129):
        x = edge_input((3, n), torch.bfloat16, seed=n)
        for spec in SPECS_DYNAMIC[1:4] + SPECS_DYNAMIC[6:]:
            assert_same(T().fake_quant(x, spec, None), R.fake_quant(x, spec, None), f"{_id(spec)} n={n}")
        assert_same_all(T().nvfp4_cast(x, None), R.nvfp4_cast(x, None), f"nvfp4 n={n}")
        assert_same_all(T().mx_cast(x, "e2m1", 32, Rounding.RCEIL), R.mx_cast(x, "e2m1", 32, Rounding.RCEIL), f"mxfp4 n={n}")


def test_rank_1_and_3():
    for shape in ((300,), (2, 3, 70)):
        x = edge_input(shape, torch.float16, seed=9)
        for spec in SPECS_DYNAMIC:
            if spec.block and len(spec.block) > len(shape):
                continue
            assert_same(T().fake_quant(x, spec, None), R.fake_quant(x, spec, None), f"{_id(spec)} {shape}")
    x = edge_input((2, 3, 40), torch.float32, seed=10)
    spec = FormatSpec(Kind.FP8_BLOCK, element=(4, 3), block=(16, 16), dynamic=True)
    assert_same(T().fake_quant(x, spec, None), R.fake_quant(x, spec, None), "2-D block on rank 3")


# --------------------------------------------------------------------------- real quantization


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("block", [(128,), (1, 128), (128, 128), (32,)], ids=str)
@pytest.mark.parametrize("pow2", [False, True])
def test_fp8_blockwise_cast(block, pow2, dtype):
    x = edge_input((130, 200), dtype, seed=11)
    assert_same_all(T().fp8_blockwise_cast(x, block, 1e-10, pow2), R.fp8_blockwise_cast(x, block, 1e-10, pow2), str(block))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("block", [(128,), (1, 128), (128, 128), (32,)], ids=str)
@pytest.mark.parametrize("pow2", [False, True])
def test_fp8_blockwise_cast_static_amax(block, pow2, dtype):
    """Scales from a stored amax (the export of a calibrated quantizer): the block's own amax, a larger
    one, a smaller one (codes clamp) and zero (eps)."""
    for shape in ((130, 200), (2, 130, 136)):
        x = edge_input(shape, dtype, seed=12)
        own = R.block_amax(x, block)
        for amax in (own, own * 2.0 + 1e-3, own * 0.5, torch.zeros_like(own)):
            assert_same_all(T().fp8_blockwise_cast(x, block, 1e-10, pow2, amax), R.fp8_blockwise_cast(x, block, 1e-10, pow2, amax),
                            f"{block} {shape} {amax.flatten()[:2]}")


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("element", [(4, 3), (5, 2)], ids=str)
def test_fp8_cast(element, dtype):
    """FP8 per tensor and per row codes from a precomputed scale (FP8 export): the amax of the weight,
    a smaller one (codes saturate at +-Q), a tiny one (scale of amax 1), with Inf and NaN elements."""
    from quantlib.formats.fp8 import fp8_scale

    x = edge_input((37, 300), dtype, seed=13)
    x[3, 5], x[7, 9], x[8, 1] = INF, NAN, -NAN
    rows = x.float().abs().nan_to_num(0, 0, 0).amax(dim=1, keepdim=True)
    for amax in (torch.tensor(5.0), torch.tensor(1e-30), rows, rows * 0.25, torch.tensor(NAN)):
        s = fp8_scale(amax, element)
        assert_same(T().fp8_cast(x, s, element), R.fp8_cast(x, s, element), f"{element} {tuple(amax.shape)}")
    assert_same(T().fp8_cast(x[:0], torch.tensor(1.0), element), R.fp8_cast(x[:0], torch.tensor(1.0), element), "empty")


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("elem", ["e4m3", "e2m1", "e3m2", "e2m3", "int8"])
@pytest.mark.parametrize("rounding", [Rounding.RCEIL, Rounding.FLOOR], ids=lambda r: r.value)
def test_mx_cast(elem, rounding, dtype):
    x = edge_input((7, 300), dtype, seed=12)
    assert_same_all(T().mx_cast(x, elem, 32, rounding), R.mx_cast(x, elem, 32, rounding), elem)


def test_e2m1_rounding_of_every_bf16_value():
    """E2M1 codes and fake-quant values of every bf16 magnitude up to 6 and random fp32 values."""
    x = e2m1_probe()
    assert_same_all(T().mx_cast(x, "e2m1", 32, Rounding.RCEIL), R.mx_cast(x, "e2m1", 32, Rounding.RCEIL), "cast")
    spec = FormatSpec(Kind.MX, element=(2, 1), block=(32,))
    assert_same(T().fake_quant(x, spec, None), R.fake_quant(x, spec, None), "fake")


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("global_amax", [None, 5.0, 1e-30], ids=["dynamic", "static", "tiny"])
def test_nvfp4_cast(global_amax, dtype):
    x = edge_input((7, 300), dtype, seed=13)
    g = None if global_amax is None else torch.tensor(global_amax)
    assert_same_all(T().nvfp4_cast(x, g), R.nvfp4_cast(x, g), "nvfp4")


@pytest.mark.parametrize("shape", [(0, 32), (2, 0)], ids=str)
@pytest.mark.parametrize("global_amax", [None, 5.0], ids=["dynamic", "static"])
def test_nvfp4_cast_of_an_empty_input_is_the_cpu_kernels(shape, global_amax):
    """No blocks: the Triton backend answers itself (it ran the reference, which fails on these shapes), as
    the C++ kernel does: the global scale of the given amax, or of an amax of 0."""
    from quantlib.kernels import backends

    if backends.native_extension() is None:
        pytest.skip("quantlib._C is not built")
    from quantlib.kernels import cpu_impl

    x, g = torch.empty(shape), None if global_amax is None else torch.tensor(global_amax)
    assert_same_all(T().nvfp4_cast(x, g), cpu_impl.nvfp4_cast(x, g), f"empty {shape}")


@pytest.mark.parametrize("block", [(128,), (1, 128), (128, 128), (32,), (16,), (5,), (3, 7)], ids=str)
def test_block_amax(block):
    x = edge_input((130, 140), torch.bfloat16, seed=14)
    x[3, 3] = NAN
    assert_same(T().block_amax(x, block), R.block_amax(x, block), str(block))


def test_non_contiguous_matches_contiguous():
    base = edge_input((40, 300), torch.bfloat16, seed=15)
    x = base.t()[::2]  # (150, 40), strided
    assert not x.is_contiguous()
    xc = x.contiguous()
    for spec in SPECS_DYNAMIC:
        assert_same(T().fake_quant(x, spec, None), T().fake_quant(xc, spec, None), _id(spec))
        assert_same(T().fake_quant(x, spec, None), R.fake_quant(x, spec, None), _id(spec))
    assert_same(T().fake_quant(x, FormatSpec(Kind.INT, num_bits=8), torch.tensor(2.0)),
                R.fake_quant(xc, FormatSpec(Kind.INT, num_bits=8), torch.tensor(2.0)))
    assert_same_all(T().fp8_blockwise_cast(x, (128,), 1e-10, False), R.fp8_blockwise_cast(xc, (128,), 1e-10, False))
    assert_same_all(T().mx_cast(x, "e2m1", 32, Rounding.RCEIL), R.mx_cast(xc, "e2m1", 32, Rounding.RCEIL))
    assert_same_all(T().nvfp4_cast(x, None), R.nvfp4_cast(xc, None))
    assert_same(T().block_amax(x, (16,)), R.block_amax(xc, (16,)))


def test_static_amax_errors_like_reference():
    x = torch.randn(4, 64)
    with pytest.raises(ValueError, match="needs an amax"):
        T().fake_quant(x, FormatSpec(Kind.INT, num_bits=8), None)
    with pytest.raises(ValueError, match="does not fit"):
        T().fake_quant(x, FormatSpec(Kind.INT, num_bits=4, block=(16,)), torch.ones(4, 3))


def test_ops_dispatch_to_triton_backend():
    from quantlib.kernels import ops

    x = edge_input((4, 64), torch.float32, seed=16)
    spec = SPECS_DYNAMIC[13]
    assert_same(ops.fake_quant(x, spec, None, backend="triton"), R.fake_quant(x, spec, None))


# --------------------------------------------------------------------------- fuzz

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import given, settings, strategies as st  # noqa: E402


@settings(max_examples=25, deadline=None, derandomize=True)
@given(
    rows=st.integers(1, 4),
    cols=st.integers(1, 200),
    spec_i=st.integers(0, len(SPECS_DYNAMIC) - 1),
    dtype_i=st.integers(0, 2),
    exp=st.integers(-30, 30),
    seed=st.integers(0, 2**16),
)
def test_fuzz_fake_quant(rows, cols, spec_i, dtype_i, exp, seed):
    spec, dtype = SPECS_DYNAMIC[spec_i], DTYPES[dtype_i]
    if dtype == torch.float16:
        exp = max(min(exp, 10), -10)
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(rows, cols, generator=g) * 2.0**exp).to(dtype)
    assert_same(T().fake_quant(x, spec, None), R.fake_quant(x, spec, None), _id(spec))


@pytest.mark.parametrize("elem,q", [("e3m2", 28.0), ("e2m3", 7.5), ("int8", 127.0)])
def test_mx_element_rounding_of_every_bf16_value(elem, q):
    """MXFP6 / MXINT8 codes and values of every bf16 magnitude up to Q (rows with amax Q: scale 1)."""
    mags = (torch.arange(0, 0x7F80, dtype=torch.int32) << 16).view(torch.float32)
    mags = mags[mags <= q]
    vals = torch.cat([mags, -mags, torch.zeros((-2 * mags.numel()) % 31)]).view(-1, 31)
    x = torch.cat([torch.full((vals.shape[0], 1), q), vals], dim=1)
    assert_same_all(T().mx_cast(x, elem, 32, Rounding.RCEIL), R.mx_cast(x, elem, 32, Rounding.RCEIL), elem)
    spec = FormatSpec(Kind.MX, num_bits=8, block=(32,)) if elem == "int8" else FormatSpec(Kind.MX, element=(int(elem[1]), int(elem[3])),
                                                                                          block=(32,))
    assert_same(T().fake_quant(x, spec, None), R.fake_quant(x, spec, None), elem)


@pytest.mark.parametrize("elem", ["e3m2", "e2m3", "int8"])
def test_mx_elements_of_random_bit_patterns(elem):
    """Every binade and the clamped exponents (block amax from fp32 subnormals to 3.4e38)."""
    g = torch.Generator().manual_seed(13)
    x = torch.randint(-(2**31), 2**31 - 1, (16, 96), generator=g, dtype=torch.int64).to(torch.int32).view(torch.float32)
    x = torch.where(torch.isfinite(x), x, torch.zeros(()))
    x[:4] *= 2.0**-100
    for rd in (Rounding.RCEIL, Rounding.FLOOR):
        assert_same_all(T().mx_cast(x, elem, 32, rd), R.mx_cast(x, elem, 32, rd), f"{elem}-{rd.value}")


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("static_blocks", [False, True], ids=["dynamic-blocks", "static-blocks"])
def test_nvfp4_global_amax_per_expert(dtype, static_blocks):
    """A global amax per expert of an (E, out, in) stack ((E, 1, 1)) and per row ((E, out, 1)): fake quant
    and cast equal the reference, which equals a call per expert (test_nvfp4_global_per_row.py)."""
    x = edge_input((3, 5, 300), dtype, seed=16) * torch.tensor([1e-3, 1.0, 1e2]).reshape(3, 1, 1).to(dtype)
    spec = FormatSpec(Kind.NVFP4, element=(2, 1), block=(16,), dynamic=not static_blocks)
    for g in (torch.tensor([2e-3, 0.0, 4e2]).reshape(3, 1, 1), x.float().abs().amax(dim=-1, keepdim=True)):
        blocks = R.block_amax(x, (16,)) * 0.5 if static_blocks else None
        assert_same(T().fake_quant(x, spec, g, blocks), R.fake_quant(x, spec, g, blocks), f"fake {tuple(g.shape)}")
        assert_same_all(T().nvfp4_cast(x, g, 16, blocks), R.nvfp4_cast(x, g, 16, blocks), f"cast {tuple(g.shape)}")


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_fp8_amax_per_expert_of_stacked_weights_is_read_per_row(dtype, monkeypatch):
    """FP8 with one amax per expert of an (E, out, in) stack ((E, 1, 1), which no 2-D view of the rows
    expresses): the reference's bits, the amax spread per row, no int32 group index the size of the weights."""
    x = edge_input((3, 5, 40), dtype, seed=17)
    spec = FormatSpec(Kind.FP8, element=(4, 3))
    amax = torch.tensor([0.5, 3.0, 100.0]).reshape(3, 1, 1)
    seen, real = [], torch.arange
    monkeypatch.setattr(torch, "arange", lambda *a, **k: seen.append(a) or real(*a, **k))
    out = T().fake_quant(x, spec, amax)
    monkeypatch.undo()
    assert seen == []
    assert_same(out, R.fake_quant(x, spec, amax), f"fp8 (E, 1, 1) {dtype}")
