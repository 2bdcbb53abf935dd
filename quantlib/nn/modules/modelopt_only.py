"""The plain-torch module classes ModelOpt 0.47 converts by default (its nn/modules/) and quantlib does not,
with the quantizers ModelOpt gives them: where a config would enable those, the two libraries quantize
different tensors (e.g. ``*input_quantizer`` of INT8_DEFAULT_CFG reaches every nn.LayerNorm's input in
ModelOpt). ``quantize()`` names such modules in a warning.

nn.LayerNorm stays unconverted deliberately: Megatron-Core models hold torch LayerNorms whose quantizer
state the Megatron plugin's distributed checkpoint does not carry, so a restore at another layout would
silently lose it."""

from __future__ import annotations

from torch import nn

_INPUT_ONLY = [nn.LayerNorm, nn.LeakyReLU] + [
    getattr(nn, f"{kind}{d}d") for kind in ("BatchNorm", "InstanceNorm", "MaxPool", "AvgPool", "AdaptiveAvgPool") for d in (1, 2, 3)
]

#: class -> the quantizers ModelOpt 0.47 gives its modules: input-only norms, pools and activations
#: (its QuantInputBase), transposed convolutions, recurrent layers
MODELOPT_ONLY: dict[type, tuple[str, ...]] = {
    **{c: ("input_quantizer",) for c in _INPUT_ONLY},
    **{getattr(nn, f"ConvTranspose{d}d"): ("input_quantizer", "weight_quantizer") for d in (1, 2, 3)},
    **{c: ("input_quantizer", "weight_quantizer") for c in (nn.RNN, nn.LSTM, nn.GRU)},
}
