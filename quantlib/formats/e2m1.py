"""FP4 E2M1 elements: grid {0, 0.5, 1, 1.5, 2, 3, 4, 6}, round-to-nearest-even, saturating at 6.

Codes are 4 bits: sign in bit 3, magnitude index 0..7 in bits 0-2; two codes per uint8, the element
with the even index in the low nibble.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

E2M1_MAX = 6.0
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)

# Midpoints between grid neighbours. A tie goes to the even code: where the lower neighbour's code is
# even the midpoint rounds down (strict >), elsewhere it rounds up (>=).
_STRICT = (0.25, 1.25, 2.5, 5.0)
_INCLUSIVE = (0.75, 1.75, 3.5)


def e2m1_encode(y: torch.Tensor) -> torch.Tensor:
    """uint8 codes (0..15) of fp32 ``y`` by RNE with saturation; NaN gives code 0 (its scale is NaN)."""
    mag = y.abs()
    idx = torch.zeros_like(mag, dtype=torch.uint8)
    for t in _STRICT:
        idx += (mag > t).to(torch.uint8)
    for t in _INCLUSIVE:
        idx += (mag >= t).to(torch.uint8)
    sign = (torch.signbit(y) & ~torch.isnan(y)).to(torch.uint8) << 3
    return idx | sign


def e2m1_decode(codes: torch.Tensor) -> torch.Tensor:
    """fp32 values of uint8 codes (0..15)."""
    table = torch.tensor(E2M1_VALUES + tuple(-v for v in E2M1_VALUES), dtype=torch.float32, device=codes.device)
    return table[codes.long()]


def pack_nibbles(codes: torch.Tensor) -> torch.Tensor:
    """Pack codes along the last dim, two per byte (low nibble = even index); odd lengths pad a zero."""
    if codes.shape[-1] % 2:
        codes = F.pad(codes, (0, 1))
    return codes[..., 0::2] | (codes[..., 1::2] << 4)


def unpack_nibbles(packed: torch.Tensor, n: int) -> torch.Tensor:
    """Inverse of :func:`pack_nibbles` for ``n`` codes along the last dim."""
    out = torch.stack((packed & 0xF, packed >> 4), dim=-1).reshape(*packed.shape[:-1], -1)
    return out[..., :n]
