"""KV presets and merge_kv_config: ModelOpt's meaning, rule order, inputs left alone; no model needed."""

from __future__ import annotations

import copy

import pytest

import quantlib as ql
from quantlib.config import QuantizeConfig
from quantlib.formats import Kind
from quantlib.kv.presets import KV_PRESETS, kv_rules


def _resolve(cfg: dict, name: str):
    return QuantizeConfig.from_any(cfg).resolve(name)


def test_kv_fp8_preset_is_per_tensor_e4m3_on_k_and_v_only():
    cfg = ql.merge_kv_config(None, ql.FP8_KV_CFG)
    for name in ("model.layers.0.self_attn.k_bmm_quantizer", "model.layers.0.self_attn.v_bmm_quantizer"):
        attrs, enable = _resolve(cfg, name)
        assert enable is None and attrs.enable and attrs.num_bits == (4, 3) and attrs.axis is None
    for name in ("model.layers.0.self_attn.q_bmm_quantizer", "model.layers.0.self_attn.q_proj.input_quantizer", "lm_head.weight_quantizer"):
        attrs, enable = _resolve(cfg, name)
        assert attrs is None and enable is False


def test_kv_nvfp4_preset_is_nvfp4_with_a_calibrated_global_amax():
    attrs, _ = _resolve(ql.merge_kv_config(None, ql.NVFP4_KV_CFG), "a.k_bmm_quantizer")
    spec = attrs.format_spec()
    assert spec.kind == Kind.NVFP4 and spec.block == (16,) and not attrs.is_dynamic


def test_kv_merge_appends_after_the_weight_rules():
    merged = ql.merge_kv_config(ql.FP8_DEFAULT_CFG, ql.FP8_KV_CFG)
    assert merged["quant_cfg"][-1]["quantizer_name"] == "*[kv]_bmm_quantizer"
    assert merged["algorithm"] == "max"
    attrs, _ = _resolve(merged, "model.layers.0.mlp.up_proj.input_quantizer")
    assert attrs.enable and attrs.num_bits == (4, 3)
    assert _resolve(merged, "lm_head.input_quantizer")[1] is False  # the preset's disables survive
    attrs, _ = _resolve(merged, "model.layers.0.self_attn.k_bmm_quantizer")
    assert attrs.enable and attrs.num_bits == (4, 3)


def test_kv_merge_leaves_its_inputs_unchanged():
    weight, kv = copy.deepcopy(ql.INT8_DEFAULT_CFG), copy.deepcopy(ql.NVFP4_KV_CFG)
    merged = ql.merge_kv_config(ql.INT8_DEFAULT_CFG, ql.NVFP4_KV_CFG)
    merged["quant_cfg"][-1]["cfg"]["num_bits"] = 8
    assert ql.INT8_DEFAULT_CFG == weight and ql.NVFP4_KV_CFG == kv


def test_kv_merge_takes_the_rule_list_and_a_quantize_config():
    a = ql.merge_kv_config(QuantizeConfig.from_any(ql.FP8_DEFAULT_CFG), ql.FP8_KV_CFG["quant_cfg"])
    b = ql.merge_kv_config(ql.FP8_DEFAULT_CFG, ql.FP8_KV_CFG)
    assert a == b


def test_kv_merge_rejects_a_bad_kv_config():
    with pytest.raises(ql.ConfigError, match="kv_config must be"):
        ql.merge_kv_config(None, {"quant_cfg": {"*[kv]_bmm_quantizer": {"num_bits": 8}}})
    with pytest.raises(ql.ConfigError, match="num_bits"):
        ql.merge_kv_config(None, [{"quantizer_name": "*[kv]_bmm_quantizer", "cfg": {"num_bits": (3, 3)}}])


@pytest.mark.parametrize("name", sorted(KV_PRESETS))
def test_kv_presets_have_modelopt_pattern(name):
    assert {e["quantizer_name"] for e in KV_PRESETS[name]["quant_cfg"]} == {"*[kv]_bmm_quantizer"}


def test_kv_rules_tell_kv_rules_from_catch_alls():
    cfg = QuantizeConfig.from_any(
        {"quant_cfg": [
            {"quantizer_name": "*", "cfg": {"num_bits": 8}},  # a catch-all is not a KV rule
            {"quantizer_name": "*k_bmm_quantizer", "enable": True},
            {"quantizer_name": "*v_bmm_quantizer", "enable": False},  # disabling: not a KV rule
            {"quantizer_name": "*bmm*", "cfg": {"num_bits": (4, 3), "enable": False}},
        ]}
    )  # fmt: skip
    assert kv_rules(cfg) == ["*k_bmm_quantizer"]
    assert kv_rules(QuantizeConfig.from_any(ql.FP8_DEFAULT_CFG)) == []
