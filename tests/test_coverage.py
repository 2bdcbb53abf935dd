"""quantize() says which weights stayed unquantized without the config asking (quantlib/coverage.py)."""

from __future__ import annotations

import logging

import torch
from torch import nn

import quantlib as ql


class Bilinear(nn.Module):
    """A layer with a 2-D weight and no quantized class."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(16, 16))

    def forward(self, x):
        return x @ self.weight


def model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Embedding(10, 16), nn.Linear(16, 16), nn.LayerNorm(16), Bilinear(), nn.Linear(16, 8))


def test_unregistered_layer_with_a_2d_weight_is_reported_with_its_share(caplog):
    with caplog.at_level(logging.WARNING, logger="quantlib"):
        m = ql.quantize(model(), ql.INT8_WEIGHT_ONLY_CFG)
    cov = m.quant_coverage
    assert cov.total == 16 * 16 + 16 * 16 + 8 * 16  # embedding and norm not counted
    assert cov.quantized == 16 * 16 + 8 * 16
    assert cov.silent == {"3": 256} and cov.silent_share == 256 / 640
    assert "40.0% of the weight elements (256 of 640)" in caplog.text and "['3']" in caplog.text
    assert ql.weight_coverage(m) == cov


def test_config_that_enables_no_quantizer_warns(caplog):
    with caplog.at_level(logging.WARNING, logger="quantlib"):
        m = ql.quantize(model(), {"quant_cfg": {"*wieght_quantizer": {"num_bits": 8, "axis": 0}, "default": {"enable": False}},
                                  "algorithm": "max"})
    assert m.quant_coverage.enabled_quantizers == 0 and m.quant_coverage.unmatched_patterns == ["*wieght_quantizer"]
    assert "enables no quantizer" in caplog.text and "*wieght_quantizer" in caplog.text


def test_chain_rule_with_its_first_member_off_still_counts_as_enabling():
    chain = [{"num_bits": 8, "axis": 0, "enable": False}, {"num_bits": 8, "axis": 0}]
    m = ql.quantize(model(), {"quant_cfg": {"*wieght_quantizer": chain, "default": {"enable": False}}, "algorithm": "max"})
    assert m.quant_coverage.unmatched_patterns == ["*wieght_quantizer"]


def test_layers_disabled_by_name_are_a_choice_not_silent(caplog):
    cfg = {"quant_cfg": {"*weight_quantizer": {"num_bits": 8, "axis": 0}, "*4.weight_quantizer": {"enable": False},
                         "3.*": {"enable": False}, "default": {"enable": False}}, "algorithm": "max"}
    with caplog.at_level(logging.WARNING, logger="quantlib"):
        m = ql.quantize(model(), cfg)
    assert m.quant_coverage.silent == {} and m.quant_coverage.disabled == {"3": 256, "4": 128}
    assert "unquantized" not in caplog.text


def test_fully_quantized_model_logs_nothing(caplog):
    with caplog.at_level(logging.WARNING, logger="quantlib"):
        m = ql.quantize(nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 8)), ql.FP8_DEFAULT_CFG, lambda m: m(torch.randn(4, 16)))
    assert caplog.text == "" and m.quant_coverage.unquantized_share == 0.0
