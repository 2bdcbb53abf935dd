"""The division without a per-element divide (``div_exact`` of the Triton kernels, ``divide`` of the
CUDA ones) is the correctly rounded quotient: checked here on the CPU with exact FMAs, on the GPU
exhaustively (tests/test_kernels/test_gpu_kernels.py).

The interpreter cannot run it (its ``tl.fma`` rounds twice), so this model of the same five operations
is what the CPU suite checks.
"""

from __future__ import annotations

import math
import random
import struct
from fractions import Fraction

import numpy as np
import pytest


def f32(v) -> float:
    """RN to fp32 of a float or an exact Fraction (normal range: the model's inputs keep to it)."""
    if isinstance(v, Fraction):
        if v == 0:
            return 0.0
        sign = -1.0 if v < 0 else 1.0
        v = abs(v)
        e = math.floor(math.log2(v.numerator) - math.log2(v.denominator))
        while Fraction(2) ** e > v:
            e -= 1
        while Fraction(2) ** (e + 1) <= v:
            e += 1
        scaled = v / Fraction(2) ** (e - 23)  # in [2^23, 2^24)
        n = math.floor(scaled)
        rem = scaled - n
        if rem > Fraction(1, 2) or (rem == Fraction(1, 2) and n % 2):
            n += 1
        return sign * float(Fraction(n) * Fraction(2) ** (e - 23))
    return float(np.float32(v))


def fma(a: float, b: float, c: float) -> float:
    return f32(Fraction(a) * Fraction(b) + Fraction(c))


@np.errstate(divide="ignore", invalid="ignore", over="ignore")
def div_exact(x: float, b: float) -> float:
    """The kernels' sequence: y = RN(1/b), q = RN(x*y), two FMA corrections."""
    y = f32(np.float32(1.0) / np.float32(b))
    q = f32(np.float32(x) * np.float32(y))
    if q == 0.0 or math.isinf(q) or math.isnan(q):
        return q
    q1 = fma(fma(q, -b, x), y, q)
    return fma(fma(q1, -b, x), y, q1)


@np.errstate(divide="ignore", invalid="ignore", over="ignore")
def div_corrected(x: float, b: float, sign: bool) -> float:
    """The CUDA kernels' fast path and Triton's ``SPECIAL = False``: the corrections without the select
    of special quotients; ``sign`` puts the sign of ``x`` back on the result (CUDA's FP8 / NVFP4)."""
    y = f32(np.float32(1.0) / np.float32(b))
    q = f32(np.float32(x) * np.float32(y))
    q1 = fma(fma(q, -b, x), y, q)
    q2 = fma(fma(q1, -b, x), y, q1)
    if sign and math.copysign(1.0, x) < 0:
        q2 = -abs(q2) if not math.isnan(q2) else q2
    return q2


def fast_block(bound: float, b: float) -> bool:
    """CUDA's Divisor::fast: b in [2^-60, 2^60] and RN(bound * RN(1 / b)) < 2^126."""
    y = f32(np.float32(1.0) / np.float32(b))
    return 2.0**-60 <= b <= 2.0**60 and f32(np.float32(bound) * np.float32(y)) < 2.0**126


@np.errstate(divide="ignore", invalid="ignore", over="ignore")
def div_rn(x: float, b: float) -> float:
    return float(np.float32(x) / np.float32(b))


def _bits(v: float) -> int:
    return struct.unpack("<I", struct.pack("<f", v))[0]


def _from_bits(u: int) -> float:
    return struct.unpack("<f", struct.pack("<I", u))[0]


def _hard_divisors() -> list[float]:
    """Mantissas all ones / one ulp off a power of two / random, over the safe exponent range."""
    out = []
    for e in (-60, -20, -1, 0, 1, 7, 31, 59):
        for mant in (0, 1, 2, 0x7FFFFF, 0x7FFFFE, 0x400000, 0x3FFFFF, 0x555555, 0x2AAAAA):
            out.append(_from_bits(((e + 127) << 23) | mant))
    return out


@pytest.mark.parametrize("b", _hard_divisors())
def test_int_codes_over_hard_divisors(b):
    # INT fake quant divides its integer codes (|q| <= 127) by the scale.
    for q in range(-127, 128):
        assert _bits(div_exact(float(q), b)) == _bits(div_rn(float(q), b)), (q, b)


def test_bf16_and_random_fp32_dividends():
    rng = random.Random(0)
    divisors = _hard_divisors() + [_from_bits(rng.randrange(67 << 23, 187 << 23)) for _ in range(40)]
    dividends = [_from_bits((rng.randrange(0, 1 << 16) << 16) & 0x7FFFFFFF) for _ in range(60)]  # bf16
    dividends += [_from_bits(rng.randrange(27 << 23, 227 << 23)) for _ in range(60)]  # fp32
    bad = []
    for b in divisors:
        for x in dividends:
            for sx in (x, -x):
                want = div_rn(sx, b)
                if abs(want) < 2.0**-100:  # outside the promise (callers' grids end far above)
                    continue
                if _bits(div_exact(sx, b)) != _bits(want):
                    bad.append((sx, b))
    assert not bad, bad[:5]


def test_one_fma_correction_is_not_enough_somewhere():
    """Why the kernels take two corrections: RN(x * RN(1/b)) alone misses often; prove the model
    distinguishes, so the exact tests above could fail."""
    rng = random.Random(1)
    misses = 0
    for _ in range(2000):
        b = _from_bits(rng.randrange(127 << 23, 128 << 23))
        x = _from_bits(rng.randrange(127 << 23, 128 << 23))
        y = f32(np.float32(1.0) / np.float32(b))
        misses += _bits(f32(np.float32(x) * np.float32(y))) != _bits(div_rn(x, b))
    assert misses > 100


def test_specials():
    inf, nan = float("inf"), float("nan")
    assert _bits(div_exact(-0.0, 3.0)) == _bits(-0.0)
    assert _bits(div_exact(0.0, 3.0)) == _bits(0.0)
    assert div_exact(inf, 3.0) == inf and div_exact(-inf, 3.0) == -inf
    assert math.isnan(div_exact(nan, 3.0))
    assert div_exact(5.0, 0.0) == inf and math.isnan(div_exact(0.0, 0.0))
    assert _bits(div_exact(-5.0, inf)) == _bits(-0.0)
    assert math.isnan(div_exact(5.0, nan))


def test_corrections_without_the_special_select():
    """Where the CUDA kernels skip the select (a block whose largest |x| passes fast_block): the
    quotient with the sign of x put back is div_rn's (sign included), over the same dividends."""
    rng = random.Random(2)
    divisors = _hard_divisors() + [_from_bits(rng.randrange(67 << 23, 187 << 23)) for _ in range(40)]
    dividends = [0.0] + [_from_bits((rng.randrange(0, 1 << 16) << 16) & 0x7FFFFFFF) for _ in range(60)]
    dividends += [_from_bits(rng.randrange(27 << 23, 227 << 23)) for _ in range(60)]
    bad, fast = [], 0
    for b in divisors:
        for x in dividends:
            if not fast_block(x, b):
                continue
            fast += 1
            for sx in (x, -x):
                want = div_rn(sx, b)
                got = div_corrected(sx, b, sign=True)
                if abs(want) < 2.0**-100:  # outside the promise: the sign and a magnitude below 2^-100
                    ok = math.copysign(1.0, got) == math.copysign(1.0, want) and abs(got) < 2.0**-99
                else:
                    ok = _bits(got) == _bits(want)
                if not ok:
                    bad.append((sx, b, got, want))
    assert fast > 4000 and not bad, bad[:5]


def test_corrections_lose_the_sign_of_zero_and_break_on_specials():
    """Why CUDA puts the sign back and keeps Inf / NaN blocks off the fast path: without them -0 / b
    is +0 (and Inf / b would be Inf - Inf = NaN in the first correction). INT codes want exactly that +0, so they skip the sign (SIGN =
    false)."""
    assert _bits(div_corrected(-0.0, 3.0, sign=False)) == _bits(0.0)
    assert _bits(div_corrected(0.0, 3.0, sign=False)) == _bits(0.0)
    assert _bits(div_corrected(-0.0, 3.0, sign=True)) == _bits(-0.0)
    assert not fast_block(float("inf"), 3.0) and not fast_block(float("nan"), 3.0)
    assert not fast_block(2.0**100, 2.0**-40) and fast_block(2.0**60, 2.0**-60)


@pytest.mark.parametrize("b", _hard_divisors())
def test_int_codes_without_sign_or_select(b):
    # The INT path of both backends on finite blocks: codes in [-128, 127], +0 for a zero code.
    for q in range(-128, 128):
        want = div_rn(float(q), b) if q else 0.0
        assert _bits(div_corrected(float(q), b, sign=False)) == _bits(want), (q, b)
