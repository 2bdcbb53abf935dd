"""The one field parser (quantlib/fields.py) and every config that reads through it: unknown keys and
ill-typed values raise ConfigError (a ValueError) naming the key and the value."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Optional, Union

import pytest

from quantlib.calib.sequential import SequentialOptions
from quantlib.calib_config import AlgorithmConfigError, parse_algorithm
from quantlib.config import QuantizeConfig, QuantizerAttributeConfig
from quantlib.fields import ConfigError, parse_fields


@dataclass
class _Fields:
    flag: bool = False
    count: int = 1
    ratio: float = 0.5
    name: Optional[str] = None
    path: Optional[Union[str, os.PathLike]] = None


def test_config_error_is_a_value_error_and_the_one_class():
    import quantlib.config

    assert issubclass(ConfigError, ValueError) and quantlib.config.ConfigError is ConfigError
    assert issubclass(AlgorithmConfigError, ConfigError)


def test_parse_fields_reads_typed_values():
    out = parse_fields(_Fields, {"flag": True, "count": 3, "ratio": 1, "name": None}, "x: ")
    assert out == {"flag": True, "count": 3, "ratio": 1.0, "name": None} and isinstance(out["ratio"], float)


BAD = {
    "unknown": ({"flga": True}, ["x: unknown key 'flga'", "(value True)", "known: ['count', 'flag', 'name', 'path', 'ratio']"]),
    "bool_as_int": ({"count": True}, ["x: count must be an int", "got True"]),
    "string_as_bool": ({"flag": "no"}, ["flag must be a bool", "got 'no'"]),
    "optional_str": ({"name": 3}, ["name must be a str or None", "got 3"]),
    "union": ({"path": 1.5}, ["path must be a str or PathLike or None", "got 1.5"]),
    "not_a_dict": (["flag"], ["x: expected a dict", "['flag']"]),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_parse_fields_names_the_key_and_the_value(case):
    value, texts = BAD[case]
    with pytest.raises(ConfigError) as err:
        parse_fields(_Fields, value, "x: ")
    for text in texts:
        assert text in str(err.value), (case, str(err.value))


# every config that reads a dict: (what raises, texts the message must contain)
CONFIGS = {
    "attribute_unknown": (lambda: QuantizerAttributeConfig.from_dict({"num_bitz": 4}), ["unknown quantizer attribute 'num_bitz'",
                                                                                        "(value 4)"]),
    "attribute_value": (lambda: QuantizerAttributeConfig.from_dict({"enable": "no"}), ["enable", "'no'"]),
    "quantize_unknown": (lambda: QuantizeConfig.from_any({"quant_cfg": {}, "algoritm": "max"}), ["unknown quantize config key 'algoritm'",
                                                                                                 "(value 'max')"]),
    "quantize_value": (lambda: QuantizeConfig.from_any({"quant_cfg": {}, "expert_input_policy": "drop"}),
                       ["expert_input_policy", "'drop'"]),
    "algorithm_unknown": (lambda: parse_algorithm({"method": "mse", "step": 0.1}), ["algorithm 'mse': unknown field 'step'",
                                                                                    "(value 0.1)"]),
    "algorithm_value": (lambda: parse_algorithm({"method": "mse", "step_size": "0.1"}), ["algorithm 'mse': step_size must be a float",
                                                                                         "'0.1'"]),
    "sequential_unknown": (lambda: SequentialOptions.from_any({"layer": "model.layers"}), ["unknown option 'layer'",
                                                                                           "(value 'model.layers')"]),
    "sequential_value": (lambda: SequentialOptions.from_any({"layers": 3}), ["layers must be a str or None", "got 3"]),
    "sequential_device": (lambda: SequentialOptions.from_any({"device": 0.5}), ["device must be a str or device or None", "got 0.5"]),
    "sequential_kind": (lambda: SequentialOptions.from_any("yes"), ["sequential must be True, a dict or SequentialOptions", "'yes'"]),
}


@pytest.mark.parametrize("case", sorted(CONFIGS))
def test_every_config_raises_config_error_naming_key_and_value(case):
    fn, texts = CONFIGS[case]
    with pytest.raises(ConfigError) as err:
        fn()
    for text in texts:
        assert text in str(err.value), (case, str(err.value))


def test_sequential_options_take_paths(tmp_path):
    opts = SequentialOptions.from_any({"resume_file": tmp_path / "r.pt", "device": "cpu", "layers": "model.layers"})
    assert opts.resume_file == tmp_path / "r.pt" and opts.layers == "model.layers"
