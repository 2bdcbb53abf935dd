"""MXFP8 / MXFP4: E8M0 bytes per 32 elements and the element casts, hand-computed."""

import pytest
import torch
from hypothesis import given, settings, strategies as st

from quantlib.formats.mx import mx_dequantize, mx_fake_quant, mx_quantize
from quantlib.formats.spec import Rounding

from ._helpers import INF, NAN, assert_bitwise, assert_same, next_up, non_contiguous, t32

RCEIL, FLOOR = Rounding.RCEIL, Rounding.FLOOR


def byte(values) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.uint8)


def block(head, n=32) -> list[float]:
    """A block of ``n`` elements starting with ``head``, the rest zeros."""
    return list(head) + [0.0] * (n - len(head))


@pytest.mark.parametrize("elem", ["e4m3", "e2m1"])
@pytest.mark.parametrize("rounding", [RCEIL, FLOOR])
def test_all_zero_block(elem, rounding):
    x = torch.zeros(2, 64)
    codes, b = mx_quantize(x, elem, 32, rounding)
    assert_same(b, byte([[0, 0], [0, 0]]))
    if elem == "e4m3":
        assert_same(codes, torch.zeros(2, 64, dtype=torch.float8_e4m3fn))
    else:
        assert_same(codes, torch.zeros(2, 32, dtype=torch.uint8))
    assert_same(mx_fake_quant(x, elem, 32, rounding), torch.zeros(2, 64))


@pytest.mark.parametrize("elem", ["e4m3", "e2m1"])
@pytest.mark.parametrize("bad", [NAN, INF, -INF])
def test_nan_block(elem, bad):
    # block 0 holds NaN/Inf: byte 0xFF and NaN everywhere in it; block 1 (amax 6 or 448 -> e = 0) is intact
    q = 448.0 if elem == "e4m3" else 6.0
    x = t32(block([1.0, bad]) + block([q, -2.0, 0.5]))
    codes, b = mx_quantize(x, elem, 32, RCEIL)
    assert_same(b, byte([0xFF, 127]))
    expected = t32([NAN] * 32 + block([q, -2.0, 0.5]))
    assert_same(mx_fake_quant(x, elem, 32, RCEIL), expected)
    assert_same(mx_fake_quant(x, elem, 32, FLOOR), expected)


@pytest.mark.parametrize("rounding", [RCEIL, FLOOR])
def test_inf_block(rounding):
    x = t32(block([INF, 3.0]) + block([-INF]))
    _, b = mx_quantize(x, "e4m3", 32, rounding)
    assert_same(b, byte([0xFF, 0xFF]))
    assert torch.isnan(mx_fake_quant(x, "e4m3", 32, rounding)).all()


def test_amax_at_power_of_two_boundary_rceil_vs_floor():
    # amax 448 * 2^2: both rules give e = 2 and the block is exact at scale 4
    x = t32(block([1792.0, 2.0**-7, -3.0]))
    for rounding in (RCEIL, FLOOR):
        assert_same(mx_quantize(x, "e4m3", 32, rounding)[1], byte([129]))
        assert_same(mx_fake_quant(x, "e4m3", 32, rounding), x)
    # one ulp above: RCEIL moves to e = 3 (2^-7 / 8 = 2^-10, a tie between 0 and 2^-9 -> 0);
    # FLOOR stays at e = 2 and the amax element saturates at 448 * 4
    a = next_up(1792.0)
    x = t32(block([a, 2.0**-7, -3.0]))
    assert_same(mx_quantize(x, "e4m3", 32, RCEIL)[1], byte([130]))
    assert_same(mx_fake_quant(x, "e4m3", 32, RCEIL), t32(block([1792.0, 0.0, -3.0])))
    assert_same(mx_quantize(x, "e4m3", 32, FLOOR)[1], byte([129]))
    assert_same(mx_fake_quant(x, "e4m3", 32, FLOOR), t32(block([1792.0, 2.0**-7, -3.0])))


def test_amax_between_q_and_next_power_rceil_vs_floor():
    # amax 2000: RCEIL e = ceil(log2(2000/448)) = 3, 2000/8 = 250 -> 256 (spacing 16) -> 2048;
    # FLOOR e = floor(log2 2000) - 8 = 2, 2000/4 = 500 -> clamp 448 -> 1792
    x = t32(block([2000.0]))
    assert_same(mx_fake_quant(x, "e4m3", 32, RCEIL), t32(block([2048.0])))
    assert_same(mx_fake_quant(x, "e4m3", 32, FLOOR), t32(block([1792.0])))


def test_mxfp4_amax_7_rceil_vs_floor():
    # RCEIL: e = ceil(log2(7/6)) = 1 -> 3.5 ties to 4 -> 8, 0.75 -> 0.375 -> 0.5 -> 1.0
    # FLOOR: e = floor(log2 7) - 2 = 0 -> 7 saturates to 6, 0.75 ties to 1.0
    x = t32(block([7.0, 0.75, -1.25]))
    assert_same(mx_quantize(x, "e2m1", 32, RCEIL)[1], byte([128]))
    assert_same(mx_fake_quant(x, "e2m1", 32, RCEIL), t32(block([8.0, 1.0, -1.0])))
    assert_same(mx_quantize(x, "e2m1", 32, FLOOR)[1], byte([127]))
    assert_same(mx_fake_quant(x, "e2m1", 32, FLOOR), t32(block([6.0, 1.0, -1.0])))


def test_e4m3_elements_round_half_even():
    # amax 448 -> e = 0: 1.0625 ties to 1.0, 1.1875 ties to 1.25, 2^-10 ties to 0, 3 * 2^-10 ties to 2^-8
    x = t32(block([448.0, 1.0625, 1.1875, 2.0**-10, 3 * 2.0**-10, -1.0625]))
    assert_same(mx_fake_quant(x, "e4m3", 32, RCEIL), t32(block([448.0, 1.0, 1.25, 0.0, 2.0**-8, -1.0])))


def test_subnormal_amax():
    # fp32-subnormal amax: byte 0 (2^-127); elements 2^-140 / 2^-127 = 2^-13 underflow E4M3 -> 0
    x = t32(block([2.0**-140, -(2.0**-141)]))
    for rounding in (RCEIL, FLOOR):
        assert_same(mx_quantize(x, "e4m3", 32, rounding)[1], byte([0]))
        assert_same(mx_fake_quant(x, "e4m3", 32, rounding), torch.zeros(32))


def test_small_normal_amax_clamps_exponent_at_minus_127():
    # RCEIL: ceil(log2(2^-120 / 448)) = -128 -> clamp -127 -> 2^-120 * 2^127 = 128 exact, 2^-135 -> 2^-8 exact
    x = t32(block([2.0**-120, 2.0**-135]))
    assert_same(mx_quantize(x, "e4m3", 32, RCEIL)[1], byte([0]))
    assert_same(mx_fake_quant(x, "e4m3", 32, RCEIL), x)


def test_partial_last_block():
    # 40 elements: block 1 has 8 real ones, amax 14 -> 14/448 = 2^-5 -> e = -5
    head = block([448.0, 1.0])
    tail = [14.0, -7.0, 0.4375, 0.0, 0.0, 0.0, 0.0, 1.0]
    x = t32(head + tail)
    codes, b = mx_quantize(x, "e4m3", 32, RCEIL)
    assert codes.shape == (40,)
    assert_same(b, byte([127, 122]))
    assert_same(mx_fake_quant(x, "e4m3", 32, RCEIL), x)
    packed, b4 = mx_quantize(x, "e2m1", 32, RCEIL)
    assert packed.shape == (20,) and packed.dtype == torch.uint8
    # E2M1 block 1: 14/6 -> e = 2, elements /4: 3.5 -> 4, -1.75 -> -2, 0.109 -> 0, 0.25 -> 0
    assert_same(b4, byte([127 + 7, 129]))  # block 0: ceil(log2(448/6)) = 7
    out = mx_fake_quant(x, "e2m1", 32, RCEIL)
    assert_same(out[32:], t32([16.0, -8.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0]))


def test_odd_length_mxfp4():
    x = t32([6.0, 1.0, -0.5])
    packed, b = mx_quantize(x, "e2m1", 32, RCEIL)
    assert_same(packed, byte([0x27, 0x09]))  # codes 7, 2 | 9 (-0.5), padding 0
    assert_same(b, byte([127]))
    assert_same(mx_dequantize(packed, b, "e2m1", 32, 3), x)


def test_mxfp4_packing_low_nibble_is_even_index():
    x = t32(block([6.0, 1.0, -3.0, 0.5]))
    packed, _ = mx_quantize(x, "e2m1", 32, RCEIL)
    assert_same(packed[:2], byte([0x27, 0x1D]))


def test_three_d_input():
    x = torch.zeros(2, 3, 32)
    x[1, 2, 0], x[1, 2, 5] = 100.0, 0.1  # 100/448 -> e = -2: 400 ties 384 | 416 -> 384 -> 96; 0.4 -> 0.40625
    x[0, 1, 3] = -448.0
    codes, b = mx_quantize(x, "e4m3", 32, RCEIL)
    expected_b = torch.zeros(2, 3, 1, dtype=torch.uint8)
    expected_b[1, 2, 0], expected_b[0, 1, 0] = 125, 127
    assert_same(b, expected_b)
    expected = torch.zeros(2, 3, 32)
    expected[1, 2, 0], expected[1, 2, 5], expected[0, 1, 3] = 96.0, 0.1015625, -448.0
    assert_same(mx_fake_quant(x, "e4m3", 32, RCEIL), expected)


@pytest.mark.parametrize("elem", ["e4m3", "e2m1"])
@pytest.mark.parametrize("rounding", [RCEIL, FLOOR])
def test_non_contiguous_matches_contiguous(elem, rounding):
    x = torch.randn(64, 6, generator=torch.Generator().manual_seed(0)).t()
    assert not x.is_contiguous()
    c1, b1 = mx_quantize(x, elem, 32, rounding)
    c2, b2 = mx_quantize(x.contiguous(), elem, 32, rounding)
    assert_bitwise(c1, c2)
    assert_same(b1, b2)
    assert_bitwise(mx_fake_quant(non_contiguous(x.contiguous()), elem, 32, rounding), mx_fake_quant(x.contiguous(), elem, 32, rounding))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_input_dtypes_compute_in_fp32(dtype):
    x = t32(block([448.0, 1.0625, -0.3125])).to(dtype)  # all exact in bf16 / fp16
    codes, b = mx_quantize(x, "e4m3", 32, RCEIL)
    assert_same(b, byte([127]))
    assert_same(codes.float(), t32(block([448.0, 1.0, -0.3125])))
    assert mx_fake_quant(x, "e4m3", 32, RCEIL).dtype == torch.float32


@settings(max_examples=40, deadline=None)
@given(
    st.lists(st.floats(-1e6, 1e6, width=32), min_size=1, max_size=70),
    st.sampled_from(["e4m3", "e2m1"]),
    st.sampled_from([RCEIL, FLOOR]),
)
def test_rceil_never_saturates_and_elements_fit(values, elem, rounding):
    x = t32(values)
    codes, b = mx_quantize(x, elem, 32, rounding)
    q = 448.0 if elem == "e4m3" else 6.0
    out = mx_fake_quant(x, elem, 32, rounding)
    scale = (2.0 ** (b.to(torch.float64) - 127)).repeat_interleave(32)[: x.numel()]
    assert (out.double().abs() <= q * scale).all()
    if rounding == RCEIL:
        # the block amax is never clipped: it lands within half an element ulp of itself
        amax = x.abs().reshape(-1).tolist()
        for i in range(0, len(amax), 32):
            blk = amax[i : i + 32]
            j = i + max(range(len(blk)), key=blk.__getitem__)
            assert abs(out[j].item()) >= abs(x[j].item()) * (0.75 if elem == "e2m1" else 0.9375) - 1e-30
