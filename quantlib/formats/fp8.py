"""FP8 E4M3 / E5M2 per tensor or per channel with a static amax.

``a' = a`` if ``a > 2^-24`` else 1 (NaN stays NaN); ``s = Q / a'``;
``c = cast_rne_fp8(clamp(x * s, -Q, Q))``; ``x_hat = c * (1 / s)``.
"""

from __future__ import annotations

import torch

from .spec import FLOAT_FORMATS, TINY_AMAX

FP8_DTYPES: dict[tuple[int, int], torch.dtype] = {
    (4, 3): torch.float8_e4m3fn,
    (5, 2): torch.float8_e5m2,
}


def fp8_dtype(element: tuple[int, int]) -> torch.dtype:
    try:
        return FP8_DTYPES[tuple(element)]
    except KeyError:
        raise ValueError(f"no FP8 dtype for element format {element}; expected (4, 3) or (5, 2)") from None


def cast_fp8(y: torch.Tensor, element: tuple[int, int]) -> torch.Tensor:
    """Saturating round-to-nearest-even cast of fp32 ``y`` to FP8 (NaN stays NaN)."""
    q = FLOAT_FORMATS[tuple(element)][0]
    return torch.clamp(y, -q, q).to(fp8_dtype(element))


def fp8_scale(amax: torch.Tensor, element: tuple[int, int]) -> torch.Tensor:
    """Quantization scale ``s = Q / a'`` (fp32, one IEEE division; see :func:`quantlib.formats.int.int_scale`)."""
    q = FLOAT_FORMATS[tuple(element)][0]
    amax = amax.float()
    safe = torch.where(amax > TINY_AMAX, amax, torch.ones_like(amax))
    safe = torch.where(torch.isnan(amax), amax, safe)
    return torch.full_like(safe, q) / safe


def fp8_quantize(x: torch.Tensor, amax: torch.Tensor, element: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """FP8 codes and the dequantization scale ``1 / s`` (fp32, shape of ``amax``)."""
    s = fp8_scale(amax, element)
    return cast_fp8(x.float() * s, element), torch.reciprocal(s)


def fp8_dequantize(codes: torch.Tensor, inv_scale: torch.Tensor) -> torch.Tensor:
    return codes.float() * inv_scale


def fp8_fake_quant(x: torch.Tensor, amax: torch.Tensor, element: tuple[int, int]) -> torch.Tensor:
    """fp32 fake-quantized ``x``."""
    return fp8_dequantize(*fp8_quantize(x, amax, element))
