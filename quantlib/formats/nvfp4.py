"""NVFP4: E2M1 elements in blocks of 16 (or 32), E4M3 block scales, an fp32 global scale.

``s2 = A / (6 * 448)`` (``s2 = 1`` when ``A <= 2^-24``); per block ``sb = a / (6 * s2)``, ``sb := 1`` where
``sb == 0``, ``sb8 = cast_rne_e4m3(clamp(sb, 2^-9, 448))``; ``y = x / (sb8 * s2)`` rounded to E2M1
(RNE, saturating at 6); ``x_hat = value(code) * (sb8 * s2)``, the product taken first in fp32.

The block amax ``a`` is the block's max |x| (dynamic blocks), or a stored one (static blocks, ModelOpt's
``"type": "static"``: calibrated, e.g. by the MSE FP8-scale sweep) that needs the static global amax
``A`` it was chosen against. A block holding NaN gets NaN outputs either way.

The global amax is one value (per tensor), or one per row: any shape that broadcasts to
``x.shape[:-1] + (1,)``, e.g. ``(E, 1, 1)`` for E stacked expert weights ``(E, out, in)``; each row then
takes the scale of its own global amax, bit for bit what a call per expert gives.
"""

from __future__ import annotations

import torch

from .blocks import block_amax as max_per_block, blocked_shape, from_blocks, to_blocks
from .e2m1 import e2m1_decode, e2m1_encode, pack_nibbles, unpack_nibbles
from .spec import TINY_AMAX

NVFP4_BLOCK = 16
_E4M3_MAX = 448.0
_SB_MIN = 2.0**-9


def check_global_amax(shape: tuple[int, ...] | torch.Size, global_amax: torch.Tensor) -> None:
    """Raise unless ``global_amax`` has one element or broadcasts to one value per row of an input of ``shape``."""
    rows = tuple(shape)[:-1] + (1,)
    g = tuple(global_amax.shape)
    if global_amax.numel() == 1:
        return
    padded = (1,) * (len(rows) - len(g)) + g
    if len(g) > len(rows) or any(a != 1 and a != r for a, r in zip(padded, rows)):
        raise ValueError(f"nvfp4: global amax of shape {g} is neither one value nor one per row of input {tuple(shape)} "
                         f"(broadcasting to {rows})")


def nvfp4_global_scale(global_amax: torch.Tensor) -> torch.Tensor:
    """fp32 ``s2`` from the global amax ``A``: 0-dim for one value, else of ``A``'s shape (one per row)."""
    a = global_amax.float()
    a = a.reshape(()) if a.numel() == 1 else a
    return torch.where(a <= TINY_AMAX, torch.ones_like(a), a / torch.full_like(a, 6.0 * _E4M3_MAX))  # IEEE on every device


def nvfp4_block_scale(amax: torch.Tensor, s2: torch.Tensor) -> torch.Tensor:
    """E4M3 block scales ``sb8`` from block amax ``a``."""
    sb = amax.float() / (6.0 * s2)
    sb = torch.where(sb == 0, torch.ones_like(sb), sb)
    return torch.clamp(sb, _SB_MIN, _E4M3_MAX).to(torch.float8_e4m3fn)


def static_block_amax(x: torch.Tensor, block_amax: torch.Tensor, block: int) -> torch.Tensor:
    """The stored block amax as fp32, NaN where the block of ``x`` holds NaN; raises if it does not fit."""
    expected = blocked_shape(x.shape, (block,))
    if tuple(block_amax.shape) != expected:
        raise ValueError(f"nvfp4: static block amax of shape {tuple(block_amax.shape)} does not fit input {tuple(x.shape)} with block "
                         f"{block}: expected {expected}")
    has_nan = torch.isnan(to_blocks(x, (block,))).any(dim=-1)
    return torch.where(has_nan, torch.full_like(has_nan, float("nan"), dtype=torch.float32), block_amax.to(x.device, torch.float32))


def nvfp4_quantize(
    x: torch.Tensor, global_amax: torch.Tensor | None = None, block: int = NVFP4_BLOCK, block_amax: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Packed uint8 codes, float8_e4m3fn block scales and the fp32 global scale ``s2``.

    ``global_amax`` None means dynamic: the amax of ``x``; one value, or one per row (see the module doc:
    ``s2`` then has its shape). ``block_amax``: static block amax (needs a ``global_amax``); None: each
    block's max |x|.
    """
    if global_amax is not None:
        check_global_amax(x.shape, global_amax)
    xf = x.float()
    if block_amax is None:
        a = max_per_block(xf, (block,))
    elif global_amax is None:
        raise ValueError("nvfp4: a static block amax needs the static global amax it was chosen against")
    else:
        a = static_block_amax(xf, block_amax, block)
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


def nvfp4_fake_quant(x: torch.Tensor, global_amax: torch.Tensor | None = None, block: int = NVFP4_BLOCK, block_amax: torch.Tensor
                     | None = None) -> torch.Tensor:
    """fp32 fake-quantized ``x``."""
    packed, sb8, s2 = nvfp4_quantize(x, global_amax, block, block_amax)
    return nvfp4_dequantize(packed, sb8, s2, x.shape[-1], block)
