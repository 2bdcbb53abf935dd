"""Pure-torch reference of every number format (docs/design.md §3): one module per format."""

from .blocks import block_amax, blocked_shape
from .qtensor import QuantizedTensor
from .reference import dequantize, dynamic_amax, fake_quant, quantize
from .spec import FLOAT_FORMATS, TINY_AMAX, FormatSpec, Kind, Rounding

__all__ = [
    "FLOAT_FORMATS",
    "TINY_AMAX",
    "FormatSpec",
    "Kind",
    "QuantizedTensor",
    "Rounding",
    "block_amax",
    "blocked_shape",
    "dequantize",
    "dynamic_amax",
    "fake_quant",
    "quantize",
]
