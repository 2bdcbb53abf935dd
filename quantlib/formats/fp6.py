"""FP6 elements of MXFP6 (OCP MX spec): E3M2 (bias 3, max 28) and E2M3 (bias 1, max 7.5), no Inf/NaN.

Values are rounded to nearest even on the format's grid (subnormals included) and saturate at the
largest magnitude. A code is 6 bits in one uint8: sign in bit 5, then the exponent and mantissa
fields; the 32 magnitudes in code order are increasing, so a code is the index of its value.
"""

from __future__ import annotations

import torch

#: (exponent bits, mantissa bits) -> (largest magnitude Q, exponent of the largest power of two).
FP6_FORMATS: dict[tuple[int, int], tuple[float, int]] = {(3, 2): (28.0, 4), (2, 3): (7.5, 2)}


def _fields(element: tuple[int, int]) -> tuple[int, int]:
    """(mantissa bits, exponent of the smallest normal) of an FP6 element format."""
    e, m = tuple(element)
    if (e, m) not in FP6_FORMATS:
        raise ValueError(f"formats.fp6: element format must be (3, 2) or (2, 3), got {element}")
    return m, 2 - (1 << (e - 1))  # emin = 1 - bias, bias = 2^(E-1) - 1


def fp6_values(element: tuple[int, int]) -> torch.Tensor:
    """The 32 non-negative fp32 magnitudes of the format, in code order (increasing)."""
    m, emin = _fields(element)
    out = []
    for code in range(32):
        ef, mf = code >> m, code & ((1 << m) - 1)
        out.append(mf * 2.0 ** (emin - m) if ef == 0 else (1 + mf / (1 << m)) * 2.0 ** (ef - 1 + emin))
    return torch.tensor(out, dtype=torch.float32)


def fp6_round(y: torch.Tensor, element: tuple[int, int]) -> torch.Tensor:
    """fp32 ``y`` rounded to nearest even on the FP6 grid, saturating at Q; sign (of zero too) and NaN kept."""
    m, emin = _fields(element)
    q = FP6_FORMATS[tuple(element)][0]
    y = y.float()
    mag = y.abs()
    bits = mag.view(torch.int32)
    drop = 23 - m
    # normal range: round the fp32 mantissa to m bits (a carry moves into the exponent, as it should)
    normal = ((bits + ((1 << (drop - 1)) - 1) + ((bits >> drop) & 1)) & ~((1 << drop) - 1)).view(torch.float32)
    # subnormal range: multiples of 2^(emin - m); scaling by a power of two is exact, torch.round is RNE
    step = 2.0 ** (emin - m)
    sub = torch.round(mag * (1.0 / step)) * step
    r = torch.where(mag < 2.0**emin, sub, normal).clamp(max=q)
    r = torch.where(torch.isnan(y), y, r)
    return torch.copysign(r, y)


def fp6_encode(y: torch.Tensor, element: tuple[int, int]) -> torch.Tensor:
    """uint8 codes (0..63, sign in bit 5) of fp32 ``y`` by RNE with saturation; NaN gives code 0."""
    m, emin = _fields(element)
    r = fp6_round(y, element)
    nan = torch.isnan(r)
    mag = torch.where(nan, 0.0, r.abs())
    # normal: the fp32 exponent rebiased to the FP6 field, then the top m mantissa bits (r is on the grid)
    normal = (mag.view(torch.int32) >> (23 - m)) - ((126 + emin) << m)
    sub = (mag * 2.0 ** (m - emin)).to(torch.int32)  # whole subnormal steps, exact
    idx = torch.where(mag < 2.0**emin, sub, normal).to(torch.uint8)
    sign = (torch.signbit(r) & ~nan).to(torch.uint8) << 5
    return idx | sign


def fp6_decode(codes: torch.Tensor, element: tuple[int, int]) -> torch.Tensor:
    """fp32 values of uint8 FP6 codes."""
    values = fp6_values(element).to(codes.device)
    table = torch.cat((values, -values))
    return table[codes.long() & 63]
