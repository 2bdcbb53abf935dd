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


def fp8_codes(x: torch.Tensor, scale: torch.Tensor, element: tuple[int, int]) -> torch.Tensor:
    """``cast_fp8(x.float() * scale)`` with ``scale`` one value or one per row of the last dim (shape
    ``x.shape[:-1] + (1,)``), in row chunks so that the fp32 temporaries stay small: in cache on the CPU
    (64 Ki elements), at most 64 MiB on a GPU. Elementwise, so equal to the unchunked formula."""
    q = FLOAT_FORMATS[tuple(element)][0]
    out = torch.empty(x.shape, dtype=fp8_dtype(element), device=x.device)
    if x.numel() == 0:
        return out
    cols = x.shape[-1] if x.dim() else 1
    x2, o2 = x.reshape(-1, cols), out.view(-1, cols)
    s = scale.float().reshape(-1, 1) if scale.numel() > 1 else scale.float().reshape(())
    limit = (1 << 16) if x.device.type == "cpu" else (1 << 24)
    step = max(1, limit // cols)
    for r0 in range(0, x2.shape[0], step):
        # a copy, then in place: x may be fp32 itself
        y = x2[r0 : r0 + step].to(torch.float32, copy=True).mul_(s[r0 : r0 + step] if s.dim() else s)
        o2[r0 : r0 + step] = y.clamp_(-q, q)
    return out


def fp8_dequantize(codes: torch.Tensor, inv_scale: torch.Tensor) -> torch.Tensor:
    return codes.float() * inv_scale


def fp8_fake_quant(x: torch.Tensor, amax: torch.Tensor, element: tuple[int, int]) -> torch.Tensor:
    """fp32 fake-quantized ``x``."""
    return fp8_dequantize(*fp8_quantize(x, amax, element))
