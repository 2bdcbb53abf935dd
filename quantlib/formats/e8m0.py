"""E8M0 shared exponents of MX blocks, computed exactly from fp32 bits (never ``torch.log2``).

See :class:`quantlib.formats.spec.Rounding` for the two rules. The stored byte is ``e + 127``;
byte 0xFF marks a block holding NaN or Inf, whose outputs are NaN.
"""

from __future__ import annotations

import torch

from .spec import Rounding

E8M0_NAN = 255


def _exp_field(v: torch.Tensor) -> torch.Tensor:
    return (v.view(torch.int32) >> 23) & 0xFF


def e8m0_exponent(amax: torch.Tensor, qmax: float, emax: int, rounding: Rounding) -> torch.Tensor:
    """Unbiased exponent ``e`` in [-127, 127] (int32) of each block amax ``a`` (finite, >= 0)."""
    a = amax.float()
    if Rounding(rounding) == Rounding.RCEIL:
        t = a / torch.full_like(a, qmax)  # a true IEEE division on every device (see fp8_blockwise)
        bits = t.view(torch.int32)
        field = _exp_field(t)
        mant = bits & 0x007FFFFF
        # normal t: log2 t = field - 127 + log2(1.m); subnormal t = m * 2^-149 lies in (0, 2^-126).
        e = torch.where(mant != 0, field - 126, field - 127)
        e = torch.where(field == 0, torch.where(mant > (1 << 22), -126, -127), e)
    else:
        field = _exp_field(a)
        e = torch.where(field == 0, torch.full_like(field, -127), field - 127) - emax
    return torch.clamp(e, -127, 127).to(torch.int32)


def e8m0_encode(amax: torch.Tensor, qmax: float, emax: int, rounding: Rounding) -> torch.Tensor:
    """Biased uint8 exponent bytes; 0xFF for blocks with NaN/Inf."""
    byte = e8m0_exponent(amax, qmax, emax, rounding) + 127
    byte = torch.where(torch.isfinite(amax), byte, torch.full_like(byte, E8M0_NAN))
    return byte.to(torch.uint8)


def e8m0_to_float(byte: torch.Tensor) -> torch.Tensor:
    """fp32 ``2^(byte-127)`` exactly (byte 0 is the subnormal 2^-127), NaN for 0xFF."""
    b = byte.to(torch.int32)
    bits = torch.where(b == 0, torch.full_like(b, 0x00400000), b << 23)
    bits = torch.where(b == E8M0_NAN, torch.full_like(b, 0x7FC00000), bits)
    return bits.view(torch.float32)
