"""quantize() called again on a quantized model: the new config is parsed once, and without a forward
loop activation quantizers take the amax of each tensor they see (none kept from the last config)."""

from __future__ import annotations

import copy

import torch

import quantlib as ql
from quantlib.config import QuantizeConfig

INT8_PER_TENSOR_WEIGHTS = {
    "quant_cfg": {"*weight_quantizer": {"num_bits": 8, "axis": None}, "*input_quantizer": {"num_bits": 8, "axis": None},
                  "default": {"enable": False}},
    "algorithm": "max",
}


def test_requantize_without_forward_loop_drops_the_previous_activation_amax(make_model, make_data, make_loop):
    model = ql.quantize(make_model("mlp"), ql.INT8_DEFAULT_CFG, make_loop(make_data("mlp", scale=50.0)))
    assert model.fc1.input_quantizer.amax is not None
    model = ql.quantize(model, INT8_PER_TENSOR_WEIGHTS, None)  # the same input format, another config
    assert model.fc1.input_quantizer.amax is None and model.fc2.input_quantizer.amax is None
    fresh = ql.quantize(make_model("mlp"), INT8_PER_TENSOR_WEIGHTS, None)
    x = make_data("mlp", seed=7)[0]
    with torch.no_grad():
        assert torch.equal(model(x), fresh(x))  # as if the first calibration never happened


def test_requantize_without_forward_loop_recalibrates_weights(make_model, make_data, make_loop):
    model = ql.quantize(make_model("mlp"), ql.INT8_DEFAULT_CFG, make_loop(make_data("mlp")))
    with torch.no_grad():
        model.fc1.weight.mul_(2.0)
    model = ql.quantize(model, INT8_PER_TENSOR_WEIGHTS, None)
    assert torch.equal(model.fc1.weight_quantizer.amax, model.fc1.weight.detach().abs().amax())


def test_requantize_with_forward_loop_still_calibrates_activations(make_model, make_data, make_loop):
    model = ql.quantize(make_model("mlp"), ql.INT8_DEFAULT_CFG, None)
    data = make_data("mlp")
    model = ql.quantize(model, INT8_PER_TENSOR_WEIGHTS, make_loop(data))
    assert torch.equal(model.fc1.input_quantizer.amax, torch.stack([x.abs().amax() for x in data]).amax())


def test_quantize_parses_a_dict_config_once(make_model, monkeypatch):
    calls = []
    real = QuantizeConfig.from_any.__func__

    def counting(cls, cfg):
        calls.append(type(cfg).__name__)
        return real(cls, cfg)

    monkeypatch.setattr(QuantizeConfig, "from_any", classmethod(counting))
    ql.quantize(make_model("mlp"), copy.deepcopy(ql.INT8_DEFAULT_CFG), None)
    assert calls == ["dict"]


def test_set_quantizer_by_cfg_uses_a_parsed_config_as_is(make_model, monkeypatch):
    cfg = QuantizeConfig.from_any(ql.FP8_DEFAULT_CFG)
    monkeypatch.setattr(QuantizeConfig, "from_any", classmethod(lambda cls, c: (_ for _ in ()).throw(AssertionError("parsed again"))))
    model = ql.convert(make_model("mlp"))
    ql.set_quantizer_by_cfg(model, cfg)
    assert model.fc1.weight_quantizer.num_bits == (4, 3)
