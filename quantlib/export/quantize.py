"""Real quantization of one weight with its quantizer's calibrated amax, through quantlib's kernels.

The casts of :mod:`quantlib.kernels` (FP8 blockwise, MX, NVFP4) and the INT / FP8 formulas of
:mod:`quantlib.formats` are the ones fake quantization runs, so ``dequantize(real_quantize(w))`` is the
weight the model was evaluated with, bit for bit.
"""

from __future__ import annotations

from typing import Optional

import torch

from .. import kernels
from ..formats import FormatSpec, Kind, QuantizedTensor, blocked_shape, quantize
from ..formats.fp8 import fp8_scale
from ..formats.fp8_blockwise import blockwise_scale
from ..formats.mx import mx_element_name, spec_element


def real_quantize(
    w: torch.Tensor, spec: FormatSpec, amax: Optional[torch.Tensor], backend: str = "auto", scale: Optional[torch.Tensor] = None,
    block_amax: Optional[torch.Tensor] = None
) -> QuantizedTensor:
    """Codes and scales of ``w`` (on its device) as the quantizer of ``spec`` with ``amax`` fake-quantizes it,
    queued on ``w``'s device without reading anything back.

    ``scale``: FP8's :func:`static_scale` of ``amax``, when the caller computed it already (for many
    weights at once, see :func:`static_scales`). ``block_amax``: NVFP4's stored static block amax."""
    shape, dtype = tuple(w.shape), w.dtype
    if spec.kind == Kind.MX:
        codes, byte = kernels.mx_cast(w, mx_element_name(spec_element(spec)), spec.block[0], spec.rounding, backend=backend)
        return QuantizedTensor(codes, byte, spec, shape, dtype)
    if spec.kind == Kind.NVFP4:
        packed, sb8, s2 = kernels.nvfp4_cast(w, amax, backend=backend, block=spec.block[0], block_amax=block_amax)
        return QuantizedTensor(packed, sb8, spec, shape, dtype, global_scale=s2)
    if spec.kind == Kind.FP8_BLOCK and spec.element == (4, 3):
        # a static quantizer's block scales come from its calibrated amax, which the cast reads (no
        # comparison with the weight's own block amax: that would read a device value back per weight)
        static = None if spec.dynamic or amax is None else amax.broadcast_to(blocked_shape(shape,
                                                                                           spec.block))  # e.g. one amax for every block
        codes, d = kernels.fp8_blockwise_cast(w, spec.block, spec.eps, spec.pow2, backend=backend, amax=static)
        return QuantizedTensor(codes, d, spec, shape, dtype)
    if spec.kind == Kind.FP8 and amax is not None and w.dim() == 2 and (amax.numel() == 1 or tuple(amax.shape) == (shape[0], 1)):
        # one scale, or one per output row (axis=0); other broadcasts take the reference formula below
        scale = scale if scale is not None else static_scale(amax.to(w.device), spec)
        codes = kernels.fp8_cast(w, scale, spec.element, backend=backend)
        return QuantizedTensor(codes, torch.reciprocal(scale), spec, shape, dtype)
    # INT: the reference formulas (what every fake-quant backend equals)
    return quantize(w, spec, None if amax is None else amax.to(w.device))


def static_scale(amax: torch.Tensor, spec: FormatSpec) -> Optional[torch.Tensor]:
    """The scale a static FP8 (``Q / a``) or FP8-block (``d``) quantizer takes from its amax; None for others."""
    if spec.kind == Kind.FP8:
        return fp8_scale(amax, spec.element)
    if spec.scale_from_amax:
        return blockwise_scale(amax, spec.element, spec.eps, spec.pow2)
    return None


def static_scales(pairs: list[tuple[FormatSpec, torch.Tensor]]) -> list[Optional[torch.Tensor]]:
    """:func:`static_scale` of many (spec, amax), computed for each spec and device in one pass: the
    formulas are elementwise, so one call over the concatenated amax gives every scale."""
    out: list[Optional[torch.Tensor]] = [None] * len(pairs)
    groups: dict[tuple, list[int]] = {}
    for i, (spec, amax) in enumerate(pairs):
        if amax is not None and spec.scale_from_amax:
            groups.setdefault((spec, amax.device), []).append(i)
    for (spec, _), idx in groups.items():
        flat = torch.cat([pairs[i][1].reshape(-1).float() for i in idx])
        scales = static_scale(flat, spec).split([pairs[i][1].numel() for i in idx])
        for i, sc in zip(idx, scales):
            out[i] = sc.reshape(pairs[i][1].shape)
    return out
