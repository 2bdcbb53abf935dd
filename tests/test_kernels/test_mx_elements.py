"""MXFP6 (E3M2, E2M3) and MXINT8 on every backend that runs here: the C++ CPU kernels (each compiled
instruction set) bit for bit against the torch reference, and the "cuda" backend's declaration that it has
no kernel for them (Triton's interpreter tests are in test_triton_kernels.py)."""

from __future__ import annotations

import pytest
import torch

from quantlib import kernels
from quantlib.formats import FormatSpec, Kind, Rounding
from quantlib.kernels import backends, cuda_impl, reference_impl as REF
from quantlib.kernels.backends import KernelUnavailable

from ._compare import assert_same

NAN, INF = float("nan"), float("inf")
DTYPES = (torch.float32, torch.bfloat16, torch.float16)
ELEMS = {"e3m2": (3, 2), "e2m3": (2, 3), "int8": 8}
Q = {"e3m2": 28.0, "e2m3": 7.5, "int8": 127.0}


def spec_of(elem: str, rounding: Rounding = Rounding.RCEIL) -> FormatSpec:
    element = ELEMS[elem]
    if element == 8:
        return FormatSpec(Kind.MX, num_bits=8, block=(32,), rounding=rounding)
    return FormatSpec(Kind.MX, element=element, block=(32,), rounding=rounding)


def edge_blocks(dtype: torch.dtype, seed: int = 0, cols: int = 200) -> torch.Tensor:
    """Rows of blocks whose amax spans many binades, a zero block, a NaN and an Inf block, subnormal
    fp32 / fp16 values, -0.0, grid ties of both FP6 formats next to an amax of Q, and a partial block."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(12, cols, generator=g) * torch.exp2(torch.randint(-12, 12, (12, 1), generator=g).float())
    x[0, :32] = 0.0
    x[1, 40] = NAN
    x[2, 70] = -INF
    x[3, :8] = torch.tensor([28.0, 0.03125, 0.09375, 26.0, 22.0, -0.0, 1e-40, 2.0**-20])
    x[4, :8] = torch.tensor([7.5, 0.0625, 0.1875, 7.25, 3.875, -1.0625, 2.0**-24, 5.9604645e-08])
    x[5, :6] = torch.tensor([127.0, 0.5, 1.5, -2.5, 126.5, -0.4])
    return x.to(dtype)


# --------------------------------------------------------------------------- the C++ CPU kernels

C = None
try:
    import quantlib._C as C  # noqa: N812
except ImportError:
    pass
needs_ext = pytest.mark.skipif(C is None, reason="the C++ extension quantlib._C is not built")
ISAS = tuple(C.cpu_available_isas()) if C is not None else ()


@pytest.fixture(params=ISAS or ["none"])
def isa(request):
    """Run the test with one compiled variant of the kernels, then go back to the widest."""
    if C is None:
        pytest.skip("the C++ extension quantlib._C is not built")
    C.cpu_set_isa(request.param)
    yield request.param
    C.cpu_set_isa(ISAS[0])


@needs_ext
@pytest.mark.parametrize("elem", list(ELEMS))
@pytest.mark.parametrize("rounding", [Rounding.RCEIL, Rounding.FLOOR], ids=lambda r: r.value)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_cpu_matches_reference(elem, rounding, dtype, isa):
    from quantlib.kernels import cpu_impl as CPU

    x = edge_blocks(dtype, seed=len(elem) + int(dtype == torch.float16))
    spec = spec_of(elem, rounding)
    assert_same(CPU.fake_quant(x, spec, None), REF.fake_quant(x, spec, None), f"fake {elem}")
    assert_same(CPU.mx_cast(x, elem, 32, rounding), REF.mx_cast(x, elem, 32, rounding), f"cast {elem}")


def random_bits(seed: int, rows: int = 64) -> torch.Tensor:
    """Finite fp32 values with uniformly random bit patterns: every binade, fp32 subnormals, and block
    amax up to 3.4e38 and down to 1e-45 (exponents clamped at +-127)."""
    g = torch.Generator().manual_seed(seed)
    bits = torch.randint(-(2**31), 2**31 - 1, (rows, 96), generator=g, dtype=torch.int64).to(torch.int32)
    x = bits.view(torch.float32)
    x = torch.where(torch.isfinite(x), x, torch.zeros(()))
    x[:8] *= 2.0**-100  # tiny blocks
    return x


@needs_ext
@pytest.mark.parametrize("elem", list(ELEMS))
@pytest.mark.parametrize("rounding", [Rounding.RCEIL, Rounding.FLOOR], ids=lambda r: r.value)
def test_cpu_random_bit_patterns(elem, rounding):
    from quantlib.kernels import cpu_impl as CPU

    x = random_bits(seed=len(elem))
    spec = spec_of(elem, rounding)
    assert_same(CPU.fake_quant(x, spec, None), REF.fake_quant(x, spec, None), f"fake {elem}")
    assert_same(CPU.mx_cast(x, elem, 32, rounding), REF.mx_cast(x, elem, 32, rounding), f"cast {elem}")


@needs_ext
@pytest.mark.parametrize("elem", list(ELEMS))
def test_cpu_every_bf16_value_up_to_q(elem, isa):
    from quantlib.kernels import cpu_impl as CPU

    mags = (torch.arange(0, 0x7F80, dtype=torch.int32) << 16).view(torch.float32)
    mags = mags[mags <= Q[elem]]
    vals = torch.cat([mags, -mags, torch.zeros((-2 * mags.numel()) % 31)]).view(-1, 31)
    x = torch.cat([torch.full((vals.shape[0], 1), Q[elem]), vals], dim=1)
    assert_same(CPU.mx_cast(x, elem, 32, Rounding.RCEIL), REF.mx_cast(x, elem, 32, Rounding.RCEIL), elem)
    assert_same(CPU.fake_quant(x, spec_of(elem), None), REF.fake_quant(x, spec_of(elem), None), elem)


@needs_ext
@pytest.mark.parametrize("elem", list(ELEMS))
def test_cpu_non_contiguous_matches_contiguous(elem):
    from quantlib.kernels import cpu_impl as CPU

    x = edge_blocks(torch.bfloat16, cols=72).t()  # (72, 12): strided, partial blocks of 12
    assert_same(CPU.fake_quant(x, spec_of(elem), None), REF.fake_quant(x.contiguous(), spec_of(elem), None))
    assert_same(CPU.mx_cast(x, elem, 32, Rounding.FLOOR), REF.mx_cast(x.contiguous(), elem, 32, Rounding.FLOOR))


@needs_ext
@pytest.mark.parametrize("elem,fmt", [("e3m2", "mxfp6_e3m2"), ("e2m3", "mxfp6_e2m3"), ("int8", "mxint8")])
def test_public_cast_dequantizes_to_fake_quant(elem, fmt):
    x = edge_blocks(torch.float32, seed=9)[6:]  # finite rows
    codes, e = kernels.mx_cast(x, elem, backend="cpu")
    assert codes.dtype == (torch.int8 if elem == "int8" else torch.uint8)
    assert_same(kernels.dequantize(codes, e, fmt), REF.fake_quant(x, spec_of(elem), None))


def test_public_cast_refuses_unknown_element():
    with pytest.raises(ValueError, match="mx_cast: elem must be one of"):
        kernels.mx_cast(torch.zeros(2, 32), "e5m2", backend="reference")


# --------------------------------------------------------------------------- the "cuda" backend declares them a gap


@pytest.fixture
def vector_ok(monkeypatch):
    """Every shape acceptable to the CUDA kernels, so their case declaration itself runs on the CPU."""
    monkeypatch.setattr(cuda_impl, "_vector_ok", lambda x: True)


@pytest.mark.parametrize("elem", list(ELEMS))
def test_cuda_backend_declares_mxfp6_and_mxint8_a_gap_and_refuses_them(elem, vector_ok):
    """The CUDA kernels implement MXFP8 and MXFP4 only: asked for explicitly, the others are refused by op, case
    and backend (they used to run Triton without a word); AUTO runs them with the next backend."""
    x = torch.zeros(4, 64)
    assert elem in backends.uncovered("mx_cast", "cuda", x, elem, 32, Rounding.RCEIL)
    assert str(spec_of(elem).kind.value) in backends.uncovered("fake_quant", "cuda", x, spec_of(elem), None)
    with pytest.raises(KernelUnavailable, match="op 'fake_quant': kind 'mx' .* has no kernel in backend 'cuda'"):
        cuda_impl.fake_quant(x, spec_of(elem), None)
    with pytest.raises(KernelUnavailable, match=f"op 'mx_cast': element {elem}, .* has no kernel in backend 'cuda'"):
        backends.implementation("mx_cast", "cuda")(x, elem, 32, Rounding.RCEIL)


def test_cuda_backend_covers_mxfp8_and_mxfp4(vector_ok):
    x = torch.zeros(4, 64)
    for element, elem in (((4, 3), "e4m3"), ((2, 1), "e2m1")):
        assert backends.uncovered("fake_quant", "cuda", x, FormatSpec(Kind.MX, element=element, block=(32,)), None) is None
        assert backends.uncovered("mx_cast", "cuda", x, elem, 32, Rounding.RCEIL) is None


# --------------------------------------------------------------------------- ModelOpt's CUDA MX fake quant


@pytest.mark.gpu
@pytest.mark.slow  # the first call builds ModelOpt's MX extension (minutes)
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("elem,mo_type", [("e3m2", "E3M2"), ("e2m3", "E2M3"), ("int8", "INT8")])
def test_auto_backend_equals_modelopts_cuda_fake_quant(elem, mo_type):
    """ModelOpt 0.47's ``fused_amax_convert`` (the MXFP6 / MXINT8 presets' fake quant) on finite inputs.

    Its extension is built with --use_fast_math, so its ``amax / Q`` may be off by an ulp: blocks whose
    quotient lies within 4 ulp of a power of two (where the exponent could then differ) are left out."""
    from modelopt.torch.quantization.extensions import get_cuda_ext_mx

    ext = get_cuda_ext_mx()
    if ext is None:
        pytest.skip("ModelOpt's CUDA MX extension does not build here")
    g = torch.Generator().manual_seed(7)
    x = torch.randn(256, 1024, generator=g) * torch.exp2(torch.randint(-20, 20, (256, 1), generator=g).float())
    theirs = ext.fused_amax_convert(x.cuda(), 32, getattr(ext.Types, mo_type), ext.Types.E8M0, None).cpu()
    ours = kernels.fake_quant(x.cuda(), spec_of(elem), None, backend="auto").cpu()
    ratio = x.abs().view(-1, 32).amax(dim=1) / Q[elem]
    pow2 = torch.exp2(torch.round(torch.log2(ratio)))
    near = (ratio - pow2).abs() <= 4 * torch.finfo(torch.float32).eps * pow2
    same = (ours.view(-1, 32) == theirs.view(-1, 32)).all(dim=1)
    assert bool(same[~near].all()), f"{int((~same & ~near).sum())} blocks differ"
    assert int((~near).sum()) > 0.9 * near.numel()


@pytest.mark.parametrize("elem", list(ELEMS))
def test_mx_cast_compiles_fullgraph(elem):
    """The op's fake kernel gives the codes' dtype and shape of each element (uint8 FP6, int8 INT8)."""
    torch._dynamo.reset()
    x = edge_blocks(torch.float32, seed=2)[6:]

    def fn(t):
        return kernels.mx_cast(t, elem, backend="reference")

    assert_same(torch.compile(fn, fullgraph=True, backend="aot_eager")(x), fn(x))
    torch._dynamo.reset()
