"""OCP microscaling formats, blocks of 32: MXFP8 (E4M3), MXFP6 (E3M2 / E2M3), MXFP4 (E2M1), MXINT8.

Shared exponent ``e`` per block from :mod:`quantlib.formats.e8m0`; elements
``cast_rne(clamp(x / 2^e, -Q, Q))``; ``x_hat = element * 2^e``. A block with NaN/Inf gives NaN.
Element codes: float8_e4m3fn (E4M3), uint8 two per byte (E2M1), uint8 one per byte with the sign in
bit 5 (FP6, :mod:`quantlib.formats.fp6`), int8 (INT8, :mod:`quantlib.formats.mxint8`).
"""

from __future__ import annotations

from typing import Union

import torch

from .blocks import block_amax, from_blocks, to_blocks
from .e2m1 import e2m1_decode, e2m1_encode, pack_nibbles, unpack_nibbles
from .e8m0 import e8m0_encode, e8m0_to_float
from .fp6 import FP6_FORMATS, fp6_decode, fp6_encode
from .fp8 import cast_fp8
from .mxint8 import MXINT8_EMAX, MXINT8_MAX, mxint8_encode
from .spec import FLOAT_FORMATS, FormatSpec, Rounding

#: Element formats by name: float elements as (E, M), the integer element as its bit count.
MX_ELEMENTS: dict[str, Union[tuple[int, int], int]] = {"e4m3": (4, 3), "e2m1": (2, 1), "e3m2": (3, 2), "e2m3": (2, 3), "int8": 8}
MxElement = Union[str, tuple[int, int], int]


def mx_element(elem: MxElement) -> Union[tuple[int, int], int]:
    """The element format as (E, M) or 8, from a name, (E, M) or 8."""
    if isinstance(elem, str):
        if elem not in MX_ELEMENTS:
            raise ValueError(f"MX element format must be one of {sorted(MX_ELEMENTS)}, got {elem!r}")
        return MX_ELEMENTS[elem]
    key = elem if isinstance(elem, int) and not isinstance(elem, bool) else tuple(elem)
    if key not in MX_ELEMENTS.values():
        raise ValueError(f"MX element format must be one of {sorted(MX_ELEMENTS.values(), key=str)}, got {elem}")
    return key


def mx_element_name(elem: MxElement) -> str:
    """The name ("e4m3", "e2m1", "e3m2", "e2m3", "int8") of an element format."""
    key = mx_element(elem)
    return next(name for name, value in MX_ELEMENTS.items() if value == key)


def spec_element(spec: FormatSpec) -> Union[tuple[int, int], int]:
    """The element of an MX FormatSpec: its float ``element``, or ``num_bits`` for MXINT8."""
    return mx_element(spec.element if spec.element is not None else spec.num_bits)


def mx_limits(elem: MxElement) -> tuple[float, int]:
    """(Q, emax) of an element format: its largest magnitude and the exponent of its largest power of two."""
    key = mx_element(elem)
    if key == 8:
        return MXINT8_MAX, MXINT8_EMAX
    return FLOAT_FORMATS[key]


def mx_quantize(x: torch.Tensor, elem: MxElement = "e4m3", block: int = 32, rounding: Rounding
                | str = Rounding.RCEIL) -> tuple[torch.Tensor, torch.Tensor]:
    """Element codes (see the module docstring) and uint8 E8M0 bytes per block."""
    element = mx_element(elem)
    qmax, emax = mx_limits(element)
    a = block_amax(x, (block,))
    byte = e8m0_encode(a, qmax, emax, Rounding(rounding))
    scale = e8m0_to_float(byte).unsqueeze(-1)
    y = torch.clamp(to_blocks(x.float(), (block,)) / scale, -qmax, qmax)
    if element == (2, 1):
        return pack_nibbles(from_blocks(e2m1_encode(y), (block,), x.shape)), byte
    if element in FP6_FORMATS:
        codes = fp6_encode(y, element)
    elif element == 8:
        codes = mxint8_encode(y)
    else:
        codes = cast_fp8(y, element)
    return from_blocks(codes, (block,), x.shape), byte


def mx_dequantize(codes: torch.Tensor, byte: torch.Tensor, elem: MxElement = "e4m3", block: int = 32, n: int | None = None) -> torch.Tensor:
    """fp32 values; ``n`` is the original last-dim size (needed for packed E2M1)."""
    element = mx_element(elem)
    if element == (2, 1):
        n = n if n is not None else codes.shape[-1] * 2
        values = e2m1_decode(unpack_nibbles(codes, n))
    elif element in FP6_FORMATS:
        values = fp6_decode(codes, element)
    else:
        values = codes.float()
    vb = to_blocks(values, (block,)) * e8m0_to_float(byte).unsqueeze(-1)
    return from_blocks(vb, (block,), values.shape)


def mx_fake_quant(x: torch.Tensor, elem: MxElement = "e4m3", block: int = 32, rounding: Rounding | str = Rounding.RCEIL) -> torch.Tensor:
    """fp32 fake-quantized ``x``."""
    codes, byte = mx_quantize(x, elem, block, rounding)
    return mx_dequantize(codes, byte, elem, block, x.shape[-1])
