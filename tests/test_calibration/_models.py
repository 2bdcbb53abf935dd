"""Small models for the calibration-algorithm tests (fixed seeds)."""

from __future__ import annotations

import torch
from torch import nn

from quantlib.config import QuantizerAttributeConfig
from quantlib.nn import QuantModule, QuantModuleRegistry, TensorQuantizer


def mlp(seed: int = 0, d_in: int = 64, hidden: int = 48, d_out: int = 16) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(d_in, hidden), nn.ReLU(), nn.Linear(hidden, d_out)).eval()


def outlier_data(n: int = 3, rows: int = 8, d_in: int = 64, seed: int = 1) -> list[torch.Tensor]:
    """Activations whose channel scales grow 0.1 .. 5 (channel i: 0.1 + 4.9 i / (d_in - 1))."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(rows, d_in, generator=g) * torch.linspace(0.1, 5, d_in) for _ in range(n)]


def loop(data):
    return lambda m: [m(x) for x in data]


class Gain(nn.Module):
    """A weight-less module (y = 2x) whose quantized form has only an input quantizer."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return 2 * x


class QuantGain(QuantModule):
    quantizer_names = ("input_quantizer",)
    weight_quantizer_names = ()

    def _setup(self) -> None:
        self.input_quantizer = TensorQuantizer(QuantizerAttributeConfig())

    def weight_groups(self):
        return iter(())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return 2 * self.input_quantizer(x)


def register_gain() -> None:
    QuantModuleRegistry.register(Gain, "Gain")(QuantGain)


def unregister_gain() -> None:
    QuantModuleRegistry.unregister(Gain)


def int8_cfg(algorithm, narrow_range: bool = False) -> dict:
    """INT8 weights per channel, INT8 inputs per tensor (ModelOpt's integers are full range)."""
    w = {"num_bits": 8, "axis": 0, "narrow_range": narrow_range}
    i = {"num_bits": 8, "axis": None, "narrow_range": narrow_range}
    return {"quant_cfg": {"default": {"enable": False}, "*weight_quantizer": w, "*input_quantizer": i}, "algorithm": algorithm}
