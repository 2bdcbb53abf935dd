"""A config in ModelOpt's schema means what it means in ModelOpt 0.47: its presets as ``model_dump``
gives them (top-level ``"type": "dynamic"``, INT full range by default), and quantlib's presets of the
same names resolve to the same attribute configs."""

from __future__ import annotations

import copy

import pytest
import torch

import quantlib as ql
from quantlib.config import ConfigError, QuantizeConfig, QuantizerAttributeConfig
from quantlib.formats import Kind
from quantlib.formats.fp8 import fp8_fake_quant
from quantlib.formats.int import int_fake_quant
from quantlib.nn import TensorQuantizer

# ModelOpt 0.47's default_disabled_quantizers, as its presets list them (facts, for the comparison)
MO_DISABLED = [
    "*block_sparse_moe.gate*", "*linear_attn.conv1d*", "*self_attention.conv1d*", "*linear_attn.in_proj_a*",
    "*linear_attn.in_proj_b*", "*lm_head*", "*mixer.conv1d*", "*mlp.gate.*", "*mlp.shared_expert_gate.*",
    "*output_layer*", "*proj_out.*", "*router*", "mtp.*", "output.*", "*embed_vision*", "*vision_tower*",
    "*visual*", "*vision_model*", "*multi_modal_projector*",
]  # fmt: skip
MO_DISABLED_CLASSES = ["nn.BatchNorm1d", "nn.BatchNorm2d", "nn.BatchNorm3d", "nn.LeakyReLU", "nn.Embedding"]

_NVFP4 = {"num_bits": (2, 1), "effective_bits": 4.5, "block_sizes": {-1: 16, "type": "dynamic", "scale_bits": (4, 3)}}
_INT4_BLOCK = {"num_bits": 4, "block_sizes": {-1: 128, "type": "static"}}
# preset -> (weight cfg, input cfg or None (disabled), algorithm) of ModelOpt 0.47 (model_dump(exclude_unset=True))
MO_PRESETS = {
    "INT8_DEFAULT_CFG": ({"num_bits": 8, "axis": 0}, {"num_bits": 8, "axis": None}, "max"),
    "INT8_WEIGHT_ONLY_CFG": ({"num_bits": 8, "axis": 0}, None, "max"),
    "FP8_DEFAULT_CFG": ({"num_bits": (4, 3), "axis": None}, {"num_bits": (4, 3), "axis": None}, "max"),
    "FP8_PER_CHANNEL_PER_TOKEN_CFG": ({"num_bits": (4, 3), "axis": 0}, {"num_bits": (4, 3), "axis": None, "type": "dynamic",
                                                                        "block_sizes": {-1: None}}, "max"),
    "FP8_2D_BLOCKWISE_WEIGHT_ONLY_CFG": ({"num_bits": (4, 3), "axis": None, "block_sizes": {-1: 128, -2: 128}}, None, "max"),
    "INT4_BLOCKWISE_WEIGHT_ONLY_CFG": (_INT4_BLOCK, None, "max"),
    "NVFP4_DEFAULT_CFG": (_NVFP4, _NVFP4, "max"),
    "MXFP8_DEFAULT_CFG": ({"num_bits": (4, 3), "block_sizes": {-1: 32, "type": "dynamic", "scale_bits": (8, 0)}},) * 2 + (None,),
    "MXFP4_DEFAULT_CFG": ({"num_bits": (2, 1), "block_sizes": {-1: 32, "type": "dynamic", "scale_bits": (8, 0)}},) * 2 + (None,),
    "MXFP6_DEFAULT_CFG": ({"num_bits": (3, 2), "block_sizes": {-1: 32, "type": "dynamic", "scale_bits": (8, 0)}},) * 2 + (None,),
    "MXINT8_DEFAULT_CFG": ({"num_bits": 8, "block_sizes": {-1: 32, "type": "dynamic", "scale_bits": (8, 0)}},) * 2 + (None,),
    "W4A8_AWQ_BETA_CFG": ([_INT4_BLOCK, {"num_bits": (4, 3), "axis": None}], {"num_bits": (4, 3), "axis": None}, "awq_lite"),
}
# where quantlib differs on purpose (and says so in the preset's comment)
ALGORITHM_DIFFERS: dict = {}  # every preset calibrates as ModelOpt's does (W4A8_AWQ_BETA_CFG: awq_lite)


def modelopt_dump(name: str) -> dict:
    """ModelOpt 0.47's preset in its list form, as ``model_dump(exclude_unset=True)`` gives it."""
    weight, inp, algorithm = copy.deepcopy(MO_PRESETS[name])
    quant_cfg = [{"quantizer_name": "*", "enable": False}, {"quantizer_name": "*weight_quantizer", "cfg": weight}]
    quant_cfg.append({"quantizer_name": "*input_quantizer", "cfg": inp} if inp is not None else {"quantizer_name": "*input_quantizer",
                                                                                                 "enable": False})
    quant_cfg += [{"quantizer_name": p, "enable": False} for p in MO_DISABLED]
    quant_cfg += [{"quantizer_name": "*", "parent_class": c, "enable": False} for c in MO_DISABLED_CLASSES]
    return {"quant_cfg": quant_cfg, "algorithm": algorithm}


def _attrs(value):
    return [QuantizerAttributeConfig.from_dict(v) for v in value] if isinstance(value, list) else QuantizerAttributeConfig.from_dict(value)


# ------------------------------------------------------------------------------------ FP8 per token


def test_modelopt_fp8_per_channel_per_token_cfg_is_accepted():
    cfg = QuantizeConfig.from_any(modelopt_dump("FP8_PER_CHANNEL_PER_TOKEN_CFG"))
    attrs, enable = cfg.resolve("fc1.input_quantizer", ("Linear",))
    assert enable is None and attrs.is_dynamic
    spec = attrs.format_spec()
    assert spec.kind == Kind.FP8 and spec.dynamic and spec.block is None  # one amax per row (token)


def test_modelopt_fp8_per_token_activations_use_each_rows_amax(make_model):
    model = ql.quantize(make_model("mlp"), modelopt_dump("FP8_PER_CHANNEL_PER_TOKEN_CFG"), lambda m: m(torch.randn(4, 64)))
    q = model.fc1.input_quantizer
    assert q.amax is None and not q.needs_calibration
    x = torch.randn(5, 64) * torch.tensor([0.01, 1.0, 30.0, 500.0, 2.0]).unsqueeze(1)
    expected = torch.stack([fp8_fake_quant(row, row.abs().max(), (4, 3)) for row in x])
    assert torch.equal(q(x), expected)
    w = model.fc1.weight_quantizer  # per output channel, calibrated
    assert tuple(w.amax.shape) == (48, 1)


def test_type_dynamic_with_static_per_row_blocks_in_block_sizes_means_per_token():
    a = QuantizerAttributeConfig.from_dict({"num_bits": (4, 3), "type": "dynamic", "block_sizes": {-1: None}})
    b = QuantizerAttributeConfig.from_dict({"num_bits": (4, 3), "block_sizes": {-1: None, "type": "dynamic"}})
    assert a.format_spec() == b.format_spec() and a.is_dynamic and b.is_dynamic


def test_per_row_blocks_without_type_dynamic_are_refused():
    with pytest.raises(ConfigError, match="type 'dynamic'"):
        QuantizerAttributeConfig.from_dict({"num_bits": (4, 3), "type": "static", "block_sizes": {-1: None}})


# ------------------------------------------------------------------------------------ "type": "dynamic"


@pytest.mark.parametrize("axis", [None, 0])
def test_type_dynamic_int8_uses_the_amax_of_every_tensor(axis):
    q = TensorQuantizer({"num_bits": 8, "axis": axis, "type": "dynamic"})
    q.calibrate(torch.full((3, 4), 100.0))  # a dynamic quantizer never calibrates
    assert q.amax is None and not q.needs_calibration
    x = torch.randn(3, 4)
    amax = x.abs().amax() if axis is None else x.abs().amax(dim=1, keepdim=True)
    assert torch.equal(q(x), int_fake_quant(x, amax, 8, narrow_range=False))


def test_type_dynamic_int4_static_blocks_become_dynamic_blocks():
    """ModelOpt's INT4 unit says block type "static"; a dynamic quantizer still computes each block's amax."""
    a = QuantizerAttributeConfig.from_dict({"num_bits": 4, "type": "dynamic", "block_sizes": {-1: 128, "type": "static"}})
    assert a.format_spec().dynamic and a.is_dynamic


def test_type_dynamic_nvfp4_takes_the_global_amax_of_every_tensor(make_model):
    cfg = {"quant_cfg": {"*weight_quantizer": dict(_NVFP4, type="dynamic"), "default": {"enable": False}}, "algorithm": "max"}
    model = ql.quantize(make_model("mlp"), cfg, None)
    q = model.fc1.weight_quantizer
    assert q.amax is None
    static = TensorQuantizer(_NVFP4, amax=model.fc1.weight.abs().amax())
    assert torch.equal(q(model.fc1.weight), static(model.fc1.weight))


def test_switching_to_type_dynamic_drops_the_calibrated_amax():
    q = TensorQuantizer({"num_bits": 8}, amax=torch.tensor(3.0))
    q.set_from_attribute_config({"num_bits": 8, "type": "dynamic"})
    assert q.amax is None


def test_type_dynamic_input_is_not_calibrated_by_quantize(make_model, make_data, make_loop):
    cfg = {"quant_cfg": {"*weight_quantizer": {"num_bits": 8, "axis": 0}, "*input_quantizer": {"num_bits": 8, "type": "dynamic"},
                         "default": {"enable": False}}}
    model = ql.quantize(make_model("mlp"), cfg, make_loop(make_data("mlp")))
    assert model.fc1.input_quantizer.amax is None and model.fc1.weight_quantizer.amax is not None


# ------------------------------------------------------------------------------------ narrow_range


def test_int_narrow_range_defaults_to_false_like_modelopt():
    assert QuantizerAttributeConfig().narrow_range is False
    q = TensorQuantizer({"num_bits": 8}, amax=torch.tensor(127.0))
    assert torch.equal(q(torch.tensor([-1000.0, -128.0, 127.0])), torch.tensor([-128.0, -128.0, 127.0]))


def test_narrow_range_true_is_still_available():
    q = TensorQuantizer({"num_bits": 8, "narrow_range": True}, amax=torch.tensor(127.0))
    assert torch.equal(q(torch.tensor([-1000.0, -128.0, 127.0])), torch.tensor([-127.0, -127.0, 127.0]))


def test_modelopt_int8_default_cfg_gives_modelopts_activations(make_model, make_data, make_loop):
    """ModelOpt's INT8 recipe is full range: its activations reach code -128 (logits differed before)."""
    model = ql.quantize(make_model("mlp"), modelopt_dump("INT8_DEFAULT_CFG"), make_loop(make_data("mlp")))
    q = model.fc1.input_quantizer
    assert q.spec.narrow_range is False
    amax = q.amax.reshape(1)
    assert torch.equal(q(-2 * amax), torch.tensor([-128.0]) / (torch.tensor([127.0]) / amax))  # code -128


@pytest.mark.parametrize("name,elem,shown", [("MXFP6_DEFAULT_CFG", "e3m2", "mxe3m2 block=(32,) dynamic"),
                                             ("MXINT8_DEFAULT_CFG", "int8", "mx8 block=(32,) dynamic")])
def test_modelopt_mx_preset_fake_quantizes_weights_and_inputs(name, elem, shown, make_model, make_data):
    """ModelOpt's MXFP6 / MXINT8 dicts: both quantizers of a linear apply the MX fake quant, no calibration."""
    from quantlib.formats.mx import mx_fake_quant

    model = ql.quantize(make_model("mlp"), modelopt_dump(name))
    x = make_data("mlp")[0]
    fc1 = model.fc1
    assert fc1.weight_quantizer.amax is None and fc1.input_quantizer.amax is None
    want = torch.nn.functional.linear(mx_fake_quant(x, elem), mx_fake_quant(fc1.weight, elem), fc1.bias)
    assert torch.equal(fc1(x), want)
    assert shown in repr(fc1.weight_quantizer)


# ------------------------------------------------------------------------------------ presets


@pytest.mark.parametrize("name", sorted(MO_PRESETS))
def test_preset_means_what_modelopts_preset_of_that_name_means(name):
    ours = QuantizeConfig.from_any(ql.PRESETS[name])
    theirs = QuantizeConfig.from_any(dict(modelopt_dump(name), algorithm=ours.algorithm))  # algorithms compared below
    weight, inp, algorithm = MO_PRESETS[name]
    for qname, expected in (("layers.0.fc1.weight_quantizer", weight), ("layers.0.fc1.input_quantizer", inp)):
        attrs, enable = ours.resolve(qname, ("Linear",))
        assert (attrs, enable) == theirs.resolve(qname, ("Linear",)), qname
        if expected is None:
            assert enable is False, qname
        else:
            assert attrs == _attrs(expected) and enable is None, qname
    assert ours.algorithm == ALGORITHM_DIFFERS.get(name, algorithm)


@pytest.mark.parametrize("name", sorted(MO_PRESETS))
def test_preset_disables_what_modelopt_disables(name):
    cfg = QuantizeConfig.from_any(ql.PRESETS[name])
    for pattern in MO_DISABLED:
        qname = pattern.replace("*", "x").replace("..", ".") + ("weight_quantizer" if pattern.endswith(".*") else ".weight_quantizer")
        assert cfg.resolve(qname, ("Linear",))[1] is False, qname
    for cls in MO_DISABLED_CLASSES:
        assert cfg.resolve("model.norm.weight_quantizer", (cls[3:], "Module"))[1] is False, cls
    assert cfg.resolve("unregistered.thing_quantizer", ("Linear",))[1] is False  # "default": everything else off


@pytest.mark.parametrize("name,element,num_bits", [("MXFP6_DEFAULT_CFG", (3, 2), 8), ("MXINT8_DEFAULT_CFG", None, 8)])
def test_installed_modelopt_mx_preset_is_ours(name, element, num_bits):
    """ModelOpt 0.47's own dict (imported) equals the facts above and parses to the MX format."""
    mo_config = pytest.importorskip("modelopt.torch.quantization.config")
    theirs = getattr(mo_config, name)
    assert theirs == modelopt_dump(name)
    spec = QuantizeConfig.from_any(theirs).resolve("layers.0.fc1.weight_quantizer", ("Linear",))[0].format_spec()
    assert (spec.kind, spec.element, spec.num_bits, spec.block, spec.dynamic) == (Kind.MX, element, num_bits, (32,), True)
    assert spec == QuantizeConfig.from_any(ql.PRESETS[name]).resolve("layers.0.fc1.input_quantizer", ("Linear",))[0].format_spec()


@pytest.mark.parametrize(
    "cfg, match",
    [
        ({"num_bits": (3, 2)}, "FP6.*needs MX block_sizes"),
        ({"num_bits": (2, 3), "block_sizes": {-1: 16, "type": "dynamic", "scale_bits": (4, 3)}}, "FP6.*needs MX block_sizes"),
        ({"num_bits": (3, 2), "block_sizes": {-1: 32, "type": "static", "scale_bits": (8, 0)}}, "needs block_sizes"),
        ({"num_bits": 4, "block_sizes": {-1: 32, "type": "dynamic", "scale_bits": (8, 0)}}, "only MX integer format is MXINT8"),
        ({"num_bits": 8, "unsigned": True, "block_sizes": {-1: 32, "type": "dynamic", "scale_bits": (8, 0)}},
         "only MX integer format is MXINT8"),
        ({"num_bits": 8, "block_sizes": {-1: 16, "type": "dynamic", "scale_bits": (8, 0)}}, "MXINT8.*needs block_sizes"),
    ],
)
def test_impossible_mxfp6_and_mxint8_configs_are_refused(cfg, match):
    with pytest.raises(ConfigError, match=match):
        QuantizerAttributeConfig.from_dict(cfg)


# ------------------------------------------------------------------------------------ NVFP4 static blocks, blocks of 32

_NAMES = (
    "model.layers.0.mlp.down_proj", "model.layers.0.self_attn.q_proj", "model.layers.0.block_sparse_moe.experts.0.w1",
    "model.layers.0.mlp.gate", "lm_head", "layers.0.fc1",
)  # fmt: skip


@pytest.mark.parametrize("name", ["NVFP4_W4A4_WEIGHT_MSE_FP8_SWEEP_CFG", "W4A8_NVFP4_FP8_CFG", "NVFP4_MLP_WEIGHT_ONLY_CFG"])
def test_nvfp4_static_and_block32_presets_equal_modelopts_live_config(name):
    mo_config = pytest.importorskip("modelopt.torch.quantization.config")
    theirs_dict = copy.deepcopy(getattr(mo_config, name))
    ours = QuantizeConfig.from_any(ql.PRESETS[name])
    theirs = QuantizeConfig.from_any(theirs_dict)
    assert ours.algorithm == theirs.algorithm
    for module in _NAMES:
        for q in ("weight_quantizer", "input_quantizer"):
            assert ours.resolve(f"{module}.{q}", ("Linear",)) == theirs.resolve(f"{module}.{q}", ("Linear",)), (module, q)


def test_nvfp4_static_and_block32_formats():
    sweep = QuantizeConfig.from_any(ql.NVFP4_W4A4_WEIGHT_MSE_FP8_SWEEP_CFG)
    w, _ = sweep.resolve("layers.0.fc1.weight_quantizer", ("Linear",))
    i, _ = sweep.resolve("layers.0.fc1.input_quantizer", ("Linear",))
    assert (w.format_spec().kind, w.format_spec().block, w.format_spec().dynamic) == (Kind.NVFP4, (16,), False)
    assert (i.format_spec().kind, i.format_spec().dynamic) == (Kind.NVFP4, True)
    assert sweep.algorithm == {"method": "mse", "fp8_scale_sweep": True}
    w4a8 = QuantizeConfig.from_any(ql.W4A8_NVFP4_FP8_CFG)
    w, _ = w4a8.resolve("layers.0.fc1.weight_quantizer", ("Linear",))
    assert (w.format_spec().kind, w.format_spec().block) == (Kind.NVFP4, (32,))
    mlp_only = QuantizeConfig.from_any(ql.NVFP4_MLP_WEIGHT_ONLY_CFG)
    assert mlp_only.resolve("model.layers.0.self_attn.q_proj.weight_quantizer", ("Linear",))[1] is False
    assert mlp_only.resolve("model.layers.0.mlp.up_proj.input_quantizer", ("Linear",))[1] is False
