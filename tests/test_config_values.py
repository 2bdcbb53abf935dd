"""Config values that used to be accepted and then broke (NaN, zeros, a string read as True, a raw
TypeError): every field of QuantizerAttributeConfig and QuantizeConfig, each with its bad values, must
raise ConfigError naming the key and the value."""

from __future__ import annotations

import copy
import math
from dataclasses import fields

import pytest
import torch

from quantlib.config import MAX_EPS, ConfigError, QuantizeConfig, QuantizerAttributeConfig
from quantlib.nn import TensorQuantizer

FP8_BLOCK = {"num_bits": (4, 3), "block_sizes": {-1: 128, "type": "dynamic"}}

# field -> [(case name, attribute dict, texts the message must contain)]
BAD_ATTRS: dict[str, list[tuple[str, dict, list[str]]]] = {
    "enable": [("enable_string", {"enable": "no"}, ["enable", "'no'"]), ("enable_int", {"enable": 0}, ["enable", "0"])],
    "num_bits": [
        ("num_bits_1_signed", {"num_bits": 1}, ["num_bits=1", "signed"]),
        ("num_bits_0", {"num_bits": 0}, ["num_bits", "0"]),
        ("num_bits_17", {"num_bits": 17}, ["num_bits", "17"]),
        ("num_bits_e4m3_string", {"num_bits": "e4m3"}, ["num_bits", "'e4m3'"]),
        ("num_bits_float_pair", {"num_bits": (4.0, 3.0)}, ["num_bits", "(4.0, 3.0)"]),
    ],
    "axis": [
        ("axis_empty_tuple", {"axis": ()}, ["axis=()", "None"]),
        ("axis_repeated", {"axis": (0, 0)}, ["axis=(0, 0)", "twice"]),
        ("axis_bool", {"axis": True}, ["axis", "True"]),
    ],
    "block_sizes": [
        ("block_sizes_list", {"num_bits": 4, "block_sizes": [128]}, ["block_sizes", "[128]"]),
        ("block_sizes_int", {"num_bits": 4, "block_sizes": 128}, ["block_sizes", "128"]),
        ("block_sizes_string", {"num_bits": 4, "block_sizes": "128"}, ["block_sizes", "'128'"]),
        ("block_size_negative", {"num_bits": 4, "block_sizes": {-1: -16}}, ["block_sizes[-1]", "-16"]),
        ("block_size_float", {"num_bits": 4, "block_sizes": {-1: 16.0}}, ["block_sizes[-1]", "16.0"]),
    ],
    "unsigned": [("unsigned_string", {"unsigned": "False"}, ["unsigned", "'False'"])],
    "narrow_range": [("narrow_range_string", {"narrow_range": "no"}, ["narrow_range", "'no'"])],
    "fake_quant": [("fake_quant_int", {"fake_quant": 1}, ["fake_quant", "1"])],
    "calibrator": [("calibrator_int", {"calibrator": 1}, ["calibrator", "1"]), ("calibrator_histogram", {"calibrator": "histogram"},
                                                                                ["calibrator", "'histogram'"])],
    "learn_amax": [("learn_amax_string", {"learn_amax": "no"}, ["learn_amax", "'no'"])],
    "type": [("type_capitalised", {"type": "Dynamic"}, ["type", "'Dynamic'"]), ("type_bool", {"type": True}, ["type", "True"])],
    "eps": [
        ("eps_inf", dict(FP8_BLOCK, eps=math.inf), ["eps", "inf"]),
        ("eps_1e30", dict(FP8_BLOCK, eps=1e30), ["eps", "1e+30"]),
        ("eps_nan", dict(FP8_BLOCK, eps=math.nan), ["eps", "nan"]),
        ("eps_above_max", dict(FP8_BLOCK, eps=2.0), ["eps", "2.0"]),
        ("eps_string", dict(FP8_BLOCK, eps="1e-10"), ["eps", "'1e-10'"]),
        ("eps_subnormal_scale", dict(FP8_BLOCK, eps=1e-40), ["eps", "1e-40"]),
    ],
    "pow2_scale": [("pow2_scale_string", {"pow2_scale": "yes"}, ["pow2_scale", "'yes'"])],
    "pass_through_bwd": [("pass_through_bwd_int", {"pass_through_bwd": 1}, ["pass_through_bwd", "1"])],
    "rounding": [("rounding_int", {"rounding": 1}, ["rounding", "1"]), ("rounding_list", {"rounding": ["rceil"]},
                                                                        ["rounding", "['rceil']"])],
    "backend": [("backend_int", {"backend": 1}, ["backend", "1"]), ("backend_list", {"backend": ["cpu"]}, ["backend", "['cpu']"])],
    "bias": [
        ("bias_string", {"num_bits": (4, 3), "bias": "mean"}, ["bias", "'mean'"]),
        ("bias_string_axis", {"num_bits": (4, 3), "bias": {"-2": None}}, ["bias", "'-2'"]),
        ("bias_float_axis", {"num_bits": (4, 3), "bias": {-2.0: None}}, ["bias", "-2.0"]),
        ("bias_type_none", {"num_bits": (4, 3), "bias": {-2: None, "type": None}}, ["bias['type']", "None"]),
    ],
}


def _cases():
    return [pytest.param(attrs, texts, id=name) for cases in BAD_ATTRS.values() for name, attrs, texts in cases]


@pytest.mark.parametrize("attrs, texts", _cases())
def test_bad_attribute_value_raises_config_error_naming_key_and_value(attrs, texts):
    with pytest.raises(ConfigError) as err:
        QuantizerAttributeConfig.from_dict(copy.deepcopy(attrs))
    for text in texts:
        assert text in str(err.value), f"{text!r} not in {str(err.value)!r}"


def test_every_attribute_field_has_bad_values_in_the_table():
    """A new field must come with its bad values here."""
    assert set(BAD_ATTRS) == {f.name for f in fields(QuantizerAttributeConfig)}


def test_num_bits_1_unsigned_is_a_valid_format():
    """One unsigned bit has codes {0, 1}: Q = 1, a real scale, no NaN."""
    q = TensorQuantizer({"num_bits": 1, "unsigned": True}, amax=torch.tensor(2.0))
    assert torch.equal(q(torch.tensor([0.4, 1.2, 3.0, -1.0])), torch.tensor([0.0, 2.0, 2.0, 0.0]))


def test_eps_at_its_bounds_gives_finite_outputs():
    x = torch.zeros(2, 128)
    x[1, :3] = torch.tensor([1e-3, -5.0, 0.25])
    for eps in (2.0**-110, MAX_EPS):
        out = TensorQuantizer(dict(FP8_BLOCK, eps=eps))(x)
        assert torch.isfinite(out).all() and torch.equal(out[0], x[0])
        assert out[1, 1] == -5.0


def test_backend_none_is_modelopts_default_backend():
    assert QuantizerAttributeConfig.from_dict({"backend": None}).backend == "auto"


# ------------------------------------------------------------------------------------ QuantizeConfig

OK_RULES = {"*weight_quantizer": {"num_bits": 8, "axis": 0}}

# (case, config, texts the message must contain)
BAD_CONFIGS = [
    ("sync_expert_weight_amax_string_no", {"quant_cfg": OK_RULES, "sync_expert_weight_amax": "no"}, ["sync_expert_weight_amax", "'no'"]),
    ("sync_expert_weight_amax_int", {"quant_cfg": OK_RULES, "sync_expert_weight_amax": 1}, ["sync_expert_weight_amax", "1"]),
    ("sync_expert_weight_amax_none", {"quant_cfg": OK_RULES, "sync_expert_weight_amax": None}, ["sync_expert_weight_amax", "None"]),
    ("expert_input_policy_unknown", {"quant_cfg": OK_RULES, "expert_input_policy": "max"}, ["expert_input_policy", "'max'"]),
    ("expert_input_policy_list", {"quant_cfg": OK_RULES, "expert_input_policy": ["skip"]}, ["expert_input_policy", "['skip']"]),
    ("algorithm_unknown", {"quant_cfg": OK_RULES, "algorithm": "maxx"}, ["algorithm", "'maxx'"]),
    ("algorithm_int", {"quant_cfg": OK_RULES, "algorithm": 1}, ["algorithm", "1"]),
    ("quant_cfg_string", {"quant_cfg": "*weight_quantizer"}, ["quant_cfg", "str"]),
    ("quant_cfg_key_int", {"quant_cfg": {0: {"enable": False}}}, ["quant_cfg", "0"]),
    ("enable_rule_string", {"quant_cfg": {"*": {"enable": "no"}}}, ["enable", "'no'"]),
    ("rule_value_int", {"quant_cfg": {"*": 8}}, ["quant_cfg['*']", "8"]),
    ("rule_empty_list_dict_form", {"quant_cfg": {"*weight_quantizer": []}}, ["quant_cfg['*weight_quantizer']", "empty"]),
    ("rule_empty_list_list_form", {"quant_cfg": [{"quantizer_name": "*weight_quantizer", "cfg": []}]}, ["*weight_quantizer", "empty"]),
    ("quantizer_name_int", {"quant_cfg": [{"quantizer_name": 5, "enable": False}]}, ["quantizer_name", "5"]),
    ("quantizer_name_none", {"quant_cfg": [{"quantizer_name": None, "enable": False}]}, ["quantizer_name", "None"]),
    ("module_class_int", {"quant_cfg": [{"quantizer_name": "*", "module_class": 3, "enable": False}]}, ["module_class", "3"]),
    ("list_enable_string", {"quant_cfg": [{"quantizer_name": "*", "enable": "no"}]}, ["enable", "'no'"]),
    ("list_item_unknown_key", {"quant_cfg": [{"quantizer_name": "*", "enabled": False}]}, ["enabled"]),
    ("top_level_unknown_key", {"quant_cfg": OK_RULES, "algoritm": "max"}, ["algoritm"]),
]

QUANTIZE_CONFIG_FIELDS_COVERED = {"quant_cfg", "algorithm", "expert_input_policy", "sync_expert_weight_amax"}


@pytest.mark.parametrize("cfg, texts", [pytest.param(c, t, id=n) for n, c, t in BAD_CONFIGS])
def test_bad_quantize_config_value_raises_config_error_naming_key_and_value(cfg, texts):
    with pytest.raises(ConfigError) as err:
        QuantizeConfig.from_any(copy.deepcopy(cfg))
    for text in texts:
        assert text in str(err.value), f"{text!r} not in {str(err.value)!r}"


def test_every_quantize_config_field_has_bad_values_in_the_table():
    assert QUANTIZE_CONFIG_FIELDS_COVERED == {f.name for f in fields(QuantizeConfig)}
    named = {k for _, cfg, _ in BAD_CONFIGS for k in cfg}
    assert QUANTIZE_CONFIG_FIELDS_COVERED <= named


def test_sync_expert_weight_amax_string_no_is_refused_when_built_directly():
    with pytest.raises(ConfigError, match="sync_expert_weight_amax must be a bool, got 'no'"):
        QuantizeConfig([], "max", "max_of_peers", "no")


def test_sync_expert_weight_amax_real_bools_are_kept():
    for value in (True, False):
        assert QuantizeConfig.from_any({"quant_cfg": OK_RULES, "sync_expert_weight_amax": value}).sync_expert_weight_amax is value
