"""E8M0 shared exponents: RCEIL and FLOOR from the exact fp32 bits, bytes 0 / 0xFF, decoding."""

import math

import pytest
import torch
from hypothesis import given, settings, strategies as st

from quantlib.formats.e8m0 import e8m0_encode, e8m0_exponent, e8m0_to_float
from quantlib.formats.spec import Rounding

from ._helpers import INF, NAN, assert_same, f32, next_down, next_up, t32

E4M3 = (448.0, 8)
E2M1 = (6.0, 2)
FLT_MAX = 3.4028234663852886e38


def byte(values) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.uint8)


def encode(values, fmt, rounding) -> torch.Tensor:
    return e8m0_encode(t32(values), fmt[0], fmt[1], rounding)


@pytest.mark.parametrize("k", [-100, -20, -1, 0, 1, 7, 100])
def test_amax_at_power_of_two_boundary_rceil_vs_floor(k):
    a = 448.0 * 2.0**k  # a / Q = 2^k exactly
    above = next_up(a)  # a / Q rounds to 2^k (1 + 2^-23): one more exponent under RCEIL
    below = next_down(a)
    assert_same(encode([a, above, below], E4M3, Rounding.RCEIL), byte([k + 127, k + 128, k + 127]))
    # FLOOR: floor(log2(1.75 * 2^(k+8))) - 8 = k for all three
    assert_same(encode([a, above, below], E4M3, Rounding.FLOOR), byte([k + 127, k + 127, k + 127]))


@pytest.mark.parametrize("k", [-30, 0, 5])
def test_floor_changes_exponent_at_powers_of_two_of_amax(k):
    a = 2.0 ** (k + 9)  # log2 a = k + 9 -> e = k + 1 ; just below -> e = k
    assert_same(encode([a, next_down(a)], E4M3, Rounding.FLOOR), byte([k + 128, k + 127]))
    # RCEIL: a / 448 = 2^(k+9) / 448 = 1.14 * 2^k -> k + 1; just below also -> k + 1
    assert_same(encode([a, next_down(a)], E4M3, Rounding.RCEIL), byte([k + 128, k + 128]))


def test_e2m1_boundaries():
    # Q = 6, emax = 2: a = 6 -> e = 0 for both; a = 7 -> RCEIL ceil(log2(7/6)) = 1, FLOOR floor(log2 7) - 2 = 0
    assert_same(encode([6.0, 7.0, 8.0, 3.0], E2M1, Rounding.RCEIL), byte([127, 128, 128, 126]))
    assert_same(encode([6.0, 7.0, 8.0, 3.0], E2M1, Rounding.FLOOR), byte([127, 127, 128, 126]))


def test_rceil_never_uses_log2_rounding():
    # a / Q = 2^-20 (1 + 2^-23): fp32 torch.log2 rounds it to exactly -20, the exact ceil is -19
    a = next_up(448.0 * 2.0**-20)
    t = f32(a / 448.0)
    assert t == 2.0**-20 * (1 + 2.0**-23)
    assert torch.ceil(torch.log2(t32([t]))).item() == -20.0  # the pitfall the bits avoid
    assert_same(encode([a], E4M3, Rounding.RCEIL), byte([-19 + 127]))


def test_all_zero_block():
    assert_same(encode([0.0], E4M3, Rounding.RCEIL), byte([0]))
    assert_same(encode([0.0], E4M3, Rounding.FLOOR), byte([0]))
    assert_same(encode([0.0], E2M1, Rounding.RCEIL), byte([0]))


def test_subnormal_amax():
    tiny = [1e-45, 2.0**-130, 2.0**-126 - 2.0**-149]
    assert_same(encode(tiny, E4M3, Rounding.RCEIL), byte([0, 0, 0]))
    assert_same(encode(tiny, E4M3, Rounding.FLOOR), byte([0, 0, 0]))


def test_rceil_subnormal_quotient():
    # a / 448 = 2^-127 (subnormal, exact) -> e = -127 (byte 0); a hair above -> e = -126 (byte 1)
    a = 448.0 * 2.0**-127
    a_up = 448.0 * 2.0**-127 * (1 + 2.0**-10)
    assert_same(encode([a, a_up, 448.0 * 2.0**-126], E4M3, Rounding.RCEIL), byte([0, 1, 1]))


def test_exponent_clamped_to_127():
    # FLOOR: floor(log2 FLT_MAX) - 8 = 119 ; RCEIL: FLT_MAX / 448 = 1.14 * 2^119 -> 120
    assert_same(encode([FLT_MAX], E4M3, Rounding.FLOOR), byte([119 + 127]))
    assert_same(encode([FLT_MAX], E4M3, Rounding.RCEIL), byte([120 + 127]))
    e = e8m0_exponent(t32([2.0**-140 * 448.0, 1e-45]), 448.0, 8, Rounding.RCEIL)
    assert_same(e, torch.tensor([-127, -127], dtype=torch.int32))


def test_nan_block():
    assert_same(encode([NAN, 1.0], E4M3, Rounding.RCEIL), byte([0xFF, 127 - 8]))
    assert_same(encode([NAN], E4M3, Rounding.FLOOR), byte([0xFF]))


def test_inf_block():
    assert_same(encode([INF, 1.0], E4M3, Rounding.RCEIL), byte([0xFF, 127 - 8]))
    assert_same(encode([INF], E2M1, Rounding.FLOOR), byte([0xFF]))


def test_to_float():
    out = e8m0_to_float(byte([0, 1, 126, 127, 128, 254, 255]))
    expected = t32([2.0**-127, 2.0**-126, 0.5, 1.0, 2.0, 2.0**127, NAN])
    assert_same(out, expected)


@settings(max_examples=80, deadline=None)
@given(st.floats(min_value=2.0**-110, max_value=2.0**110, width=32), st.sampled_from([E4M3, E2M1]))
def test_matches_integer_exponent_formula(a, fmt):
    q, emax = fmt
    t = f32(a / q)
    m, ex = math.frexp(t)  # t = m * 2^ex, m in [0.5, 1): exact
    rceil = ex - 1 if m == 0.5 else ex
    floor = math.frexp(a)[1] - 1 - emax
    assert_same(encode([a], fmt, Rounding.RCEIL), byte([rceil + 127]))
    assert_same(encode([a], fmt, Rounding.FLOOR), byte([floor + 127]))
