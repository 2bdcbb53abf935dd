"""Shared fixtures of the core tests: a small MLP, a small conv net, calibration data and forward loops.

The models are deliberately small (a forward is well under a millisecond) but their widths leave
partial blocks for every block format (48 and 12 are not multiples of 16, 32 or 128).
"""

from __future__ import annotations

from typing import Callable

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import quantlib as ql
from quantlib import GroupedQuantizer, QuantModule, QuantModuleRegistry, TensorQuantizer
from quantlib.presets import SCOPED_PRESETS


class MLP(nn.Module):
    """Linear(64, 48) -> ReLU -> Linear(48, 16); quantizer names ``fc1.*`` and ``fc2.*``."""

    def __init__(self, d_in: int = 64, hidden: int = 48, d_out: int = 16) -> None:
        super().__init__()
        self.fc1 = nn.Linear(d_in, hidden)
        self.act = nn.ReLU()
        self.fc2 = nn.Linear(hidden, d_out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


class ConvNet(nn.Module):
    """Conv2d -> BatchNorm2d -> ReLU -> Conv2d -> pool -> Linear head; inputs [N, 3, 12, 12]."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, 8, 3, padding=1)
        self.bn = nn.BatchNorm2d(8)
        self.act = nn.ReLU()
        self.conv2 = nn.Conv2d(8, 16, 3, padding=1)
        self.pool = nn.AdaptiveAvgPool2d(2)
        self.head = nn.Linear(64, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.conv2(self.act(self.bn(self.conv1(x))))
        return self.head(self.pool(x).flatten(1))


INPUT_SHAPES = {"mlp": (8, 64), "conv": (4, 3, 12, 12)}
_CLASSES = {"mlp": MLP, "conv": ConvNet}


def build(kind: str, seed: int = 0) -> nn.Module:
    """A fresh model of ``kind`` ("mlp" or "conv") in eval mode; same seed, same weights."""
    torch.manual_seed(seed)
    return _CLASSES[kind]().eval()


def batches(kind: str, n: int = 3, seed: int = 1, scale: float = 1.0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [scale * torch.randn(*INPUT_SHAPES[kind], generator=g) for _ in range(n)]


def loop_over(data: list[torch.Tensor]) -> Callable[[nn.Module], None]:
    """A ModelOpt-style forward loop: ``forward_loop(model)`` runs the model on every batch."""

    def forward_loop(model: nn.Module) -> None:
        for x in data:
            model(x)

    return forward_loop


@pytest.fixture
def make_model() -> Callable[..., nn.Module]:
    """``make_model(kind, seed=0)``: a fresh MLP ("mlp") or conv net ("conv")."""
    return build


@pytest.fixture
def make_data() -> Callable[..., list[torch.Tensor]]:
    """``make_data(kind, n=3, seed=1, scale=1.0)``: calibration batches for a model kind."""
    return batches


@pytest.fixture
def make_loop() -> Callable[[list[torch.Tensor]], Callable[[nn.Module], None]]:
    return loop_over


@pytest.fixture
def model_classes() -> dict[str, type]:
    return dict(_CLASSES)


@pytest.fixture(params=sorted(set(ql.PRESETS) - set(SCOPED_PRESETS)))
def preset_name(request) -> str:
    """Every preset of ``quantlib.PRESETS`` that quantizes a whole model, by name (the MLP-only and
    experts-only ones leave these models unquantized; tests/calib/test_calib_presets.py has them)."""
    return request.param


class TwoExperts(nn.Module):
    """Two weights of one shape, one GEMM each (``forward(x, i)`` uses expert i): a grouped linear."""

    def __init__(self) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.w0 = nn.Parameter(torch.randn(4, 8, generator=g))
        self.w1 = nn.Parameter(3 * torch.randn(4, 8, generator=g))

    def forward(self, x: torch.Tensor, i: int = 0) -> torch.Tensor:
        return F.linear(x, self.w1 if i else self.w0)


class _QuantTwoExperts(QuantModule):
    grouped_quantizer_names = ("weight_quantizer",)

    def _setup(self) -> None:
        super()._setup()
        self.weight_quantizer = GroupedQuantizer([TensorQuantizer({"axis": 0}), TensorQuantizer({"axis": 0})])

    def weight_groups(self):
        yield "weight_quantizer", [self.w0, self.w1]

    def forward(self, x: torch.Tensor, i: int = 0) -> torch.Tensor:
        return F.linear(self.input_quantizer(x), self.quantize_weight(self.w1 if i else self.w0, member=i))


@pytest.fixture
def two_experts() -> type:
    """TwoExperts, registered with a GroupedQuantizer weight quantizer for the test's duration."""
    QuantModuleRegistry.register(TwoExperts, "TwoExperts")(_QuantTwoExperts)
    yield TwoExperts
    QuantModuleRegistry.unregister(TwoExperts)
