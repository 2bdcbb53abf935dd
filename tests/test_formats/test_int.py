"""INT formats: signed narrow / full range, unsigned, tiny amax, NaN groups; hand-computed."""

import pytest
import torch
from hypothesis import given, settings, strategies as st

from quantlib.formats.int import code_dtype, int_codes, int_dequant, int_fake_quant, int_range

from ._helpers import INF, NAN, assert_bitwise, assert_same, f32, non_contiguous, t32


def test_ranges():
    assert int_range(8, False, True) == (-127.0, 127.0)
    assert int_range(8, False, False) == (-128.0, 127.0)
    assert int_range(8, True, True) == (0.0, 255.0)
    assert int_range(4, False, True) == (-7.0, 7.0)
    assert int_range(4, True, False) == (0.0, 15.0)
    assert (code_dtype(8, False), code_dtype(8, True), code_dtype(4, False), code_dtype(16,
                                                                                        False)) == (torch.int8, torch.uint8, torch.int8,
                                                                                                    torch.int32)


def test_narrow_range_round_half_even_and_clamp():
    # amax 127 -> scale 1
    x = t32([0.5, 1.5, 2.5, -0.5, -1.5, 126.5, 200.0, -200.0, -127.5])
    q, scale = int_codes(x, torch.tensor(127.0), 8, False, True)
    assert_same(scale, torch.tensor(1.0))
    assert_same(q, t32([0.0, 2.0, 2.0, -0.0, -2.0, 126.0, 127.0, -127.0, -127.0]))


def test_full_range_reaches_minus_q_minus_1():
    x = t32([-200.0, -127.5, -128.0, 127.6])
    assert_same(int_fake_quant(x, torch.tensor(127.0), 8, narrow_range=False), t32([-128.0, -128.0, -128.0, 127.0]))
    assert_same(int_fake_quant(t32([-9.0, -7.6]), torch.tensor(7.0), 4, narrow_range=False), t32([-8.0, -8.0]))
    assert_same(int_fake_quant(t32([-9.0, -7.6]), torch.tensor(7.0), 4), t32([-7.0, -7.0]))


def test_unsigned():
    # 4 bits: Q = 15, amax 15 -> scale 1; negatives clamp to 0
    x = t32([-1.0, 7.5, 8.5, 20.0, 0.49])
    assert_same(int_fake_quant(x, torch.tensor(15.0), 4, unsigned=True), t32([0.0, 8.0, 8.0, 15.0, 0.0]))
    q, scale = int_codes(t32([255.0, 1.0]), torch.tensor(255.0), 8, True, True)
    assert_same(q, t32([255.0, 1.0]))


def test_non_power_of_two_scale():
    # amax 2 -> scale 63.5: 1 -> 63.5 -> 64 (even); 0.5 -> 31.75 -> 32; x_hat = q / 63.5 in fp32
    out = int_fake_quant(t32([1.0, 0.5, -2.0]), torch.tensor(2.0), 8)
    assert_bitwise(out, t32([f32(64 / 63.5), f32(32 / 63.5), -2.0]))
    # amax 3 -> scale fp32(127/3); 1 -> 42.33 -> 42
    s = f32(127 / 3)
    out = int_fake_quant(t32([1.0, 3.0]), torch.tensor(3.0), 8)
    assert_bitwise(out, t32([f32(42 / s), f32(127 / s)]))


def test_scale_is_one_ieee_division():
    # Q / a rounded once; torch's `127 / tensor` (reciprocal, then multiply) is one ulp off for a = 3
    _, scale = int_codes(t32([0.0, 0.0, 0.0]), t32([3.0, 0.1, 2.0]), 8, False, True)
    assert_bitwise(scale, t32([f32(127 / 3), f32(127 / f32(0.1)), 63.5]))


def test_dequant_divides_by_the_scale():
    # q / scale and q * (a / Q) differ in the last bit for some a: the contract is the division
    s = f32(127 / 0.1)
    q, scale = int_codes(t32([0.05]), t32([0.1]), 8, False, True)
    assert_same(scale, t32([s]))
    assert_bitwise(int_dequant(q, scale), t32([f32(q.item() / s)]))


@pytest.mark.parametrize("amax", [0.0, 2.0**-24, 1e-30, 1e-45])
def test_all_zero_block(amax):
    # a <= 2^-24 quantizes the group to 0 (codes and values), never NaN
    x = t32([0.0, 1e-30, -3.0, 5.0])
    q, _ = int_codes(x, torch.tensor(amax), 8, False, True)
    assert_same(q, torch.zeros(4))
    assert_same(int_fake_quant(x, torch.tensor(amax), 8), torch.zeros(4))


def test_amax_just_above_tiny_threshold():
    a = 2.0**-23
    s = f32(127 / a)
    out = int_fake_quant(t32([a, a / 2]), torch.tensor(a), 8)
    assert_bitwise(out, t32([f32(127 / s), f32(64 / s)]))  # a/2 * s = 63.5 -> 64


def test_per_channel_amax():
    x = t32([[1.0, -1.0, 0.5], [10.0, 3.0, -20.0]])
    amax = t32([[127.0], [0.0]])
    assert_same(int_fake_quant(x, amax, 8), t32([[1.0, -1.0, 0.0], [0.0, 0.0, 0.0]]))


def test_nan_block():
    # a NaN cannot be an integer code: its code is 0 and its group's scale is NaN
    x = t32([[1.0, NAN, 3.0], [1.0, 2.0, 127.0]])
    q, scale = int_codes(x, t32([[127.0], [127.0]]), 8, False, True)
    assert_same(q, t32([[1.0, 0.0, 3.0], [1.0, 2.0, 127.0]]))
    assert_same(scale, t32([[NAN], [1.0]]))
    assert_same(int_fake_quant(x, t32([[127.0], [127.0]]), 8), t32([[NAN, NAN, NAN], [1.0, 2.0, 127.0]]))
    # per tensor: the whole tensor is one group; NaN wins over the tiny-amax zeros
    assert torch.isnan(int_fake_quant(x, torch.tensor(127.0), 8)).all()
    assert torch.isnan(int_fake_quant(x, torch.tensor(0.0), 8)[0]).all()


def test_nan_amax():
    q, scale = int_codes(t32([1.0, 2.0]), torch.tensor(NAN), 8, False, True)
    assert_same(q, t32([0.0, 0.0]))
    assert torch.isnan(int_fake_quant(t32([1.0, 2.0]), torch.tensor(NAN), 8)).all()


def test_inf_block():
    # static amax: Inf saturates like any large value
    assert_same(int_fake_quant(t32([INF, -INF, 1.0]), torch.tensor(127.0), 8), t32([127.0, -127.0, 1.0]))
    # an Inf amax (dynamic over an Inf) gives scale 0: the group is NaN
    assert torch.isnan(int_fake_quant(t32([INF, 1.0]), torch.tensor(INF), 8)).all()


def test_16_bit_nan_code_is_zero_not_int_min():
    q, _ = int_codes(t32([NAN, 1.0]), torch.tensor(1.0), 16, False, True)
    assert_same(q.to(code_dtype(16, False)), torch.tensor([0, 32767], dtype=torch.int32))


def test_three_d_input():
    x = torch.zeros(2, 2, 3)
    x[1, 1] = t32([1.0, 0.25, -0.75])
    amax = t32([1.0, 4.0, 2.0]).reshape(3)  # per last-dim channel, broadcast
    s = [127.0, f32(127 / 4), 63.5]
    expected = torch.zeros(2, 2, 3)
    # 1*127 = 127 ; 0.25*31.75 = 7.9375 -> 8 ; -0.75*63.5 = -47.625 -> -48
    expected[1, 1] = t32([1.0, f32(8 / s[1]), f32(-48 / s[2])])
    assert_bitwise(int_fake_quant(x, amax, 8), expected)


def test_non_contiguous_matches_contiguous():
    x = torch.randn(5, 7, generator=torch.Generator().manual_seed(2))
    amax = x.abs().amax(dim=0, keepdim=True)
    assert_bitwise(int_fake_quant(non_contiguous(x), amax, 8), int_fake_quant(x, amax, 8))
    xt = x.t()
    assert_bitwise(int_fake_quant(xt, amax.t(), 4), int_fake_quant(xt.contiguous(), amax.t(), 4))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_input_dtypes_compute_in_fp32(dtype):
    # bf16 arithmetic would round 2.5 * 127/3 differently; fp32: 105.83 -> 106
    x = t32([2.5, -1.0]).to(dtype)
    s = f32(127 / 3)
    assert_bitwise(int_fake_quant(x, torch.tensor(3.0, dtype=dtype), 8), t32([f32(106 / s), f32(-42 / s)]))


@settings(max_examples=60, deadline=None)
@given(
    st.lists(st.floats(-100.0, 100.0, width=32), min_size=1, max_size=12),
    st.floats(2.0**-20, 100.0, width=32),
    st.sampled_from([(8, False, True), (8, False, False), (4, True, True), (4, False, True)]),
)
def test_matches_scalar_formula(values, amax, fmt):
    bits, unsigned, narrow = fmt
    lo, hi = (0, 2**bits - 1) if unsigned else ((-(2 ** (bits - 1)) + (1 if narrow else 0)), 2 ** (bits - 1) - 1)
    s = f32(hi / amax)
    expected = [f32(min(max(round(f32(v * s)), lo), hi) / s) for v in values]  # Python round: half even
    out = int_fake_quant(t32(values), torch.tensor(amax), bits, unsigned, narrow)
    assert_same(out, t32(expected))


def test_subnormal_amax():
    # 127 / 2^-140 overflows to inf; the group is zero by the tiny-amax rule, never NaN
    q, _ = int_codes(t32([2.0**-140, 0.0]), torch.tensor(2.0**-140), 8, False, True)
    assert_same(q, t32([0.0, 0.0]))
    assert_same(int_fake_quant(t32([2.0**-140, 0.0]), torch.tensor(2.0**-140), 8), t32([0.0, 0.0]))
