"""Quantizer modules and quantized module classes."""

from . import modules  # noqa: F401  (registers nn.Linear / nn.Conv*)
from .containers import GroupedQuantizer, QuantizerContainer, SequentialQuantizer, build_quantizer
from .quant_module import QuantModule, QuantModuleRegistry
from .tensor_quantizer import CalibrationError, TensorQuantizer

__all__ = ["CalibrationError", "GroupedQuantizer", "QuantModule", "QuantModuleRegistry", "QuantizerContainer", "SequentialQuantizer",
           "TensorQuantizer", "build_quantizer"]
