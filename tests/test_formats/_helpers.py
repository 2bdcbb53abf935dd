"""Shared helpers of the format tests: fp32 arithmetic in Python and exact tensor comparisons."""

from __future__ import annotations

import math
import struct

import torch

NAN = float("nan")
INF = float("inf")

_BITS_VIEW = {
    torch.float32: torch.int32,
    torch.bfloat16: torch.int16,
    torch.float16: torch.int16,
    torch.float8_e4m3fn: torch.uint8,
    torch.float8_e5m2: torch.uint8,
}


def f32(v: float) -> float:
    """``v`` rounded to fp32 (round to nearest even), as a Python float.

    Python's own +, -, *, / on two fp32 values followed by ``f32`` equal the fp32 operation: a double
    has more than 2 * 24 + 2 bits, so the double rounding is innocuous.
    """
    return struct.unpack("<f", struct.pack("<f", v))[0]


def next_up(v: float) -> float:
    """The next fp32 value above the fp32 ``v`` (> 0)."""
    (bits,) = struct.unpack("<I", struct.pack("<f", v))
    return struct.unpack("<f", struct.pack("<I", bits + 1))[0]


def next_down(v: float) -> float:
    """The next fp32 value below the fp32 ``v`` (> 0)."""
    (bits,) = struct.unpack("<I", struct.pack("<f", v))
    return struct.unpack("<f", struct.pack("<I", bits - 1))[0]


def t32(values) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float32)


def assert_same(actual: torch.Tensor, expected: torch.Tensor) -> None:
    """Equal dtype, shape and values, NaN where ``expected`` has NaN (``torch.equal`` on the rest)."""
    assert actual.dtype == expected.dtype, (actual.dtype, expected.dtype)
    assert actual.shape == expected.shape, (tuple(actual.shape), tuple(expected.shape))
    if not actual.is_floating_point():
        assert torch.equal(actual, expected), (actual, expected)
        return
    a, e = actual.float(), expected.float()
    assert torch.equal(torch.isnan(a), torch.isnan(e)), (actual, expected)
    assert torch.equal(torch.nan_to_num(a, nan=0.0), torch.nan_to_num(e, nan=0.0)), (actual, expected)


def assert_bitwise(actual: torch.Tensor, expected: torch.Tensor) -> None:
    """Identical bit patterns (sign of zero and NaN payload included)."""
    assert actual.dtype == expected.dtype, (actual.dtype, expected.dtype)
    assert actual.shape == expected.shape, (tuple(actual.shape), tuple(expected.shape))
    view = _BITS_VIEW.get(actual.dtype)
    if view is None:
        assert torch.equal(actual, expected)
    else:
        assert torch.equal(actual.contiguous().view(view), expected.contiguous().view(view)), (actual, expected)


def log2_exact(v: float) -> int:
    """log2 of a power of two (exact, through frexp)."""
    m, e = math.frexp(v)
    assert m == 0.5, v
    return e - 1


def non_contiguous(x: torch.Tensor) -> torch.Tensor:
    """A non-contiguous tensor equal to ``x`` (a transposed copy transposed back)."""
    y = x.transpose(-1, -2).contiguous().transpose(-1, -2) if x.dim() >= 2 else x.repeat_interleave(2)[::2]
    assert not y.is_contiguous()
    assert_bitwise(y.contiguous(), x.contiguous())
    return y
