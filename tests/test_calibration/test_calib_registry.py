"""The ``algorithm`` field: ModelOpt's name and dict forms, typed fields refused by name, one runner each."""

from __future__ import annotations

import pytest

import quantlib as ql
from quantlib import calib_config
from quantlib.calib import registry
from quantlib.config import ConfigError, QuantizeConfig


def _cfg(algorithm) -> QuantizeConfig:
    return QuantizeConfig.from_any({"quant_cfg": {}, "algorithm": algorithm})


def test_max_is_the_default():
    cfg = QuantizeConfig.from_any({"quant_cfg": {}})
    assert cfg.algorithm_name == "max" and isinstance(cfg.algorithm_config, calib_config.MaxConfig)


@pytest.mark.parametrize("method", sorted(calib_config.ALGORITHMS))
def test_name_and_dict_forms_give_the_same_config(method):
    assert _cfg(method).algorithm_config == _cfg({"method": method}).algorithm_config
    assert _cfg(method).algorithm_name == method


@pytest.mark.parametrize("method", sorted(calib_config.ALGORITHMS))
def test_every_declared_method_has_a_runner(method):
    assert callable(registry.runner(method))


def test_none_and_method_none_mean_no_calibration():
    assert _cfg(None).algorithm_config is None
    assert _cfg({"method": None}).algorithm_config is None


def test_to_dict_round_trips_a_typed_config():
    cfg = QuantizeConfig([], calib_config.MaxConfig(distributed_sync=False))
    back = QuantizeConfig.from_any(cfg.to_dict())
    assert back.algorithm_config == calib_config.MaxConfig(distributed_sync=False)


BAD = {
    "unknown_method": ("local_hessian", ["algorithm", "'local_hessian'"]),
    "method_not_a_string": ({"method": 3}, ["algorithm", "3"]),
    "not_a_dict": (["max"], ["algorithm", "['max']"]),
    "dict_without_method": ({"distributed_sync": True}, ["'method'"]),
    "unknown_field": ({"method": "max", "alpha": 0.5}, ["'max'", "unknown field 'alpha'"]),
    "ill_typed_bool": ({"method": "max", "distributed_sync": 1}, ["'max'", "distributed_sync", "bool", "1"]),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_invalid_algorithm_is_refused_naming_the_key(case):
    value, expected = BAD[case]
    with pytest.raises(ConfigError) as err:
        _cfg(value)
    for text in expected:
        assert text in str(err.value), f"{case}: {text!r} not in {err.value}"


def test_calibrate_refuses_a_bad_field_before_touching_the_model():
    import torch

    model = ql.quantize(torch.nn.Sequential(torch.nn.Linear(4, 4)), ql.INT8_DEFAULT_CFG, None)
    before = model[0].weight_quantizer.amax.clone()
    with pytest.raises(ConfigError, match="unknown field 'step'"):
        ql.calibrate(model, {"method": "max", "step": 1})
    assert torch.equal(model[0].weight_quantizer.amax, before)


def test_distributed_sync_false_is_accepted():
    assert _cfg({"method": "max", "distributed_sync": False}).algorithm_config.distributed_sync is False


@pytest.mark.parametrize("built", [calib_config.AwqLiteConfig(alpha_step=5.0),
                                   calib_config.MseConfig(start_multiplier=2.0, stop_multiplier=1.0)])  # fmt: skip
def test_a_directly_built_config_is_range_checked_too(built):
    with pytest.raises(ConfigError, match=built.method):
        QuantizeConfig([], built)
