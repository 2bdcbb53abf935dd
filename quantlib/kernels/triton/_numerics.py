"""Triton device functions of the numerics contract (docs/design.md §3), exact on the GPU and in the interpreter.

Every rounding that the contract names is done here with IEEE fp32 operations whose result is fixed
(``div_rn``, plain multiplication, comparisons) or with integer operations on the fp32 bits; never with
``x.to(tl.float8e4nv)`` or ``x.to(tl.bfloat16)``, whose interpreter versions round wrongly (docs/numerics.md,
"Triton kernels": carries into the next power of two; bf16 truncation and subnormals). Kernels must be launched with
``enable_fp_fusion=False``: a fused multiply-add would skip the rounding of ``x * s``.

Constexpr codes shared by the kernels:

- ``IN_DT`` (how the input is read): 0 fp32, 1 fp16, 2 bf16 passed as its int16 bits.
- ``OUT_DT`` (how a fake-quant result is stored): 0 fp32, 1 bf16 by the hardware cast (GPU, RNE),
  2 bf16 as int16 bits rounded here (interpreter), 3 fp16.
- ``FP8E``: 0 E4M3 (Q 448, 3 mantissa bits, min normal 2^-6), 1 E5M2 (Q 57344, 2 bits, 2^-14);
  the MX-only elements 2 E3M2 (Q 28, 2 bits, 2^-2), 3 E2M3 (Q 7.5, 3 bits, 2^0), 4 INT8 (Q 127).
"""

import triton
import triton.language as tl
from triton.language.extra import libdevice

TINY_AMAX = 5.960464477539063e-08  # 2^-24, fp32-exact


@triton.jit
def load_f32(ptr, offs, mask, IN_DT: tl.constexpr):
    """fp32 values of the input (masked elements read 0)."""
    if IN_DT == 2:
        bits = tl.load(ptr + offs, mask=mask, other=0).to(tl.int32)
        return (bits << 16).to(tl.float32, bitcast=True)
    else:
        return tl.load(ptr + offs, mask=mask, other=0.0).to(tl.float32)


@triton.jit
def store_out(ptr, offs, v, mask, OUT_DT: tl.constexpr):
    """Store fp32 ``v`` in the output dtype with round-to-nearest-even."""
    if OUT_DT == 0:
        tl.store(ptr + offs, v, mask=mask)
    elif OUT_DT == 1:
        tl.store(ptr + offs, v.to(tl.bfloat16), mask=mask)
    elif OUT_DT == 2:
        b = v.to(tl.int32, bitcast=True)
        r = ((b + 0x7FFF + ((b >> 16) & 1)) >> 16) & 0xFFFF
        r = tl.where(v != v, 0x7FC0, r)
        tl.store(ptr + offs, r.to(tl.int16), mask=mask)
    else:
        tl.store(ptr + offs, v.to(tl.float16), mask=mask)


@triton.jit
def abs_bits(x):
    """|x| as int32 bits: their integer order is the float order, and NaN sorts above Inf."""
    return x.to(tl.int32, bitcast=True) & 0x7FFFFFFF


@triton.jit
def bits_to_f32(b):
    return b.to(tl.float32, bitcast=True)


@triton.jit
def with_sign_of(mag, v):
    """``mag`` (>= 0 or NaN) with the sign bit of ``v`` (``-x`` in Triton is ``0 - x``: it loses -0)."""
    sign = (v.to(tl.int32, bitcast=True) >> 31) << 31
    return (mag.to(tl.int32, bitcast=True) | sign).to(tl.float32, bitcast=True)


@triton.jit
def clamp_nan(v, lo, hi):
    """``torch.clamp``: NaN stays NaN."""
    return tl.where(v < lo, lo, tl.where(v > hi, hi, v))


@triton.jit
def rint(v):
    """Round half to even (``torch.round``) of fp32 ``v``; |v| >= 2^22 is already an integer."""
    r = (v + 12582912.0) - 12582912.0
    return tl.where(tl.abs(v) < 4194304.0, r, v)


@triton.jit
def round_fp8(v, FP8E: tl.constexpr, HW: tl.constexpr):
    """fp32 value of ``cast_rne_fp8(v)`` for ``|v| <= Q`` (or NaN), sign of zero kept.

    ``HW`` (compiled for a GPU): E4M3 by the hardware conversion, bit-exact to torch's there
    (docs/numerics.md, "Triton kernels"); the integer path otherwise (the interpreter's conversion is wrong near carries)."""
    if HW and FP8E == 0:
        return v.to(tl.float8e4nv).to(tl.float32)
    mag = abs_bits(v)
    if FP8E == 0 or FP8E == 3:
        rn = (mag + 0x7FFFF + ((mag >> 20) & 1)) & -1048576  # keep 3 mantissa bits
    else:
        rn = (mag + 0xFFFFF + ((mag >> 21) & 1)) & -2097152  # keep 2 mantissa bits
    if FP8E == 0:
        sub = (bits_to_f32(mag) + 16384.0) - 16384.0  # quantum 2^-9 below 2^-6
        res = tl.where(mag < 0x3C800000, sub, bits_to_f32(rn))
    elif FP8E == 1:
        sub = (bits_to_f32(mag) + 128.0) - 128.0  # quantum 2^-16 below 2^-14
        res = tl.where(mag < 0x38800000, sub, bits_to_f32(rn))
    elif FP8E == 2:
        sub = (bits_to_f32(mag) + 524288.0) - 524288.0  # quantum 2^-4 below 2^-2
        res = tl.where(mag < 0x3E800000, sub, bits_to_f32(rn))
    else:
        sub = (bits_to_f32(mag) + 1048576.0) - 1048576.0  # quantum 2^-3 below 1
        res = tl.where(mag < 0x3F800000, sub, bits_to_f32(rn))
    res = tl.where(v != v, v, res)
    return with_sign_of(res, v)


@triton.jit
def _grid_index(mag, FP8E: tl.constexpr):
    """The magnitude code (int32) of abs bits ``mag`` already on the grid of element ``FP8E``: the count
    of subnormal steps below the smallest normal, the exponent and mantissa fields above it."""
    af = bits_to_f32(mag)
    if FP8E == 0:
        return tl.where(mag < 0x3C800000, (af * 512.0).to(tl.int32), (mag >> 20) - 960)
    elif FP8E == 1:
        return tl.where(mag < 0x38800000, (af * 65536.0).to(tl.int32), (mag >> 21) - 448)
    elif FP8E == 2:
        return tl.where(mag < 0x3E800000, (af * 16.0).to(tl.int32), (mag >> 21) - 496)
    else:
        return tl.where(mag < 0x3F800000, (af * 8.0).to(tl.int32), (mag >> 20) - 1008)


@triton.jit
def fp8_byte(r, FP8E: tl.constexpr, HW: tl.constexpr):
    """The FP8 byte (int32 0..255) of an fp32 value ``r`` already on the FP8 grid; NaN gives 0x7F|sign."""
    if HW and FP8E == 0:
        return r.to(tl.float8e4nv).to(tl.uint8, bitcast=True).to(tl.int32)
    mag = abs_bits(r)
    byte = tl.where(mag > 0x7F800000, 0x7F, _grid_index(mag, FP8E))
    return tl.where(r.to(tl.int32, bitcast=True) < 0, byte | 0x80, byte)


@triton.jit
def fp6_code(r, FP8E: tl.constexpr):
    """The 6-bit code (int32, sign in bit 5) of an fp32 value ``r`` already on the FP6 grid; NaN gives 0."""
    code = _grid_index(abs_bits(r), FP8E)
    code = tl.where(r.to(tl.int32, bitcast=True) < 0, code | 0x20, code)
    return tl.where(r != r, 0, code)


@triton.jit
def mx_element(y, FP8E: tl.constexpr, HW: tl.constexpr):
    """fp32 value of an MX element (E4M3, FP6 or INT8, by ``FP8E``) of ``y`` already clamped to [-Q, Q];
    an INT8 code is read back through int8, so -0.0 becomes +0."""
    if FP8E == 4:
        return rint(y) + 0.0
    else:
        return round_fp8(y, FP8E, HW)


@triton.jit
def mx_element_code(v, FP8E: tl.constexpr, HW: tl.constexpr):
    """The stored byte (int32 0..255) of an MX element value ``v`` (from :func:`mx_element`)."""
    if FP8E == 4:
        return tl.where(v != v, 0, v.to(tl.int32) & 0xFF)
    elif FP8E == 0:
        return fp8_byte(v, 0, HW)
    else:
        return fp6_code(v, FP8E)


@triton.jit
def pow2_ceil(d):
    """Smallest power of two >= ``d >= 0`` from the bits: a subnormal ``d`` is scaled by 2^126 first
    (exact) and back after; 0 gives 2^-149; NaN/Inf kept."""
    sub = d < 1.1754943508222875e-38
    v = tl.where(sub, d * 8.507059173023462e37, d)
    bits = v.to(tl.int32, bitcast=True)
    ex = bits & 0x7F800000
    up = bits_to_f32(tl.where((bits & 0x007FFFFF) != 0, ex + 0x00800000, ex))
    out = tl.where(sub, up * 1.1754943508222875e-38, up)
    out = tl.where(d == 0.0, bits_to_f32(tl.full(d.shape, 1, tl.int32)), out)
    return tl.where(abs_bits(d) >= 0x7F800000, d, out)


@triton.jit
def e8m0_byte(a, QMAX: tl.constexpr, EMAX: tl.constexpr, FLOOR: tl.constexpr):
    """Biased E8M0 byte (int32) of block amax ``a``: rceil or floor rule, 255 for NaN/Inf."""
    if FLOOR:
        field = (a.to(tl.int32, bitcast=True) >> 23) & 0xFF
        e = tl.where(field == 0, -127, field - 127) - EMAX
    else:
        t = tl.math.div_rn(a, QMAX)
        bits = t.to(tl.int32, bitcast=True)
        field = (bits >> 23) & 0xFF
        mant = bits & 0x007FFFFF
        e = tl.where(mant != 0, field - 126, field - 127)
        e = tl.where(field == 0, tl.where(mant > 4194304, -126, -127), e)
    e = tl.minimum(tl.maximum(e, -127), 127)
    finite = abs_bits(a) < 0x7F800000
    return tl.where(finite, e + 127, 255)


@triton.jit
def e8m0_value(byte):
    """fp32 ``2^(byte - 127)`` (byte 0 is 2^-127), NaN for 255."""
    bits = tl.where(byte == 0, 0x00400000, byte << 23)
    bits = tl.where(byte == 255, 0x7FC00000, bits)
    return bits_to_f32(bits)


@triton.jit
def e8m0_inverse(byte):
    """fp32 ``2^(127 - byte)``, exactly ``1 / e8m0_value(byte)`` (NaN for 255)."""
    bits = tl.where(byte == 254, 0x00400000, (254 - byte) << 23)
    bits = tl.where(byte == 255, 0x7FC00000, bits)
    return bits_to_f32(bits)


@triton.jit
def _e2m1_parts(y):
    """``|y|`` saturated at 6 (NaN lost: callers mask it) and rounded to the E2M1 grid in one fp32
    addition: the grid's step is 0.5 below 2, 1 in [2, 4) and 2 in [4, 6], the ulp of ``M`` = 2^22,
    2^23 or 2^24 (``M``'s exponent is that of ``max(m, 1)`` plus 22), so ``s = m + M`` rounds to the
    grid with ties to E2M1's even mantissa. Returns the bits of ``s`` and ``M``."""
    m = tl.minimum(tl.abs(y), 6.0)
    big = (tl.maximum(m.to(tl.int32, bitcast=True), 0x3F800000) & 0x7F800000) + 0x0B000000
    s = m + big.to(tl.float32, bitcast=True)
    return s.to(tl.int32, bitcast=True), big


@triton.jit
def e2m1_code(y):
    """E2M1 code (int32 0..15) of fp32 ``y`` by round-to-nearest-even, saturating; NaN gives 0.

    The steps of ``s`` above ``M`` plus 2 per binade above [0, 2) (``M >> 22`` is 298, 300, 302)."""
    s, big = _e2m1_parts(y)
    idx = (s - big + (big >> 22) - 298) | ((y.to(tl.int32, bitcast=True) >> 28) & 8)
    return tl.where(y != y, 0, idx)


@triton.jit
def e2m1_round(y):
    """fp32 value of the grid point ``e2m1_code(y)`` stands for, without forming the code."""
    s, big = _e2m1_parts(y)
    mag = s.to(tl.float32, bitcast=True) - big.to(tl.float32, bitcast=True)
    return tl.where(y != y, 0.0, with_sign_of(mag, y))


@triton.jit
def div_unsafe(b):
    """Divisors for which :func:`div_exact` may differ from ``div_rn``: 0 < b < 2^-60 or 2^60 < b < inf
    (0, Inf and NaN give the quotient's special value on both paths)."""
    return (b > 0.0) & ((b < 8.673617379884035e-19) | ((b > 1.152921504606847e18) & (b < float("inf"))))


@triton.jit
def div_exact(x, b, y, SPECIAL: tl.constexpr = True):
    """``RN(x / b)`` from ``y = RN(1 / b)``, without a division per element: ``q = x * y`` is within
    1.5 ulp, one FMA correction brings it within one ulp, and a second rounds it correctly (Markstein:
    the residual ``x - q * b`` is exact and ``RN(q + r * y)`` is the rounded quotient). Holds for
    ``b`` in [2^-60, 2^60] wherever the quotient is >= 2^-100; below that it keeps its sign and stays
    below every grid's smallest step, which is all the callers use. A zero or non-finite ``q`` is
    already the quotient; ``SPECIAL = False`` skips that select, for finite dividends that are never
    -0 (INT codes): the corrections give ``x / b`` there, and NaN for a zero or NaN ``b`` as ``0 / 0``
    and ``x / NaN`` do."""
    nb = 0.0 - b
    q = x * y
    q1 = tl.fma(tl.fma(q, nb, x), y, q)
    q2 = tl.fma(tl.fma(q1, nb, x), y, q1)
    if SPECIAL:
        q2 = tl.where((q == 0.0) | (abs_bits(q) >= 0x7F800000), q, q2)
    return q2


@triton.jit
def div_block(x, b, FAST: tl.constexpr, SPECIAL: tl.constexpr = True):
    """``RN(x / b)`` for divisors ``b`` shared by blocks of ``x`` (broadcast): :func:`div_exact` with one
    reciprocal per block when ``FAST`` (compiled for a GPU) and no divisor of the tile is unsafe;
    ``div_rn`` per element otherwise (the interpreter's ``fma`` rounds twice)."""
    if FAST:
        if tl.max(div_unsafe(b).to(tl.int32)) == 0:
            res = div_exact(x, b, tl.math.div_rn(1.0, b), SPECIAL)
        else:
            res = tl.math.div_rn(x, b)
    else:
        res = tl.math.div_rn(x, b)
    return res


@triton.jit
def int_fake(x, a, lo, hi, FAST: tl.constexpr):
    """INT fake quant of fp32 ``x`` with group amax ``a`` (broadcast): ``q / (Q / a)``.

    The integer code goes through an integer dtype in the reference, so a NaN code becomes 0 and -0
    becomes +0; a NaN amax still gives NaN (``0 / NaN``).
    """
    scale = tl.math.div_rn(hi, a)
    # a <= 2^-24 makes every code 0: multiplying by 0 instead gives 0 or NaN (Inf * 0), which the
    # integer conversion makes 0 too, with the select once per group rather than per element
    zero = a <= 5.960464477539063e-08
    if FAST:  # compiled: one rounding instruction, codes divided by 1 where they are all 0 (finite)
        q = libdevice.rint(x * tl.where(zero, 0.0, scale))
        c = tl.where(q != q, 0.0, tl.minimum(tl.maximum(q, lo), hi) + 0.0)
        return div_block(c, tl.where(zero, 1.0, scale), FAST, False)
    else:
        q = clamp_nan(rint(x * tl.where(zero, 0.0, scale)), lo, hi)
        q = tl.where((q != q) | (q == 0.0), 0.0, q)
        return div_block(q, scale, FAST)


@triton.jit
def fp8_fake(x, a, QMAX: tl.constexpr, FP8E: tl.constexpr, HW: tl.constexpr):
    """FP8 per tensor / channel: ``cast(clamp(x * s)) * (1 / s)``, ``s = Q / a'``."""
    safe = tl.where(a > 5.960464477539063e-08, a, 1.0)
    safe = tl.where(a != a, a, safe)
    s = tl.math.div_rn(QMAX, safe)
    inv = tl.math.div_rn(1.0, s)
    c = round_fp8(clamp_nan(x * s, -QMAX, QMAX), FP8E, HW)
    return c * inv


@triton.jit
def fp8_block_scale(a, eps, QMAX: tl.constexpr, POW2: tl.constexpr):
    """Dequant scale ``d = max(a, eps) / Q`` (NaN kept), optionally rounded up to a power of two."""
    m = tl.where(a != a, a, tl.where(a > eps, a, eps))
    d = tl.math.div_rn(m, QMAX)
    if POW2:
        d = pow2_ceil(d)
    return d


@triton.jit
def fp8_block_round(x, d, QMAX: tl.constexpr, FP8E: tl.constexpr, POW2: tl.constexpr, HW: tl.constexpr):
    """fp32 value of ``cast_rne(clamp(x / d))``.

    With a power-of-two ``d`` the division is a multiplication by the exact reciprocal; a subnormal
    ``d`` (whose reciprocal overflows) and its block are scaled by 2^126 first, exactly, since
    ``|x| <= 448 d`` there.
    """
    if POW2:
        sub = d < 1.1754943508222875e-38
        xs = tl.where(sub, x * 8.507059173023462e37, x)
        ds = tl.where(sub, d * 8.507059173023462e37, d)
        y = xs * tl.math.div_rn(1.0, ds)
    else:
        y = div_block(x, d, HW)
    return round_fp8(clamp_nan(y, -QMAX, QMAX), FP8E, HW)


@triton.jit
def nvfp4_s2(A):
    """Global scale ``s2 = A / (6 * 448)`` (1 when ``A <= 2^-24``, NaN kept)."""
    return tl.where(A <= 5.960464477539063e-08, 1.0, tl.math.div_rn(A, 2688.0))


@triton.jit
def nvfp4_sb8(a, s2, HW: tl.constexpr):
    """fp32 value of the E4M3 block scale ``cast(clamp(a / (6 * s2), 2^-9, 448))`` (0 -> 1 first)."""
    sb = tl.math.div_rn(a, 6.0 * s2)
    sb = tl.where(sb == 0.0, 1.0, sb)
    return round_fp8(clamp_nan(sb, 0.001953125, 448.0), 0, HW)
