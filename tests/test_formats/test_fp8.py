"""FP8 E4M3 / E5M2 per tensor / per channel with a static amax; hand-computed."""

import pytest
import torch
from hypothesis import given, settings, strategies as st

from quantlib.formats.fp8 import cast_fp8, fp8_dequantize, fp8_dtype, fp8_fake_quant, fp8_quantize, fp8_scale

from ._helpers import INF, NAN, assert_bitwise, assert_same, f32, non_contiguous, t32

E4M3, E5M2 = (4, 3), (5, 2)


def test_dtypes():
    assert fp8_dtype(E4M3) == torch.float8_e4m3fn and fp8_dtype(E5M2) == torch.float8_e5m2
    with pytest.raises(ValueError, match="no FP8 dtype"):
        fp8_dtype((2, 1))


def test_e4m3_round_half_even_and_saturation():
    # amax 448 -> s = 1
    x = t32([1.0625, 1.1875, 2.0**-9, 2.0**-10, 3 * 2.0**-10, 500.0, -1000.0, 464.0, 0.0])
    codes, inv = fp8_quantize(x, torch.tensor(448.0), E4M3)
    assert codes.dtype == torch.float8_e4m3fn
    assert_same(inv, torch.tensor(1.0))
    assert_same(codes.float(), t32([1.0, 1.25, 2.0**-9, 0.0, 2.0**-8, 448.0, -448.0, 448.0, 0.0]))


def test_e5m2_round_half_even_and_saturation():
    # amax 57344 -> s = 1: 1.125 ties to 1.0, 1.375 ties to 1.5, 2^-16 is the smallest subnormal
    x = t32([1.125, 1.375, 2.0**-16, 2.0**-17, 60000.0, -1e9, 3.0])
    codes, _ = fp8_quantize(x, torch.tensor(57344.0), E5M2)
    assert codes.dtype == torch.float8_e5m2
    assert_same(codes.float(), t32([1.0, 1.5, 2.0**-16, 0.0, 57344.0, -57344.0, 3.0]))


def test_non_power_of_two_amax():
    # amax 3 -> s = fp32(448/3); 1 * s = 149.33 -> 144 (spacing 16); x_hat = 144 * fp32(1/s)
    s = f32(448 / 3)
    inv = f32(1 / s)
    codes, inv_out = fp8_quantize(t32([1.0, 3.0, -0.1]), torch.tensor(3.0), E4M3)
    assert_same(inv_out, torch.tensor(inv))
    # -0.1 * s = -14.93 -> -15 (spacing 1 in [8, 16))
    assert_same(codes.float(), t32([144.0, 448.0, -15.0]))
    assert_bitwise(fp8_fake_quant(t32([1.0, 3.0, -0.1]), torch.tensor(3.0), E4M3), t32([f32(144 * inv), f32(448 * inv), f32(-15 * inv)]))


def test_scale_is_one_ieee_division():
    # Q / a rounded once; torch's `448 / tensor` (reciprocal, then multiply) is one ulp off for a = 3
    s = fp8_scale(t32([0.3, 3.0, 7.0]), E4M3)
    assert_bitwise(s, t32([f32(448 / f32(0.3)), f32(448 / 3), f32(448 / 7)]))


@pytest.mark.parametrize("amax", [0.0, 2.0**-24, 1e-30])
def test_all_zero_block(amax):
    # a <= 2^-24 -> a' = 1 -> s = Q: finite scale, zeros stay zeros, small values keep their size
    codes, inv = fp8_quantize(t32([0.0, 2.0**-20, -(2.0**-30)]), torch.tensor(amax), E4M3)
    assert_same(inv, torch.tensor(f32(1 / 448)))
    # 2^-20 * 448 = 1.75 * 2^-12 -> below 2^-10 -> 0 ; 2^-30 * 448 -> 0
    assert_same(codes.float(), t32([0.0, 0.0, -0.0]))
    out = fp8_fake_quant(t32([0.0, 1.0]), torch.tensor(amax), E4M3)
    assert_same(out, t32([0.0, f32(448 * f32(1 / 448))]))


def test_amax_just_above_tiny_threshold_is_used():
    a = 2.0**-23
    _, inv = fp8_quantize(t32([a]), torch.tensor(a), E4M3)
    assert_same(inv, torch.tensor(f32(1 / f32(448 / a))))
    assert_same(fp8_fake_quant(t32([a]), torch.tensor(a), E4M3), t32([a]))


def test_per_channel_amax():
    x = t32([[448.0, 1.0625], [2.0, -4.0]])
    amax = t32([[448.0], [4.0]])  # row 1: s = 112, 2 * 112 = 224 exact, -448 exact
    assert_same(fp8_fake_quant(x, amax, E4M3), t32([[448.0, 1.0], [2.0, -4.0]]))


def test_nan_block():
    codes, _ = fp8_quantize(t32([NAN, 1.0]), torch.tensor(448.0), E4M3)
    assert_same(codes.float(), t32([NAN, 1.0]))
    assert_same(fp8_fake_quant(t32([NAN, 1.0]), torch.tensor(448.0), E5M2), t32([NAN, 1.0]))
    # NaN amax: everything NaN
    assert torch.isnan(fp8_fake_quant(t32([0.0, 1.0]), torch.tensor(NAN), E4M3)).all()


def test_inf_block():
    # static amax: Inf saturates at Q / s = a
    assert_same(fp8_fake_quant(t32([INF, -INF]), torch.tensor(448.0), E4M3), t32([448.0, -448.0]))
    # Inf amax: s = 0, every output NaN (never a silently finite value)
    assert torch.isnan(fp8_fake_quant(t32([1.0, 0.0]), torch.tensor(INF), E4M3)).all()


def test_cast_fp8_clamps_before_the_cast():
    # without the clamp 480 would be NaN in E4M3 (no Inf)
    assert_same(cast_fp8(t32([480.0, -1e30]), E4M3).float(), t32([448.0, -448.0]))


def test_three_d_input():
    x = torch.zeros(2, 3, 4)
    x[1, 2] = t32([448.0, 1.0625, -17.0, 0.0])  # -17 -> -16 (spacing 2 in [16, 32), tie to even)
    assert_same(fp8_fake_quant(x, torch.tensor(448.0), E4M3)[1, 2], t32([448.0, 1.0, -16.0, 0.0]))
    amax = t32([448.0, 448.0, 57344.0]).reshape(1, 3, 1)
    out = fp8_fake_quant(x, amax, E5M2)
    # E5M2 row with a = 57344: s = 1, 1.0625 -> 1.0 ; -17 -> -16
    assert_same(out[1, 2], t32([448.0, 1.0, -16.0, 0.0]))


def test_non_contiguous_matches_contiguous():
    x = torch.randn(6, 5, generator=torch.Generator().manual_seed(3)) * 100
    amax = x.abs().amax(dim=1, keepdim=True)
    for element in (E4M3, E5M2):
        assert_bitwise(fp8_fake_quant(non_contiguous(x), amax, element), fp8_fake_quant(x, amax, element))
        c1, i1 = fp8_quantize(x.t(), amax.t(), element)
        c2, i2 = fp8_quantize(x.t().contiguous(), amax.t(), element)
        assert_bitwise(c1, c2)
        assert_bitwise(i1, i2)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_input_dtypes_compute_in_fp32(dtype):
    x = t32([1.0, 3.0]).to(dtype)
    s = f32(448 / 3)
    inv = f32(1 / s)
    out = fp8_fake_quant(x, torch.tensor(3.0, dtype=dtype), E4M3)
    assert_bitwise(out, t32([f32(144 * inv), f32(448 * inv)]))


def test_dequantize_is_codes_times_inverse_scale():
    codes = t32([144.0, -15.0]).to(torch.float8_e4m3fn)
    inv = torch.tensor(f32(1 / f32(448 / 3)))
    assert_bitwise(fp8_dequantize(codes, inv), t32([f32(144 * inv.item()), f32(-15 * inv.item())]))


def _e4m3_oracle(v: float) -> float:
    """Nearest E4M3 value by exhaustive search over the 127 finite magnitudes, ties to the even code."""
    grid = [(m / 8) * 2.0**-6 for m in range(8)] + [(1 + m / 8) * 2.0 ** (e - 7) for e in range(1, 16) for m in range(8)]
    grid = [g for g in grid if g <= 448.0]
    mag = min(abs(v), 448.0)
    i = min(range(len(grid)), key=lambda j: (abs(grid[j] - mag), j % 2))
    return grid[i] if v >= 0 else -grid[i]


@settings(max_examples=60, deadline=None)
@given(st.lists(st.floats(-600.0, 600.0, width=32), min_size=1, max_size=10))
def test_e4m3_cast_matches_exhaustive_nearest(values):
    codes, _ = fp8_quantize(t32(values), torch.tensor(448.0), E4M3)
    assert_same(codes.float().abs(), t32([abs(_e4m3_oracle(v)) for v in values]))


def test_subnormal_amax():
    # a subnormal amax is <= 2^-24: a' = 1, s = 448
    _, inv = fp8_quantize(t32([2.0**-140]), torch.tensor(2.0**-140), E4M3)
    assert_same(inv, torch.tensor(f32(1 / 448)))
    assert_same(fp8_fake_quant(t32([2.0**-140]), torch.tensor(2.0**-140), E4M3), t32([0.0]))
