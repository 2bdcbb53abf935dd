"""FP8 blockwise (1xB activations, BxB weights; the DeepSeek / TE recipe).

Per block ``d = max(a, eps) / Q`` (all-zero blocks never give 0 or NaN); with ``pow2``,
``d = 2^ceil(log2 d)`` computed exactly from the fp32 bits (also for a subnormal ``d``);
``c = cast_rne(clamp(x / d, -Q, Q))``; the stored scale is ``d``; ``x_hat = c * d``.
Every NaN code is the positive NaN byte 0x7F, whatever the sign of the NaN that produced it: a block
whose amax is NaN is 0x7F throughout (one rule for every backend; the sign of a NaN quotient depends on
the hardware and on which operand was NaN).
"""

from __future__ import annotations

import torch

from .blocks import block_amax, from_blocks, to_blocks
from .fp8 import cast_fp8
from .spec import FLOAT_FORMATS

_EXP_MASK = 0x7F800000
_MANT_MASK = 0x007FFFFF
_MIN_NORMAL_BITS = 0x00800000
_MIN_NORMAL = 2.0**-126


def pow2_ceil(d: torch.Tensor) -> torch.Tensor:
    """Smallest fp32 power of two >= ``d`` for ``d >= 0``, from the bits (NaN/Inf kept, 0 -> 2^-149).

    A subnormal ``d`` is first scaled by ``2^126`` (exact, the result is normal), rounded up from its
    bits, and scaled back by ``2^-126`` (exact: powers of two down to ``2^-149`` are representable).
    """
    sub = d < _MIN_NORMAL
    v = torch.where(sub, d * 2.0**126, d)
    bits = v.view(torch.int32)
    exp = bits & _EXP_MASK
    up = torch.where((bits & _MANT_MASK) != 0, exp + _MIN_NORMAL_BITS, exp).view(torch.float32)
    out = torch.where(sub, up * 2.0**-126, up)
    out = torch.where(d == 0, torch.full_like(d, 2.0**-149), out)
    return torch.where(torch.isfinite(d), out, d)


def blockwise_scale(amax: torch.Tensor, element: tuple[int, int], eps: float, pow2: bool) -> torch.Tensor:
    """Dequantization scale ``d`` of each block from its amax."""
    q = FLOAT_FORMATS[tuple(element)][0]
    a = amax.float()
    # Divide by a same-device tensor: CUDA turns division by a Python number into a multiply by its
    # reciprocal, which is not the IEEE quotient the contract asks for.
    d = torch.maximum(a, torch.full_like(a, eps)) / torch.full_like(a, q)
    return pow2_ceil(d) if pow2 else d


def fp8_blockwise_quantize(
    x: torch.Tensor,
    block: tuple[int, ...],
    element: tuple[int, int] = (4, 3),
    eps: float = 1e-10,
    pow2: bool = False,
    amax: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """FP8 codes (shape of ``x``) and fp32 scales ``d`` (one per block); ``amax`` static or None."""
    a = block_amax(x, block) if amax is None else amax.float()
    d = blockwise_scale(a, element, eps, pow2)
    xb = to_blocks(x.float(), block)
    y = xb / d.unsqueeze(-1)
    y = torch.where(torch.isnan(y), torch.full_like(y, float("nan")), y)  # +NaN: code 0x7F
    codes = cast_fp8(y, element)
    return from_blocks(codes, block, x.shape), d


def fp8_blockwise_dequantize(codes: torch.Tensor, d: torch.Tensor, block: tuple[int, ...]) -> torch.Tensor:
    cb = to_blocks(codes.float(), block)
    return from_blocks(cb * d.unsqueeze(-1), block, codes.shape)


def fp8_blockwise_fake_quant(x: torch.Tensor, block: tuple[int, ...], element: tuple[int, int] = (4, 3), eps: float = 1e-10,
                             pow2: bool = False, amax: torch.Tensor | None = None) -> torch.Tensor:
    """fp32 fake-quantized ``x``."""
    codes, d = fp8_blockwise_quantize(x, block, element, eps, pow2, amax)
    return fp8_blockwise_dequantize(codes, d, block)
