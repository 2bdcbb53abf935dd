"""OCP microscaling formats MXFP8 (E4M3 elements) and MXFP4 (E2M1 elements), blocks of 32.

Shared exponent ``e`` per block from :mod:`quantlib.formats.e8m0`; elements
``cast_rne(clamp(x / 2^e, -Q, Q))``; ``x_hat = element * 2^e``. A block with NaN/Inf gives NaN.
"""

from __future__ import annotations

import torch

from .blocks import block_amax, from_blocks, to_blocks
from .e2m1 import e2m1_decode, e2m1_encode, pack_nibbles, unpack_nibbles
from .e8m0 import e8m0_encode, e8m0_to_float
from .fp8 import cast_fp8
from .spec import FLOAT_FORMATS, Rounding

MX_ELEMENTS: dict[str, tuple[int, int]] = {"e4m3": (4, 3), "e2m1": (2, 1)}


def mx_element(elem: str | tuple[int, int]) -> tuple[int, int]:
    if isinstance(elem, str):
        if elem not in MX_ELEMENTS:
            raise ValueError(f"MX element format must be one of {sorted(MX_ELEMENTS)}, got {elem!r}")
        return MX_ELEMENTS[elem]
    if tuple(elem) not in MX_ELEMENTS.values():
        raise ValueError(f"MX element format must be (4, 3) or (2, 1), got {elem}")
    return tuple(elem)


def mx_quantize(x: torch.Tensor, elem: str | tuple[int, int] = "e4m3", block: int = 32, rounding: Rounding | str = Rounding.RCEIL) -> tuple[torch.Tensor, torch.Tensor]:
    """Element codes (float8 of ``x``'s shape, or packed uint8 E2M1) and uint8 E8M0 bytes per block."""
    element = mx_element(elem)
    qmax, emax = FLOAT_FORMATS[element]
    a = block_amax(x, (block,))
    byte = e8m0_encode(a, qmax, emax, Rounding(rounding))
    scale = e8m0_to_float(byte).unsqueeze(-1)
    y = torch.clamp(to_blocks(x.float(), (block,)) / scale, -qmax, qmax)
    if element == (2, 1):
        codes = from_blocks(e2m1_encode(y), (block,), x.shape)
        return pack_nibbles(codes), byte
    return from_blocks(cast_fp8(y, element), (block,), x.shape), byte


def mx_dequantize(codes: torch.Tensor, byte: torch.Tensor, elem: str | tuple[int, int] = "e4m3", block: int = 32, n: int | None = None) -> torch.Tensor:
    """fp32 values; ``n`` is the original last-dim size (needed for packed E2M1)."""
    element = mx_element(elem)
    if element == (2, 1):
        n = n if n is not None else codes.shape[-1] * 2
        values = e2m1_decode(unpack_nibbles(codes, n))
    else:
        values = codes.float()
    vb = to_blocks(values, (block,)) * e8m0_to_float(byte).unsqueeze(-1)
    return from_blocks(vb, (block,), values.shape)


def mx_fake_quant(x: torch.Tensor, elem: str | tuple[int, int] = "e4m3", block: int = 32, rounding: Rounding | str = Rounding.RCEIL) -> torch.Tensor:
    """fp32 fake-quantized ``x``."""
    codes, byte = mx_quantize(x, elem, block, rounding)
    return mx_dequantize(codes, byte, elem, block, x.shape[-1])
