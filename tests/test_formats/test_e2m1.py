"""E2M1 elements: RNE on {0, 0.5, 1, 1.5, 2, 3, 4, 6}, saturation at 6, nibble packing."""

import torch
from hypothesis import given, settings, strategies as st

from quantlib.formats.e2m1 import E2M1_VALUES, e2m1_decode, e2m1_encode, pack_nibbles, unpack_nibbles

from ._helpers import INF, NAN, assert_same, t32


def u8(values) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.uint8)


def test_grid_values_encode_to_their_index():
    assert_same(e2m1_encode(t32([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])), u8([0, 1, 2, 3, 4, 5, 6, 7]))


def test_negative_grid_values_set_bit_3():
    assert_same(e2m1_encode(t32([-0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0])), u8([9, 10, 11, 12, 13, 14, 15]))


def test_ties_to_even():
    # midpoint -> the neighbour whose code (mantissa bit) is even
    y = t32([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0])
    expected_values = t32([0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0])
    assert_same(e2m1_encode(y), u8([0, 2, 2, 4, 4, 6, 6]))
    assert_same(e2m1_decode(e2m1_encode(y)), expected_values)
    assert_same(e2m1_decode(e2m1_encode(-y)), -expected_values)


def test_just_off_the_ties_round_to_nearest():
    y = t32([0.2500001, 0.7499999, 1.2500001, 1.7499999, 2.5000002, 3.4999998, 5.0000005])
    assert_same(e2m1_decode(e2m1_encode(y)), t32([0.5, 0.5, 1.5, 1.5, 3.0, 3.0, 6.0]))


def test_saturation_above_6():
    y = t32([6.0, 6.5, 7.0, 100.0, 3.0e38, INF, -7.0, -INF])
    assert_same(e2m1_decode(e2m1_encode(y)), t32([6.0, 6.0, 6.0, 6.0, 6.0, 6.0, -6.0, -6.0]))


def test_small_values_flush_to_signed_zero():
    codes = e2m1_encode(t32([0.1, -0.1, 0.0, -0.0, 1e-45]))
    assert_same(codes, u8([0, 8, 0, 8, 0]))
    assert torch.equal(torch.signbit(e2m1_decode(codes)), torch.tensor([False, True, False, True, False]))


def test_nan_gives_code_0():
    # the NaN reaches the output through the block scale, never through the code
    assert_same(e2m1_encode(t32([NAN, -NAN])), u8([0, 0]))


def test_decode_table():
    expected = t32([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0])
    assert_same(e2m1_decode(torch.arange(16, dtype=torch.uint8)), expected)


def test_packing_low_nibble_is_even_index():
    codes = u8([[1, 2, 15, 8], [7, 0, 0, 9]])
    assert_same(pack_nibbles(codes), u8([[0x21, 0x8F], [0x07, 0x90]]))
    assert_same(unpack_nibbles(u8([[0x21, 0x8F], [0x07, 0x90]]), 4), codes)


def test_packing_odd_length_pads_a_zero_nibble():
    assert_same(pack_nibbles(u8([3, 4, 5])), u8([0x43, 0x05]))
    assert_same(unpack_nibbles(u8([0x43, 0x05]), 3), u8([3, 4, 5]))


def test_packing_non_contiguous_matches_contiguous():
    codes = torch.arange(16, dtype=torch.uint8).reshape(4, 4).t()
    assert not codes.is_contiguous()
    assert_same(pack_nibbles(codes), pack_nibbles(codes.contiguous()))


def _oracle(v: float) -> float:
    """Nearest grid value by exhaustive search, ties to the even index; saturating."""
    mag = min(abs(v), 6.0)
    best = min(range(8), key=lambda i: (abs(E2M1_VALUES[i] - mag), i % 2))
    return E2M1_VALUES[best] if v >= 0 else -E2M1_VALUES[best]


@settings(max_examples=60, deadline=None)
@given(st.lists(st.floats(-8.0, 8.0, width=32), min_size=1, max_size=16))
def test_encode_matches_exhaustive_nearest(values):
    y = t32(values)
    assert_same(e2m1_decode(e2m1_encode(y)).abs(), t32([abs(_oracle(v)) for v in values]))
