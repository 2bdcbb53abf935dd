"""The result of real quantization: packed codes plus the scales that dequantize them."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .spec import FormatSpec


@dataclass
class QuantizedTensor:
    """Codes and scales of one tensor; ``dequantize(q)`` equals ``fake_quant(x)`` bit for bit.

    ``codes``: int8/uint8 (INT), float8 (FP8, FP8 blockwise, MXFP8) or uint8 with two E2M1 codes per
    byte, low nibble first (MXFP4, NVFP4). ``scale``: what dequantization multiplies or divides by, per
    group (fp32, uint8 E8M0 bytes, or float8_e4m3fn block scales). ``global_scale``: NVFP4's fp32 ``s2``.
    """

    codes: torch.Tensor
    scale: torch.Tensor
    spec: FormatSpec
    shape: tuple[int, ...]
    dtype: torch.dtype
    global_scale: torch.Tensor | None = None
