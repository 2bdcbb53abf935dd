"""quantlib.config: attribute validation, the dict and list forms of quant_cfg, class-scoped rules, presets."""

from __future__ import annotations

import copy
import io

import pytest
import torch

import quantlib as ql
from quantlib.config import ConfigError, QuantizeConfig, QuantizerAttributeConfig
from quantlib.formats import Kind
from quantlib.model_quant import iter_quantizers

NVFP4_BLOCKS = {-1: 16, "type": "dynamic", "scale_bits": (4, 3)}
MX_BLOCKS = {-1: 32, "type": "dynamic", "scale_bits": (8, 0)}


# ------------------------------------------------------------------------------------ attribute configs

# (attribute dict, text the message must contain: the offending key, and the offending value)
INVALID_ATTRS = {
    "unknown_key": ({"num_bits": 8, "nmu_bits": 4}, ["nmu_bits", "4"]),
    "unknown_key_typo_of_axis": ({"axes": 0}, ["axes", "0"]),
    "axis_with_block_sizes": ({"num_bits": 4, "axis": 0, "block_sizes": {-1: 128}}, ["axis", "block_sizes", "128"]),
    "axis_with_per_token": ({"num_bits": (4, 3), "axis": 0, "block_sizes": {-1: None, "type": "dynamic"}}, ["axis", "(0,)"]),
    "e2m1_without_blocks": ({"num_bits": (2, 1)}, ["num_bits", "(2, 1)", "block_sizes"]),
    "e2m1_static_blocks_of_64": ({"num_bits": (2, 1), "block_sizes": {-1: 64, "type": "static", "scale_bits": (4, 3)}},
                                 ["block_sizes", "64"]),
    "e2m1_2d_blocks_with_e4m3_scales": ({"num_bits": (2, 1), "block_sizes": {-1: 16, -2: 16, "type": "dynamic", "scale_bits": (4, 3)}},
                                        ["block_sizes", "-2"]),
    "e2m1_blocks_without_scale_bits": ({"num_bits": (2, 1), "block_sizes": {-1: 16, "type": "dynamic"}}, ["block_sizes", "16"]),
    "mx_static": ({"num_bits": (4, 3), "block_sizes": {-1: 32, "type": "static", "scale_bits": (8, 0)}}, ["block_sizes", "static"]),
    "mx_type_missing_means_static": ({"num_bits": (4, 3), "block_sizes": {-1: 32, "scale_bits": (8, 0)}}, ["block_sizes", "(8, 0)"]),
    "mx_block_16": ({"num_bits": (2, 1), "block_sizes": {-1: 16, "type": "dynamic", "scale_bits": (8, 0)}}, ["block_sizes", "16"]),
    "mx_e5m2": ({"num_bits": (5, 2), "block_sizes": MX_BLOCKS}, ["(5, 2)"]),
    "scale_bits_with_int": ({"num_bits": 4, "block_sizes": {-1: 16, "type": "dynamic", "scale_bits": (4, 3)}},
                            ["scale_bits", "(4, 3)", "num_bits=4"]),
    "e4m3_scales_with_e4m3_elements": ({"num_bits": (4, 3), "block_sizes": {-1: 16, "type": "dynamic", "scale_bits": (4, 3)}},
                                       ["scale_bits", "(4, 3)"]),
    "scale_bits_e5m2": ({"num_bits": (2, 1), "block_sizes": {-1: 16, "type": "dynamic", "scale_bits": (5, 2)}}, ["scale_bits", "(5, 2)"]),
    "num_bits_zero": ({"num_bits": 0}, ["num_bits", "0"]),
    "num_bits_17": ({"num_bits": 17}, ["num_bits", "17"]),
    "num_bits_negative": ({"num_bits": -8}, ["num_bits", "-8"]),
    "num_bits_string": ({"num_bits": "8"}, ["num_bits", "'8'"]),
    "num_bits_float": ({"num_bits": 8.0}, ["num_bits", "8.0"]),
    "num_bits_bool": ({"num_bits": True}, ["num_bits", "True"]),
    "num_bits_triple": ({"num_bits": (4, 3, 1)}, ["num_bits", "(4, 3, 1)"]),
    "num_bits_unknown_float": ({"num_bits": (3, 4)}, ["num_bits", "(3, 4)"]),
    "axis_string": ({"axis": "0"}, ["axis", "'0'"]),
    "axis_float": ({"axis": 0.0}, ["axis", "0.0"]),
    "block_axis_positive": ({"num_bits": 4, "block_sizes": {1: 16}}, ["block_sizes", "1"]),
    "block_axis_minus_3": ({"num_bits": 4, "block_sizes": {-3: 16}}, ["block_sizes", "-3"]),
    "block_size_zero": ({"num_bits": 4, "block_sizes": {-1: 0}}, ["block_sizes[-1]", "0"]),
    "block_size_bool": ({"num_bits": 4, "block_sizes": {-1: True}}, ["block_sizes[-1]", "True"]),
    "block_unknown_key": ({"num_bits": 4, "block_sizes": {-1: 16, "typ": "dynamic"}}, ["typ", "dynamic"]),
    "block_type_unknown": ({"num_bits": 4, "block_sizes": {-1: 16, "type": "Dynamic"}}, ["type", "'Dynamic'"]),
    "block_scale_block_sizes": ({"num_bits": (2, 1), "block_sizes": dict(NVFP4_BLOCKS, scale_block_sizes={-1: 128})},
                                ["scale_block_sizes", "128"]),
    "per_row_static": ({"num_bits": (4, 3), "block_sizes": {-1: None}}, ["block_sizes", "dynamic"]),
    "unsigned_float": ({"num_bits": (4, 3), "unsigned": True}, ["unsigned", "(4, 3)"]),
    "enable_not_bool": ({"enable": "yes"}, ["enable", "'yes'"]),
    "narrow_range_not_bool": ({"narrow_range": 1}, ["narrow_range", "1"]),
    "calibrator_unknown": ({"calibrator": "histogram"}, ["calibrator", "'histogram'"]),
    "rounding_unknown": ({"num_bits": (4, 3), "block_sizes": MX_BLOCKS, "rounding": "up"}, ["rounding", "'up'"]),
    "eps_negative": ({"eps": -1.0}, ["eps", "-1.0"]),
    "eps_zero": ({"eps": 0.0}, ["eps", "0.0"]),
    "backend_unknown": ({"backend": "gpu"}, ["backend", "'gpu'"]),
    "fake_quant_false": ({"fake_quant": False}, ["fake_quant", "False"]),
    "learn_amax": ({"learn_amax": True}, ["learn_amax", "True"]),
}


@pytest.mark.parametrize("case", sorted(INVALID_ATTRS))
def test_invalid_attribute_config_names_key_and_value(case):
    attrs, expected = INVALID_ATTRS[case]
    with pytest.raises(ConfigError) as err:
        QuantizerAttributeConfig.from_dict(copy.deepcopy(attrs))
    for text in expected:
        assert text in str(err.value), f"{case}: {text!r} not in {str(err.value)!r}"


@pytest.mark.parametrize("case", ["unknown_key", "axis_with_block_sizes", "e2m1_without_blocks", "mx_static", "scale_bits_with_int",
                                  "num_bits_17"])
@pytest.mark.parametrize("form", ["dict", "list", "list_of_cfgs"])
def test_invalid_attribute_in_quantize_config_names_pattern(case, form):
    attrs, expected = INVALID_ATTRS[case]
    attrs = copy.deepcopy(attrs)
    if form == "dict":
        cfg = {"quant_cfg": {"*weight_quantizer": attrs, "default": {"enable": False}}}
    elif form == "list":
        cfg = {"quant_cfg": [{"quantizer_name": "*", "enable": False}, {"quantizer_name": "*weight_quantizer", "cfg": attrs}]}
    else:
        cfg = {"quant_cfg": [{"quantizer_name": "*weight_quantizer", "cfg": [{"num_bits": 4, "block_sizes": {-1: 128}}, attrs]}]}
    with pytest.raises(ConfigError) as err:
        QuantizeConfig.from_any(cfg)
    assert "*weight_quantizer" in str(err.value)
    for text in expected:
        assert text in str(err.value)


def test_invalid_config_raises_at_config_time_not_at_forward(make_model):
    """quantize() must refuse the config before it converts (and so changes) the model."""
    model = make_model("mlp")
    with pytest.raises(ConfigError, match="nmu_bits"):
        ql.quantize(model, {"quant_cfg": {"*weight_quantizer": {"nmu_bits": 4}}}, None)
    assert type(model.fc1) is torch.nn.Linear


def test_config_error_is_a_value_error():
    assert issubclass(ConfigError, ValueError)


@pytest.mark.parametrize("ignored", [{"effective_bits": 4.5}, {"trt_high_precision_dtype": "Half"}])
def test_modelopt_documented_keys_are_accepted_and_ignored(ignored):
    with_key = QuantizerAttributeConfig.from_dict(dict(num_bits=(2, 1), block_sizes=NVFP4_BLOCKS, **ignored))
    without = QuantizerAttributeConfig.from_dict(dict(num_bits=(2, 1), block_sizes=NVFP4_BLOCKS))
    assert with_key == without
    assert with_key.format_spec() == without.format_spec()
    assert set(ignored).isdisjoint(with_key.to_dict())


# (attribute dict, kind, block, dynamic, is_dynamic)
VALID_ATTRS = {
    "int8_per_tensor": ({"num_bits": 8}, Kind.INT, None, False, False),
    "int8_per_channel": ({"num_bits": 8, "axis": 0}, Kind.INT, None, False, False),
    "int4_block": ({"num_bits": 4, "block_sizes": {-1: 128}}, Kind.INT, (128,), False, False),
    "int4_dynamic_block": ({"num_bits": 4, "block_sizes": {-1: 64, "type": "dynamic"}}, Kind.INT, (64,), True, True),
    "fp8": ({"num_bits": (4, 3)}, Kind.FP8, None, False, False),
    "fp8_e5m2_per_channel": ({"num_bits": (5, 2), "axis": 0}, Kind.FP8, None, False, False),
    "fp8_per_token": ({"num_bits": (4, 3), "block_sizes": {-1: None, "type": "dynamic"}}, Kind.FP8, None, True, True),
    "fp8_2d_block": ({"num_bits": (4, 3), "block_sizes": {-1: 128, -2: 128}}, Kind.FP8_BLOCK, (128, 128), False, False),
    "fp8_1x128_dynamic": ({"num_bits": (4, 3), "block_sizes": {-1: 128, "type": "dynamic"}}, Kind.FP8_BLOCK, (128,), True, True),
    "mxfp8": ({"num_bits": (4, 3), "block_sizes": MX_BLOCKS}, Kind.MX, (32,), True, True),
    "mxfp4": ({"num_bits": (2, 1), "block_sizes": MX_BLOCKS}, Kind.MX, (32,), True, True),
    "nvfp4": ({"num_bits": (2, 1), "block_sizes": NVFP4_BLOCKS}, Kind.NVFP4, (16,), True, False),
}


@pytest.mark.parametrize("case", sorted(VALID_ATTRS))
def test_valid_attribute_config_resolves_to_one_format(case):
    attrs, kind, block, dynamic, is_dynamic = VALID_ATTRS[case]
    cfg = QuantizerAttributeConfig.from_dict(copy.deepcopy(attrs))
    spec = cfg.format_spec()
    assert (spec.kind, spec.block, spec.dynamic, cfg.is_dynamic) == (kind, block, dynamic, is_dynamic)


def test_axis_is_normalised_to_a_tuple():
    assert QuantizerAttributeConfig(axis=0).axis == (0,)
    assert QuantizerAttributeConfig(axis=[0, -1]).axis == (0, -1)
    assert QuantizerAttributeConfig(num_bits=[4, 3]).num_bits == (4, 3)


def test_attribute_config_to_dict_round_trips_through_weights_only_load():
    cfg = QuantizerAttributeConfig.from_dict({"num_bits": (2, 1), "block_sizes": NVFP4_BLOCKS, "effective_bits": 4.5})
    buf = io.BytesIO()
    torch.save(cfg.to_dict(), buf)
    buf.seek(0)
    back = QuantizerAttributeConfig.from_dict(torch.load(buf, weights_only=True))
    assert back == cfg and back.format_spec() == cfg.format_spec()


# ------------------------------------------------------------------------------------ QuantizeConfig

INVALID_QUANTIZE_CONFIGS = {
    "unknown_top_key": ({"quant_cfg": {}, "algorithm": "max", "algorithmn": "max"}, ["algorithmn"]),
    "missing_quant_cfg": ({"algorithm": "max"}, ["quant_cfg"]),
    "not_a_dict": (["*", {"enable": False}], ["list"]),
    "quant_cfg_string": ({"quant_cfg": "*"}, ["quant_cfg", "str"]),
    "algorithm_unknown": ({"quant_cfg": {}, "algorithm": "local_hessian"}, ["algorithm", "'local_hessian'"]),
    "algorithm_dict_unknown": ({"quant_cfg": {}, "algorithm": {"method": "svdquant"}}, ["algorithm", "'svdquant'"]),
    "algorithm_dict_without_method": ({"quant_cfg": {}, "algorithm": {"alpha": 0.5}}, ["method", "alpha"]),
    "expert_input_policy": ({"quant_cfg": {}, "expert_input_policy": "zero"}, ["expert_input_policy", "'zero'"]),
    "dict_value_not_dict": ({"quant_cfg": {"*weight_quantizer": 8}}, ["*weight_quantizer", "8"]),
    "dict_enable_not_bool": ({"quant_cfg": {"*lm_head*": {"enable": "no"}}}, ["*lm_head*", "enable", "'no'"]),
    "dict_key_not_string": ({"quant_cfg": {3: {"enable": False}}}, ["keys", "3"]),
    "list_item_without_name": ({"quant_cfg": [{"cfg": {"num_bits": 8}}]}, ["quant_cfg[0]", "quantizer_name"]),
    "list_item_unknown_key": ({"quant_cfg": [{"quantizer_name": "*", "enabled": False}]}, ["quant_cfg[0]", "enabled"]),
    "list_item_enable_not_bool": ({"quant_cfg": [{"quantizer_name": "*", "enable": 0}]}, ["quant_cfg[0]", "'*'", "enable", "0"]),
    "list_item_not_dict": ({"quant_cfg": ["*weight_quantizer"]}, ["quant_cfg[0]", "*weight_quantizer"]),
}


@pytest.mark.parametrize("case", sorted(INVALID_QUANTIZE_CONFIGS))
def test_invalid_quantize_config_names_key_and_value(case):
    cfg, expected = INVALID_QUANTIZE_CONFIGS[case]
    with pytest.raises(ConfigError) as err:
        QuantizeConfig.from_any(copy.deepcopy(cfg))
    for text in expected:
        assert text in str(err.value), f"{case}: {text!r} not in {str(err.value)!r}"


def _resolved(cfg, name: str, classes: tuple[str, ...] = ("Linear",)) -> tuple:
    """(num_bits, axis, enabled) the config gives quantizer ``name``; attrs None -> 'untouched'."""
    attrs, enable = QuantizeConfig.from_any(cfg).resolve(name, classes)
    if attrs is None:
        return ("untouched", enable)
    if isinstance(attrs, list):
        return (tuple(a.num_bits for a in attrs), enable if enable is not None else attrs[0].enable)
    return (attrs.num_bits, attrs.axis, enable if enable is not None else attrs.enable)


DEFAULT_RULE = {"num_bits": 4, "axis": None}
WEIGHT_RULE = {"num_bits": 8, "axis": 0}


@pytest.mark.parametrize("position", ["first", "middle", "last"])
def test_dict_form_default_applies_first_wherever_it_sits(position):
    rules = [("*weight_quantizer", WEIGHT_RULE), ("*fc2*", {"enable": False})]
    at = {"first": 0, "middle": 1, "last": 2}[position]
    rules.insert(at, ("default", DEFAULT_RULE))
    cfg = {"quant_cfg": dict(rules)}
    # "default" reaches every quantizer first; the patterns then win over it
    assert _resolved(cfg, "fc1.weight_quantizer") == (8, (0,), True)
    assert _resolved(cfg, "fc1.input_quantizer") == (4, None, True)
    assert _resolved(cfg, "fc1.output_quantizer") == (4, None, True)
    assert _resolved(cfg, "fc2.weight_quantizer") == (8, (0,), False)
    assert _resolved(cfg, "fc2.input_quantizer") == (4, None, False)


def test_dict_form_default_disable_then_patterns_enable():
    """The presets' shape: ``"default": {"enable": False}`` last, yet the weight/input rules win."""
    cfg = {"quant_cfg": {"*weight_quantizer": {"num_bits": 8, "axis": 0}, "*input_quantizer": {"num_bits": 8},
                         "default": {"enable": False}}}
    assert _resolved(cfg, "fc1.weight_quantizer") == (8, (0,), True)
    assert _resolved(cfg, "fc1.input_quantizer") == (8, None, True)
    assert _resolved(cfg, "fc1.output_quantizer") == ("untouched", False)


def test_dict_form_later_patterns_win():
    cfg = {"quant_cfg": {"*weight_quantizer": {"num_bits": 8, "axis": 0}, "*fc1.weight_quantizer": {"num_bits": 4, "axis": None}}}
    assert _resolved(cfg, "fc1.weight_quantizer") == (4, None, True)
    assert _resolved(cfg, "fc2.weight_quantizer") == (8, (0,), True)
    swapped = {"quant_cfg": dict(reversed(list(cfg["quant_cfg"].items())))}
    assert _resolved(swapped, "fc1.weight_quantizer") == (8, (0,), True)


def test_list_form_later_entries_win():
    cfg = {"quant_cfg": [{"quantizer_name": "*", "enable": False}, {"quantizer_name": "*weight_quantizer", "cfg": WEIGHT_RULE}]}
    assert _resolved(cfg, "fc1.weight_quantizer") == (8, (0,), True)
    assert _resolved(cfg, "fc1.input_quantizer") == ("untouched", False)
    reverse = {"quant_cfg": list(reversed(cfg["quant_cfg"]))}
    assert _resolved(reverse, "fc1.weight_quantizer") == (8, (0,), False)


def test_list_form_enable_in_same_entry_overrides_cfg_enable():
    cfg = {"quant_cfg": [{"quantizer_name": "*weight_quantizer", "cfg": dict(WEIGHT_RULE, enable=True), "enable": False}]}
    assert _resolved(cfg, "fc1.weight_quantizer") == (8, (0,), False)


def test_list_form_equals_dict_form_of_same_rules():
    dict_cfg = {"quant_cfg": {"*weight_quantizer": WEIGHT_RULE, "*input_quantizer": {"num_bits": (4, 3)}, "*fc2*": {"enable": False},
                              "default": {"enable": False}}}
    list_cfg = {
        "quant_cfg": [
            {"quantizer_name": "*", "enable": False},
            {"quantizer_name": "*weight_quantizer", "cfg": WEIGHT_RULE},
            {"quantizer_name": "*input_quantizer", "cfg": {"num_bits": (4, 3)}},
            {"quantizer_name": "*fc2*", "enable": False},
        ]
    }
    for name in ("fc1.weight_quantizer", "fc1.input_quantizer", "fc1.output_quantizer", "fc2.weight_quantizer", "fc2.input_quantizer"):
        assert _resolved(dict_cfg, name) == _resolved(list_cfg, name), name


def test_pattern_matches_the_full_name():
    cfg = {"quant_cfg": {"fc1.weight_quantizer": {"num_bits": 4}, "weight_quantizer": {"num_bits": 6}}}
    assert _resolved(cfg, "fc1.weight_quantizer") == (4, None, True)
    assert _resolved(cfg, "block.fc1.weight_quantizer") == ("untouched", None)


def test_list_cfg_builds_a_sequential_quantizer(make_model):
    model = ql.convert(make_model("mlp"))
    ql.set_quantizer_by_cfg(model, {"quant_cfg": [{"quantizer_name": "*weight_quantizer", "cfg": [{"num_bits": 4, "block_sizes": {-1: 128}},
                                                                                                  {"num_bits": (4, 3)}]}]})
    for lin in (model.fc1, model.fc2):
        q = lin.weight_quantizer
        assert isinstance(q, ql.SequentialQuantizer)
        assert [m.num_bits for m in q] == [4, (4, 3)]
        assert [m.block_sizes for m in q] == [{-1: 128}, None]
        assert isinstance(lin.input_quantizer, ql.TensorQuantizer)
    # the dict form means the same
    model2 = ql.convert(make_model("mlp"))
    ql.set_quantizer_by_cfg(model2, {"quant_cfg": {"*weight_quantizer": [{"num_bits": 4, "block_sizes": {-1: 128}}, {"num_bits": (4, 3)}]}})
    assert [m.num_bits for m in model2.fc2.weight_quantizer] == [4, (4, 3)]


def test_class_scoped_entries_parse_with_their_class():
    cfg = QuantizeConfig.from_any({"quant_cfg": {"nn.BatchNorm2d": {"*": {"enable": False}},
                                                 "nn.Conv2d": {"*input_quantizer": {"num_bits": 4}}}})
    assert [(e.pattern, e.module_class, e.enable) for e in cfg.quant_cfg] == [("*", "BatchNorm2d", False),
                                                                              ("*input_quantizer", "Conv2d", None)]
    assert cfg.quant_cfg[1].attrs.num_bits == 4
    # a class-scoped rule never reaches quantizers of other classes
    assert cfg.resolve("conv1.input_quantizer", ("Conv2d", "_ConvNd", "Module")) == (cfg.quant_cfg[1].attrs, None)
    assert cfg.resolve("head.input_quantizer", ("Linear", "Module")) == (None, None)


def test_class_scoped_list_form_parent_class():
    cfg = QuantizeConfig.from_any({"quant_cfg": [{"quantizer_name": "*", "parent_class": "nn.Conv2d", "enable": False}]})
    assert cfg.resolve("conv1.weight_quantizer", ("Conv2d",)) == (None, False)
    assert cfg.resolve("head.weight_quantizer", ("Linear",)) == (None, None)


def test_class_scoped_rules_on_a_model(make_model, make_data, make_loop):
    cfg = copy.deepcopy(ql.INT8_DEFAULT_CFG)
    cfg["quant_cfg"]["nn.Conv2d"] = {"*input_quantizer": {"enable": False}, "*weight_quantizer": {"num_bits": 4, "axis": 0}}
    model = ql.quantize(make_model("conv"), cfg, make_loop(make_data("conv")))
    assert not model.conv1.input_quantizer.is_enabled and not model.conv2.input_quantizer.is_enabled
    assert model.conv1.weight_quantizer.num_bits == 4 and model.conv2.weight_quantizer.num_bits == 4
    assert model.head.input_quantizer.is_enabled and model.head.weight_quantizer.num_bits == 8
    assert type(model.bn) is torch.nn.BatchNorm2d  # BatchNorm is not quantized; its rule is harmless


@pytest.mark.parametrize("name", sorted(ql.PRESETS))
def test_presets_parse_and_round_trip_through_to_dict(name):
    cfg = QuantizeConfig.from_any(ql.PRESETS[name])
    buf = io.BytesIO()
    torch.save(cfg.to_dict(), buf)
    buf.seek(0)
    back = QuantizeConfig.from_any(torch.load(buf, weights_only=True))
    for qname in ("fc1.weight_quantizer", "fc1.input_quantizer", "fc1.output_quantizer", "lm_head.weight_quantizer",
                  "router.input_quantizer"):
        assert back.resolve(qname, ("Linear",)) == cfg.resolve(qname, ("Linear",)), qname
    algorithm = ql.PRESETS[name]["algorithm"]  # None for MX, as in ModelOpt; a name or ModelOpt's {"method": ...}
    assert back.algorithm_name == cfg.algorithm_name == (algorithm["method"] if isinstance(algorithm, dict) else algorithm)
    assert back.algorithm_config == cfg.algorithm_config


# (preset, weight (kind, num_bits or element, axis, block, dynamic), input same or None for disabled)
PRESET_MEANINGS = {
    "INT8_DEFAULT_CFG": ((Kind.INT, 8, (0,), None, False), (Kind.INT, 8, None, None, False)),
    "INT8_WEIGHT_ONLY_CFG": ((Kind.INT, 8, (0,), None, False), None),
    "FP8_DEFAULT_CFG": ((Kind.FP8, (4, 3), None, None, False), (Kind.FP8, (4, 3), None, None, False)),
    "FP8_PER_CHANNEL_PER_TOKEN_CFG": ((Kind.FP8, (4, 3), (0,), None, False), (Kind.FP8, (4, 3), None, None, True)),
    "FP8_2D_BLOCKWISE_WEIGHT_ONLY_CFG": ((Kind.FP8_BLOCK, (4, 3), None, (128, 128), False), None),
    "FP8_BLOCKWISE_CFG": ((Kind.FP8_BLOCK, (4, 3), None, (128, 128), False), (Kind.FP8_BLOCK, (4, 3), None, (128,), True)),
    "INT4_BLOCKWISE_WEIGHT_ONLY_CFG": ((Kind.INT, 4, None, (128,), False), None),
    "NVFP4_DEFAULT_CFG": ((Kind.NVFP4, (2, 1), None, (16,), True), (Kind.NVFP4, (2, 1), None, (16,), True)),
    "MXFP8_DEFAULT_CFG": ((Kind.MX, (4, 3), None, (32,), True), (Kind.MX, (4, 3), None, (32,), True)),
    "MXFP4_DEFAULT_CFG": ((Kind.MX, (2, 1), None, (32,), True), (Kind.MX, (2, 1), None, (32,), True)),
}


def _meaning(attrs) -> tuple:
    s = attrs.format_spec()
    return (s.kind, s.num_bits if s.kind == Kind.INT else s.element, attrs.axis, s.block, s.dynamic)


@pytest.mark.parametrize("name", sorted(PRESET_MEANINGS))
def test_preset_meanings(name):
    weight, inp = PRESET_MEANINGS[name]
    cfg = QuantizeConfig.from_any(ql.PRESETS[name])
    wattrs, wen = cfg.resolve("layers.0.fc1.weight_quantizer", ("Linear",))
    assert _meaning(wattrs) == weight and wen is None and wattrs.enable
    iattrs, ien = cfg.resolve("layers.0.fc1.input_quantizer", ("Linear",))
    if inp is None:
        assert ien is False
    else:
        assert _meaning(iattrs) == inp and iattrs.enable and ien is None
    assert cfg.resolve("layers.0.fc1.output_quantizer", ("Linear",)) == (None, False)
    assert cfg.resolve("lm_head.weight_quantizer", ("Linear",))[1] is False
    assert cfg.resolve("bn.weight_quantizer", ("BatchNorm2d",))[1] is False


def test_w4a8_preset_is_int4_blocks_then_fp8():
    cfg = QuantizeConfig.from_any(ql.W4A8_AWQ_BETA_CFG)
    wattrs, _ = cfg.resolve("fc1.weight_quantizer", ("Linear",))
    assert [_meaning(a) for a in wattrs] == [(Kind.INT, 4, None, (128,), False), (Kind.FP8, (4, 3), None, None, False)]
    iattrs, _ = cfg.resolve("fc1.input_quantizer", ("Linear",))
    assert _meaning(iattrs) == (Kind.FP8, (4, 3), None, None, False)


def test_presets_are_not_mutated_by_quantize(make_model):
    before = copy.deepcopy(ql.PRESETS)
    for name in ("INT8_DEFAULT_CFG", "W4A8_AWQ_BETA_CFG", "NVFP4_DEFAULT_CFG"):
        ql.quantize(make_model("mlp"), ql.PRESETS[name], None)
    assert ql.PRESETS == before


def test_set_quantizer_by_cfg_names_every_leaf(make_model):
    model = ql.convert(make_model("mlp"))
    ql.set_quantizer_by_cfg(model, ql.W4A8_AWQ_BETA_CFG)
    names = [n for n, _, _, _ in iter_quantizers(model)]
    assert names == ["fc1.input_quantizer", "fc1.weight_quantizer", "fc1.output_quantizer", "fc2.input_quantizer", "fc2.weight_quantizer",
                     "fc2.output_quantizer"]
    assert [m._qname for m in model.fc2.weight_quantizer] == ["fc2.weight_quantizer.0", "fc2.weight_quantizer.1"]


def test_class_scoped_list_value_builds_a_sequential_rule():
    w4a8 = [{"num_bits": 4, "block_sizes": {-1: 128}}, {"num_bits": (4, 3)}]
    cfg = QuantizeConfig.from_any({"quant_cfg": {"nn.Linear": {"*weight_quantizer": w4a8, "*input_quantizer": {"num_bits": 8}}}})
    attrs, _ = cfg.resolve("fc1.weight_quantizer", ("Linear",))
    assert [a.num_bits for a in attrs] == [4, (4, 3)]
    assert cfg.resolve("conv1.weight_quantizer", ("Conv2d",)) == (None, None)
