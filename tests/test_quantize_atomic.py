"""A failed quantize() leaves the model exactly as it was (module classes, parameter objects, state_dict,
quantizer configs), whether it fails on the config, on a weight the config does not fit, in calibration
or in the user's forward loop; its errors name the quantizer, and so do errors that kernels raise in a
quantizer's forward."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import quantlib as ql
from quantlib import CalibrationError, ConfigError, TensorQuantizer
from quantlib.model_quant import iter_leaf_quantizers


def snapshot(model: nn.Module) -> dict:
    return {
        "modules": [(n, type(m), id(m)) for n, m in model.named_modules()],
        "params": [(n, id(p)) for n, p in model.named_parameters()],
        "state": {k: v.clone() for k, v in model.state_dict().items()},
        "quantizers": [(n, q.attrs.to_dict(), q.is_enabled, q._if_quant, q._if_calib) for n, q in iter_leaf_quantizers(model)],
        "attrs": sorted(model.__dict__),
    }


def assert_as_before(model: nn.Module, before: dict) -> None:
    after = snapshot(model)
    for key in ("modules", "params", "quantizers", "attrs"):
        assert after[key] == before[key], key
    assert list(after["state"]) == list(before["state"])
    assert all(torch.equal(after["state"][k], before["state"][k]) for k in after["state"])


def weights_cfg(**attrs) -> dict:
    return {"quant_cfg": {"*weight_quantizer": {"num_bits": 8, **attrs}, "*input_quantizer": {"enable": False}}, "algorithm": "max"}


@pytest.mark.parametrize("algorithm", ["max", None])
def test_axis_out_of_range_for_the_weight_leaves_the_model_unconverted(algorithm, make_model, make_data, make_loop):
    model = make_model("mlp")
    before = snapshot(model)
    cfg = {**weights_cfg(axis=3), "algorithm": algorithm}
    with pytest.raises(ConfigError, match=r"fc1\.weight_quantizer: axis=\(3,\) does not fit a tensor of shape \(48, 64\)"):
        ql.quantize(model, cfg, make_loop(make_data("mlp")))
    assert_as_before(model, before)


def test_empty_list_as_a_quantizer_config_is_refused_before_conversion(make_model):
    model = make_model("mlp")
    before = snapshot(model)
    with pytest.raises(ConfigError, match=r"quant_cfg\['\*weight_quantizer'\] = \[\]"):
        ql.quantize(model, {"quant_cfg": {"*weight_quantizer": []}, "algorithm": "max"})
    with pytest.raises(ConfigError, match=r"quant_cfg\[0\] \('\*weight_quantizer'\): 'cfg' = \[\]"):
        ql.quantize(model, {"quant_cfg": [{"quantizer_name": "*weight_quantizer", "cfg": []}]})
    with pytest.raises(ConfigError, match="must be a dict, got list"):
        ql.quantize(model, [])
    assert_as_before(model, before)


@pytest.mark.parametrize("key, value", [("quantizer_name", 3), ("quantizer_name", None), ("module_class", 7)])
def test_non_string_pattern_is_refused_before_conversion(key, value, make_model):
    model = make_model("mlp")
    before = snapshot(model)
    entry = {"quantizer_name": "*", "enable": False, key: value}
    with pytest.raises(ConfigError, match=rf"quant_cfg\[0\]: '{key}' must be a string, got {value}"):
        ql.quantize(model, {"quant_cfg": [entry]})
    assert_as_before(model, before)


def test_error_in_the_forward_loop_leaves_the_model_unconverted(make_model, make_data):
    model = make_model("mlp")
    before = snapshot(model)

    def loop(m):
        m(make_data("mlp", 1)[0])
        raise RuntimeError("bad batch")

    with pytest.raises(RuntimeError, match="bad batch"):
        ql.quantize(model, ql.INT8_DEFAULT_CFG, loop)
    assert_as_before(model, before)
    assert not model._forward_hooks  # the calibration progress hook is gone too


def test_keyboard_interrupt_in_calibration_leaves_the_model_unconverted(make_model):
    model = make_model("mlp")
    before = snapshot(model)

    def loop(m):
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        ql.quantize(model, ql.FP8_DEFAULT_CFG, loop)
    assert_as_before(model, before)


def test_nan_activations_leave_the_model_unconverted(make_model):
    model = make_model("mlp")
    before = snapshot(model)
    with pytest.raises(CalibrationError, match=r"fc1\.input_quantizer: calibration saw NaN"):
        ql.quantize(model, ql.INT8_DEFAULT_CFG, lambda m: m(torch.full((2, 64), float("nan"))))
    assert_as_before(model, before)


def test_failed_requantize_keeps_the_previous_quantization(make_model, make_data, make_loop):
    model = ql.quantize(make_model("mlp"), ql.INT8_DEFAULT_CFG, make_loop(make_data("mlp")))
    before = snapshot(model)
    x = make_data("mlp", 1, seed=11)[0]
    with torch.no_grad():
        out = model(x)

    def loop(m):
        m(x)
        raise RuntimeError("out of memory")

    with pytest.raises(RuntimeError, match="out of memory"):
        ql.quantize(model, ql.W4A8_AWQ_BETA_CFG, loop)  # rebuilds weight quantizers, recalibrates, then fails
    assert_as_before(model, before)
    with torch.no_grad():
        assert torch.equal(model(x), out)
    assert ql.model_quant.applied_config(model) == ql.config.QuantizeConfig.from_any(ql.INT8_DEFAULT_CFG)


def test_hooks_registered_before_a_failed_quantize_still_remove(make_model):
    model = make_model("mlp")
    calls = []
    handle = model.fc1.register_forward_hook(lambda *a: calls.append(1))
    with pytest.raises(ConfigError):
        ql.quantize(model, weights_cfg(axis=3))
    handle.remove()
    model(torch.randn(2, 64))
    assert calls == []


def test_successful_quantize_is_unchanged_by_the_rollback_guard(make_model, make_data, make_loop):
    model = make_model("mlp")
    quantized = ql.quantize(model, ql.INT8_DEFAULT_CFG, make_loop(make_data("mlp")))
    assert type(quantized.fc1).__name__ == "QuantLinear" and quantized.fc1.input_quantizer.amax is not None


# ------------------------------------------------------------------------------------ naming


def test_float64_input_error_names_the_quantizer(make_model, make_data, make_loop):
    model = ql.quantize(make_model("mlp"), ql.INT8_DEFAULT_CFG, make_loop(make_data("mlp")))
    with pytest.raises(TypeError, match=r"^fc1\.input_quantizer: fake_quant\(int\): input must be float32"):
        model(torch.randn(2, 64, dtype=torch.float64))


def test_static_amax_of_the_wrong_shape_names_the_quantizer(make_model, make_data, make_loop):
    model = ql.quantize(make_model("mlp"), ql.INT8_DEFAULT_CFG, make_loop(make_data("mlp")))
    model.fc2.input_quantizer.amax = torch.ones(3)
    with pytest.raises(ValueError, match=r"^fc2\.input_quantizer: amax of shape \(3,\) does not broadcast"):
        model(torch.randn(2, 64))


def test_weight_quantizer_member_error_names_the_member(make_model, make_data, make_loop):
    model = ql.quantize(make_model("mlp"), ql.W4A8_AWQ_BETA_CFG, make_loop(make_data("mlp")))
    model.fc1.weight_quantizer[1].amax = torch.ones(5)
    with pytest.raises(ValueError, match=r"^fc1\.weight_quantizer\.1: "):
        model(torch.randn(2, 64))


def test_error_naming_keeps_the_type_and_the_cause():
    q = TensorQuantizer({"num_bits": 8})
    q._qname = "layer.input_quantizer"
    with pytest.raises(TypeError) as info:
        q(torch.randn(4, dtype=torch.float64))
    assert str(info.value).startswith("layer.input_quantizer: ") and isinstance(info.value.__cause__, TypeError)


def test_calibration_error_is_not_renamed_twice():
    q = TensorQuantizer({"num_bits": 8})
    q._qname = "layer.input_quantizer"
    with pytest.raises(CalibrationError, match=r"^layer\.input_quantizer: calibration saw Inf"):
        q.calibrate(torch.tensor([1.0, float("inf")]))


def test_weights_written_in_place_before_a_failure_are_reported(make_model, caplog):
    model = make_model("mlp")

    def loop(m):
        with torch.no_grad():
            m.fc2.weight.mul_(2.0)  # as an algorithm that folds scales into weights would
        raise RuntimeError("later failure")

    with pytest.raises(RuntimeError, match="later failure"):
        ql.quantize(model, ql.INT8_DEFAULT_CFG, loop)
    assert "quantize failed after writing 1 parameter(s) in place" in caplog.text and "fc2.weight" in caplog.text
