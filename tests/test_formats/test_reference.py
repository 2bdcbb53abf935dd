"""The single entry point: quantize / dequantize / fake_quant over every FormatSpec."""

import pytest
import torch
from hypothesis import given, settings, strategies as st

from quantlib.formats import FormatSpec, Kind, QuantizedTensor, Rounding, dequantize, dynamic_amax, fake_quant, quantize

from ._helpers import NAN, assert_bitwise, assert_same, f32, non_contiguous, t32

INT8 = FormatSpec(Kind.INT, num_bits=8)
INT8_FULL = FormatSpec(Kind.INT, num_bits=8, narrow_range=False)
UINT4 = FormatSpec(Kind.INT, num_bits=4, unsigned=True)
INT8_DYN_ROW = FormatSpec(Kind.INT, num_bits=8, dynamic=True)
INT4_BLOCK = FormatSpec(Kind.INT, num_bits=4, block=(16,), dynamic=True)
INT8_BLOCK_2D = FormatSpec(Kind.INT, num_bits=8, block=(2, 4), dynamic=True)
FP8 = FormatSpec(Kind.FP8, element=(4, 3))
FP8_E5M2 = FormatSpec(Kind.FP8, element=(5, 2))
FP8_1x128 = FormatSpec(Kind.FP8_BLOCK, element=(4, 3), block=(128,), dynamic=True)
FP8_128x128_POW2 = FormatSpec(Kind.FP8_BLOCK, element=(4, 3), block=(128, 128), dynamic=True, pow2=True)
FP8_BLOCK_SMALL = FormatSpec(Kind.FP8_BLOCK, element=(4, 3), block=(4,), dynamic=True)
MXFP8 = FormatSpec(Kind.MX, element=(4, 3), block=(32,))
MXFP8_FLOOR = FormatSpec(Kind.MX, element=(4, 3), block=(32,), rounding=Rounding.FLOOR)
MXFP4 = FormatSpec(Kind.MX, element=(2, 1), block=(32,))
MXFP4_FLOOR = FormatSpec(Kind.MX, element=(2, 1), block=(32,), rounding=Rounding.FLOOR)
NVFP4 = FormatSpec(Kind.NVFP4, element=(2, 1), block=(16,))

STATIC = {INT8, INT8_FULL, UINT4, FP8, FP8_E5M2}
ALL = [INT8, INT8_FULL, UINT4, INT8_DYN_ROW, INT4_BLOCK, INT8_BLOCK_2D, FP8, FP8_E5M2, FP8_1x128, FP8_128x128_POW2, FP8_BLOCK_SMALL, MXFP8,
       MXFP8_FLOOR, MXFP4, MXFP4_FLOOR, NVFP4]


def static_amax(x: torch.Tensor, spec: FormatSpec) -> torch.Tensor | None:
    """A per-tensor amax for static formats (NVFP4: a global amax), None for dynamic ones."""
    if spec in STATIC or spec.kind == Kind.NVFP4:
        return x.float().abs().amax()
    return None


def test_int8_per_tensor():
    x = t32([0.5, 1.5, -200.0, 2.5])
    q = quantize(x, INT8, torch.tensor(127.0))
    assert q.codes.dtype == torch.int8 and q.shape == (4,) and q.dtype == torch.float32
    assert_same(q.codes, torch.tensor([0, 2, -127, 2], dtype=torch.int8))
    assert_same(q.scale, torch.tensor(1.0))
    assert_same(dequantize(q), t32([0.0, 2.0, -127.0, 2.0]))
    assert_same(fake_quant(x, INT8_FULL, torch.tensor(127.0)), t32([0.0, 2.0, -128.0, 2.0]))
    assert_same(quantize(t32([20.0, -1.0]), UINT4, torch.tensor(15.0)).codes, torch.tensor([15, 0], dtype=torch.uint8))


def test_int_dynamic_per_row():
    x = t32([[2.0, 1.0], [0.0, 0.0]])
    q = quantize(x, INT8_DYN_ROW)
    assert_same(q.scale, t32([[63.5], [float("inf")]]))
    assert_same(q.codes, torch.tensor([[127, 64], [0, 0]], dtype=torch.int8))
    assert_bitwise(dequantize(q), t32([[2.0, f32(64 / 63.5)], [0.0, 0.0]]))


def test_int4_block_partial_last_block():
    # 20 elements, blocks of 16: block 1 = [7, -3.5, 1, 0.5] -> scale 1; 3.5 -> 4 (even), 0.5 -> 0
    x = t32([14.0] + [0.0] * 15 + [7.0, -3.5, 1.0, 0.5])
    q = quantize(x, INT4_BLOCK)
    assert q.codes.shape == (20,) and q.scale.shape == (2,)
    assert_same(q.scale, t32([0.5, 1.0]))
    assert_same(q.codes[16:], torch.tensor([7, -4, 1, 0], dtype=torch.int8))
    assert_same(dequantize(q), t32([14.0] + [0.0] * 15 + [7.0, -4.0, 1.0, 0.0]))


def test_int_2d_block():
    x = torch.zeros(3, 5)
    x[2, 4] = -127.0
    x[0, 0], x[1, 1] = 254.0, 1.0  # block (0, 0): scale 0.5 -> 1 * 0.5 = 0.5 ties to 0
    q = quantize(x, INT8_BLOCK_2D)
    assert q.scale.shape == (2, 2)
    assert_same(q.scale, t32([[0.5, float("inf")], [float("inf"), 1.0]]))
    expected = torch.zeros(3, 5)
    expected[2, 4], expected[0, 0] = -127.0, 254.0
    assert_same(dequantize(q), expected)


def test_fp8_codes_and_inverse_scale():
    q = quantize(t32([896.0, 1.0]), FP8, torch.tensor(896.0))
    assert q.codes.dtype == torch.float8_e4m3fn
    assert_same(q.scale, torch.tensor(2.0))
    assert_same(q.codes.float(), t32([448.0, 0.5]))
    assert quantize(t32([1.0]), FP8_E5M2, torch.tensor(1.0)).codes.dtype == torch.float8_e5m2


@pytest.mark.parametrize("element", [(4, 3), (5, 2)], ids=str)
def test_fp8_codes_in_chunks_equal_the_formula(element):
    """The chunked codes of export / ``kernels.fp8_cast`` (rows of 64 Ki elements on the CPU: four chunks
    here) equal ``cast_fp8(x * s)`` over the whole tensor, per tensor, per row and for rank 3."""
    from quantlib import kernels
    from quantlib.formats.fp8 import fp8_codes, fp8_quantize, fp8_scale

    g = torch.Generator().manual_seed(1)
    x = (torch.randn(300, 700, generator=g) * 40).to(torch.bfloat16)
    x[0, 0], x[299, 699], x[150, 3] = float("inf"), -float("inf"), NAN
    for amax in (torch.tensor(7.0), x.float().abs().nan_to_num(0, 0, 0).amax(dim=1, keepdim=True) * 0.5):
        want, _ = fp8_quantize(x, amax, element)
        for backend in ("reference", "cpu", "auto"):
            assert_bitwise(kernels.fp8_cast(x, fp8_scale(amax, element), element, backend=backend), want)
    x3, a3 = x.view(3, 100, 700), torch.rand(3, 100, 1, generator=g) + 0.5
    assert_bitwise(fp8_codes(x3, fp8_scale(a3, element), element), fp8_quantize(x3, a3, element)[0])


@pytest.mark.parametrize("element", [(4, 3), (5, 2)], ids=str)
def test_fp8_cast_compiles_fullgraph(element):
    """The op's fake kernel gives the codes' FP8 dtype of each element and the input's shape."""
    from quantlib import kernels

    torch._dynamo.reset()
    x, s = torch.randn(6, 40) * 30, torch.rand(6, 1) + 1.0

    def fn(t, scale):
        return kernels.fp8_cast(t, scale, element)

    assert_bitwise(torch.compile(fn, fullgraph=True, backend="aot_eager")(x, s), fn(x, s))
    torch._dynamo.reset()


def test_fp8_cast_refuses_bad_scale_shape_and_element():
    from quantlib import kernels

    x = torch.ones(4, 8)
    with pytest.raises(ValueError, match=r"fp8_cast: scale must have one element or shape \(4, 1\).*got \(1, 8\)"):
        kernels.fp8_cast(x, torch.ones(1, 8))
    with pytest.raises(ValueError, match=r"fp8_cast: no FP8 dtype for element format \(3, 4\)"):
        kernels.fp8_cast(x, torch.ones(()), (3, 4))
    with pytest.raises(TypeError, match="fp8_cast: input must be float32"):
        kernels.fp8_cast(x.int(), torch.ones(()))


def test_fp8_blockwise_eps_floor():
    q = quantize(torch.zeros(2, 130), FP8_1x128)
    assert q.scale.shape == (2, 2) and q.scale.dtype == torch.float32
    assert_same(q.scale, torch.full((2, 2), f32(f32(1e-10) / 448)))
    assert_same(dequantize(q), torch.zeros(2, 130))
    q2 = quantize(torch.zeros(3, 5), FP8_128x128_POW2)
    assert_same(q2.scale, t32([[2.0**-42]]))


def test_mx_bytes():
    x = torch.zeros(2, 40)
    x[0, 0] = 448.0
    x[1, 35] = NAN
    q = quantize(x, MXFP8)
    assert q.scale.dtype == torch.uint8
    assert_same(q.scale, torch.tensor([[127, 0], [0, 0xFF]], dtype=torch.uint8))
    out = dequantize(q)
    assert_same(out[0], x[0])
    assert_same(out[1], t32([0.0] * 32 + [NAN] * 8))
    q4 = quantize(x, MXFP4)
    assert q4.codes.shape == (2, 20) and q4.codes.dtype == torch.uint8


def test_nvfp4_global_amax_zero():
    q = quantize(torch.zeros(2, 16), NVFP4, torch.tensor(0.0))
    assert_same(q.global_scale, torch.tensor(1.0))
    assert q.scale.dtype == torch.float8_e4m3fn and q.codes.shape == (2, 8)
    assert_same(dequantize(q), torch.zeros(2, 16))
    assert_same(fake_quant(torch.zeros(3, 16), NVFP4), torch.zeros(3, 16))


def test_static_format_without_amax_raises():
    with pytest.raises(ValueError, match="needs an amax"):
        quantize(t32([1.0]), INT8)
    with pytest.raises(ValueError, match="needs an amax"):
        fake_quant(t32([1.0]), FP8)


def test_static_block_amax_shape_is_checked():
    spec = FormatSpec(Kind.INT, num_bits=8, block=(4,))
    with pytest.raises(ValueError, match="does not fit"):
        quantize(torch.zeros(2, 8), spec, torch.ones(2, 3))
    q = quantize(t32([[1.0, 2.0, 3.0, 4.0]]), spec, t32([[127.0]]))
    assert_same(q.codes, torch.tensor([[1, 2, 3, 4]], dtype=torch.int8))


def test_dynamic_amax():
    x = t32([[1.0, -3.0, 0.5, 2.0, 7.0]])
    assert_same(dynamic_amax(x, INT8_DYN_ROW), t32([[7.0]]))
    assert_same(dynamic_amax(x, FP8_BLOCK_SMALL), t32([[3.0, 7.0]]))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_output_is_cast_back_to_the_input_dtype(dtype):
    # INT8, amax 3: fp32 x_hat = 42 / fp32(127/3) = 0.99212..., cast to the input dtype at the end
    x = t32([1.0, 3.0]).to(dtype)
    out = fake_quant(x, INT8, torch.tensor(3.0))
    assert out.dtype == dtype
    assert_bitwise(out, t32([f32(42 / f32(127 / 3)), 3.0]).to(dtype))
    q = quantize(x, INT8, torch.tensor(3.0))
    assert dequantize(q, torch.float32).dtype == torch.float32


@pytest.mark.parametrize("spec", ALL, ids=lambda s: f"{s.kind.value}-{s.block}-{s.element}-{s.rounding.value}")
def test_non_contiguous_matches_contiguous(spec):
    x = torch.randn(2, 130, 6, generator=torch.Generator().manual_seed(6)).transpose(-1, -2) * 3
    assert not x.is_contiguous()
    amax = static_amax(x, spec)
    assert_bitwise(fake_quant(x, spec, amax), fake_quant(x.contiguous(), spec, amax))
    assert_bitwise(fake_quant(non_contiguous(x.contiguous()), spec, amax), fake_quant(x.contiguous(), spec, amax))


SHAPES = [(3, 40), (2, 3, 33), (1, 130), (5, 16), (2, 2, 7)]
DTYPES = [torch.float32, torch.bfloat16, torch.float16]


@st.composite
def inputs(draw):
    shape = draw(st.sampled_from(SHAPES))
    seed = draw(st.integers(0, 2**31 - 1))
    log_scale = draw(st.integers(-20, 12))
    x = torch.randn(shape, generator=torch.Generator().manual_seed(seed)) * 2.0**log_scale
    flat = x.view(-1)
    for _ in range(draw(st.integers(0, 3))):  # specials: zeros, ties, a NaN
        i = draw(st.integers(0, flat.numel() - 1))
        flat[i] = draw(st.sampled_from([0.0, -0.0, 0.25, 2.5, 448.0, 6.0, NAN]))
    if draw(st.booleans()):
        x[..., : x.shape[-1] // 2] = 0.0  # all-zero blocks
    return x.to(draw(st.sampled_from(DTYPES)))


@settings(max_examples=50, deadline=None)
@given(inputs(), st.sampled_from(ALL))
def test_dequantize_of_quantize_equals_fake_quant(x, spec):
    amax = static_amax(x, spec)
    q = quantize(x, spec, amax)
    assert isinstance(q, QuantizedTensor) and q.shape == tuple(x.shape) and q.dtype == x.dtype
    out = fake_quant(x, spec, amax)
    assert out.dtype == x.dtype and out.shape == x.shape
    assert_bitwise(dequantize(q), out)
    # computed in fp32 and cast back at the end: the same as quantizing the fp32 copy
    assert_bitwise(out, fake_quant(x.float(), spec, amax).to(x.dtype))
    # NaN never disappears: a NaN input gives a NaN output in its group
    if torch.isnan(x).any():
        assert torch.isnan(out).any()
