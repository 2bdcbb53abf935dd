"""Integer formats: signed (narrow or full range) and unsigned, per tensor / channel / block.

``Q = 2^(b-1)-1`` (signed) or ``2^b-1`` (unsigned); ``scale = Q / a``;
``q = clamp(round_half_even(x * scale), min, Q)``; ``x_hat = q / scale``; groups with ``a <= 2^-24``
give zeros. An integer code cannot hold NaN: a NaN code is stored as 0 and a group whose ``a`` or ``x``
holds NaN gets a NaN scale, so the whole group dequantizes to NaN (never to a silently finite value).
"""

from __future__ import annotations

import torch

from .spec import TINY_AMAX


def int_range(num_bits: int, unsigned: bool, narrow_range: bool) -> tuple[float, float]:
    """(min, max) integer code."""
    if unsigned:
        return 0.0, float(2**num_bits - 1)
    q = float(2 ** (num_bits - 1) - 1)
    return (-q if narrow_range else -q - 1.0), q


def int_scale(amax: torch.Tensor, qmax: float) -> torch.Tensor:
    """fp32 quantization scale ``Q / a`` (inf where ``a == 0``), one IEEE division.

    Not ``qmax / amax``: torch evaluates a Python number divided by a tensor as ``reciprocal(a) * Q``,
    two roundings that differ from ``Q / a`` in the last bit for about a quarter of all ``a``.
    """
    amax = amax.float()
    return torch.full_like(amax, qmax) / amax


def int_codes(x: torch.Tensor, amax: torch.Tensor, num_bits: int, unsigned: bool, narrow_range: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 integer-valued codes of ``x`` (never NaN) and the scale; ``amax`` broadcasts against ``x``.

    The group of one scale entry is the set of elements of ``x`` it broadcasts over; NaN in it makes
    that entry NaN.
    """
    lo, hi = int_range(num_bits, unsigned, narrow_range)
    amax, xf = amax.float(), x.float()
    scale = int_scale(amax, hi)
    q = torch.clamp(torch.round(xf * scale), lo, hi)
    q = torch.where((amax <= TINY_AMAX) | torch.isnan(q), torch.zeros_like(q), q)
    nan_group = torch.isnan(xf).expand(q.shape).sum_to_size(scale.shape) > 0
    scale = torch.where(nan_group, torch.full_like(scale, float("nan")), scale)
    return q, scale


def int_dequant(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return q.float() / scale


def int_fake_quant(x: torch.Tensor, amax: torch.Tensor, num_bits: int, unsigned: bool = False, narrow_range: bool = True) -> torch.Tensor:
    """fp32 fake-quantized ``x``."""
    q, scale = int_codes(x, amax, num_bits, unsigned, narrow_range)
    return int_dequant(q, scale)


def code_dtype(num_bits: int, unsigned: bool) -> torch.dtype:
    if num_bits > 8:
        return torch.int32
    return torch.uint8 if unsigned else torch.int8
