"""Writes the frozen schema-2 golden checkpoint of tests/calib/test_calib_pre_quant_scale.py. Kept for
the record: ``v2_mlp.pt`` and ``v2_mlp_weights.pt`` were produced once by running it with quantlib at
schema 2 (commit 3e8afe8 of branch ``calib``, torch 2.13, CPU): ``PYTHONPATH=. python
tests/data/write_v2_golden.py``. Do not regenerate them for a new schema; add new golden files instead.

Unlike the schema-1 writer it calls quantlib's own ``save()``, since schema 2 is what that code wrote.
The model (``build()``): ``Linear(16, 32) -> ReLU -> Linear(32, 8)`` with

    fc1  weight: SequentialQuantizer [INT4 blocks of 16 (static), FP8 E4M3 per tensor]; input FP8 per tensor
    fc2  weight: INT8 per output channel; input INT8 per tensor
    outputs disabled
"""

from __future__ import annotations

import os

import torch
from torch import nn

HERE = os.path.dirname(os.path.abspath(__file__))

CONFIG = {
    "quant_cfg": {
        "default": {"enable": False},
        "fc1.weight_quantizer": [{"num_bits": 4, "block_sizes": {-1: 16, "type": "static"}}, {"num_bits": (4, 3), "axis": None}],
        "fc1.input_quantizer": {"num_bits": (4, 3), "axis": None},
        "fc2.weight_quantizer": {"num_bits": 8, "axis": 0},
        "fc2.input_quantizer": {"num_bits": 8, "axis": None},
    },
    "algorithm": "max",
}


class MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(16, 32)
        self.act = nn.ReLU()
        self.fc2 = nn.Linear(32, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


def build() -> MLP:
    """The golden model with the saved weights (``v2_mlp_weights.pt``)."""
    model = MLP()
    model.load_state_dict(torch.load(os.path.join(HERE, "v2_mlp_weights.pt"), weights_only=True))
    return model.eval()


def main() -> None:
    import quantlib as ql

    g = torch.Generator().manual_seed(20261203)
    model = MLP().eval()
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g))
    torch.save(model.state_dict(), os.path.join(HERE, "v2_mlp_weights.pt"))
    data = [torch.randn(4, 16, generator=g) for _ in range(3)]
    ql.quantize(model, CONFIG, lambda m: [m(x) for x in data])
    ql.save(model, os.path.join(HERE, "v2_mlp.pt"))


if __name__ == "__main__":
    main()
