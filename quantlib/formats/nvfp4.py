"""NVFP4: E2M1 elements in blocks of 16, E4M3 block scales, an fp32 global scale.

``s2 = A / (6 * 448)`` (``s2 = 1`` when ``A <= 2^-24``); per block ``sb = a / (6 * s2)``, ``sb := 1`` where
``sb == 0``, ``sb8 = cast_rne_e4m3(clamp(sb, 2^-9, 448))``; ``y = x / (sb8 * s2)`` rounded to E2M1
(RNE, saturating at 6); ``x_hat = value(code) * (sb8 * s2)``, the product taken first in fp32.
"""

from __future__ import annotations

import torch

from .blocks import block_amax, from_blocks, to_blocks
from .e2m1 import e2m1_decode, e2m1_encode, pack_nibbles, unpack_nibbles
from .spec import TINY_AMAX

NVFP4_BLOCK = 16
_E4M3_MAX = 448.0
_SB_MIN = 2.0**-9


def nvfp4_global_scale(global_amax: torch.Tensor) -> torch.Tensor:
    """fp32 scalar ``s2`` from the global amax ``A``."""
    a = global_amax.float().reshape(())
    return torch.where(a <= TINY_AMAX, torch.ones_like(a), a / torch.full_like(a, 6.0 * _E4M3_MAX))  # IEEE on every device


def nvfp4_block_scale(amax: torch.Tensor, s2: torch.Tensor) -> torch.Tensor:
    """E4M3 block scales ``sb8`` from block amax ``a``."""
    sb = amax.float() / (6.0 * s2)
    sb = torch.where(sb == 0, torch.ones_like(sb), sb)
    return torch.clamp(sb, _SB_MIN, _E4M3_MAX).to(torch.float8_e4m3fn)


def nvfp4_quantize(x: torch.Tensor, global_amax: torch.Tensor | None = None, block: int = NVFP4_BLOCK) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Packed uint8 codes, float8_e4m3fn block scales and the fp32 global scale ``s2``.

    ``global_amax`` None means dynamic: the amax of ``x``.
    """
    xf = x.float()
    a = block_amax(xf, (block,))
    s2 = nvfp4_global_scale(a.amax() if global_amax is None else global_amax)
    sb8 = nvfp4_block_scale(a, s2)
    y = to_blocks(xf, (block,)) / (sb8.float() * s2).unsqueeze(-1)
    codes = from_blocks(e2m1_encode(y), (block,), x.shape)
    return pack_nibbles(codes), sb8, s2


def nvfp4_dequantize(packed: torch.Tensor, sb8: torch.Tensor, s2: torch.Tensor, n: int, block: int = NVFP4_BLOCK) -> torch.Tensor:
    """fp32 values of ``n`` elements along the last dim."""
    values = e2m1_decode(unpack_nibbles(packed, n))
    vb = to_blocks(values, (block,)) * (sb8.float() * s2).unsqueeze(-1)
    return from_blocks(vb, (block,), values.shape)


def nvfp4_fake_quant(x: torch.Tensor, global_amax: torch.Tensor | None = None, block: int = NVFP4_BLOCK) -> torch.Tensor:
    """fp32 fake-quantized ``x``."""
    packed, sb8, s2 = nvfp4_quantize(x, global_amax, block)
    return nvfp4_dequantize(packed, sb8, s2, x.shape[-1], block)
