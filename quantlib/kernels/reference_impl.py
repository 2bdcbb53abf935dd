"""The torch reference registered as the "reference" backend of every op."""

from __future__ import annotations

import torch

from .. import formats
from ..formats import FormatSpec, Rounding
from ..formats.fp8 import fp8_codes
from ..formats.fp8_blockwise import fp8_blockwise_quantize
from ..formats.mx import mx_quantize
from ..formats.nvfp4 import nvfp4_quantize
from .backends import register


@register("fake_quant", "reference")
def fake_quant(x: torch.Tensor, spec: FormatSpec, amax: torch.Tensor | None, block_amax: torch.Tensor | None = None) -> torch.Tensor:
    return formats.fake_quant(x, spec, amax, block_amax)


@register("block_amax", "reference")
def block_amax(x: torch.Tensor, block: tuple[int, ...]) -> torch.Tensor:
    return formats.block_amax(x, block)


@register("fp8_blockwise_cast", "reference")
def fp8_blockwise_cast(x: torch.Tensor, block: tuple[int, ...], eps: float, pow2: bool, amax: torch.Tensor
                       | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    return fp8_blockwise_quantize(x, block, (4, 3), eps, pow2, amax)


@register("mx_cast", "reference")
def mx_cast(x: torch.Tensor, elem: str, block: int, rounding: Rounding) -> tuple[torch.Tensor, torch.Tensor]:
    return mx_quantize(x, elem, block, rounding)


@register("nvfp4_cast", "reference")
def nvfp4_cast(x: torch.Tensor, global_amax: torch.Tensor | None, block: int = 16, block_amax: torch.Tensor
               | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return nvfp4_quantize(x, global_amax, block, block_amax)


@register("fp8_cast", "reference")
def fp8_cast(x: torch.Tensor, scale: torch.Tensor, element: tuple[int, int]) -> torch.Tensor:
    return fp8_codes(x, scale, element)
