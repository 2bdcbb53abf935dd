"""Quantized nn.LayerNorm: an input quantizer (and an output quantizer, off by default) around the original
forward, as ModelOpt registers it, so that a pattern such as ``*input_quantizer`` of its presets quantizes
the same tensors in both libraries (a LayerNorm's input is the residual stream).

:data:`MODELOPT_ONLY` names the plain-torch classes ModelOpt 0.47 also converts and quantlib does not;
``quantize()`` warns, naming each module, where a config would enable their quantizers in ModelOpt."""

from __future__ import annotations

import torch
from torch import nn

from ...config import QuantizerAttributeConfig
from ..quant_module import QuantModule, QuantModuleRegistry
from ..tensor_quantizer import TensorQuantizer


class QuantInputOnly(QuantModule):
    """A module whose input (its first argument) is quantized; it has no weight quantizer. The searches
    (smoothquant, awq) leave it at max calibration, as ModelOpt does."""

    quantizer_names = ("input_quantizer", "output_quantizer")
    weight_quantizer_names = ()
    input_only = True

    def _setup(self) -> None:
        self.input_quantizer = TensorQuantizer(QuantizerAttributeConfig())
        self.output_quantizer = TensorQuantizer(QuantizerAttributeConfig(enable=False))
        self._weight_cache = {}

    def weight_groups(self):
        return iter(())

    def forward(self, input: torch.Tensor, *args, **kwargs):
        if self.quantizers_off():
            return super().forward(input, *args, **kwargs)
        out = super().forward(self.input_quantizer(input), *args, **kwargs)
        if isinstance(out, tuple):
            return (self.output_quantizer(out[0]), *out[1:])
        return self.output_quantizer(out)


class _QuantLayerNorm(QuantInputOnly):
    pass


QuantModuleRegistry.register(nn.LayerNorm, "nn.LayerNorm")(_QuantLayerNorm)

_POOLS = [getattr(nn, f"{kind}{d}d") for kind in ("MaxPool", "AvgPool", "AdaptiveAvgPool") for d in (1, 2, 3)]
_INPUT_ONLY = [getattr(nn, f"{kind}{d}d") for kind in ("BatchNorm", "InstanceNorm") for d in (1, 2, 3)] + [nn.LeakyReLU] + _POOLS
#: class -> the quantizers ModelOpt 0.47 gives it by default (its nn/modules/), for classes quantlib leaves
#: in full precision: input-only norms, pools and activations, transposed convolutions, recurrent layers
MODELOPT_ONLY: dict[type, tuple[str, ...]] = {
    **{c: ("input_quantizer",) for c in _INPUT_ONLY},
    **{getattr(nn, f"ConvTranspose{d}d"): ("input_quantizer", "weight_quantizer") for d in (1, 2, 3)},
    **{c: ("input_quantizer", "weight_quantizer") for c in (nn.RNN, nn.LSTM, nn.GRU)},
}
