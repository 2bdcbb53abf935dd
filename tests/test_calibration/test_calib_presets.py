"""The calibration presets: ModelOpt 0.47's names, formats, algorithms and scopes; each one runs."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import quantlib as ql
from quantlib.config import QuantizeConfig
from quantlib.formats import Kind

from ._models import loop, mlp, outlier_data

NVFP4 = (Kind.NVFP4, (2, 1), None, (16,), True)
MXFP8 = (Kind.MX, (4, 3), None, (32,), True)
# name: (weight meaning, input meaning or None (disabled), algorithm name)
MEANINGS = {
    "INT4_AWQ_CFG": ((Kind.INT, 4, None, (128,), False), None, "awq_lite"),
    "W4A8_AWQ_BETA_CFG": (None, (Kind.FP8, (4, 3), None, None, False), "awq_lite"),
    "INT8_SMOOTHQUANT_CFG": ((Kind.INT, 8, (0,), None, False), (Kind.INT, 8, None, None, False), "smoothquant"),
    "NVFP4_AWQ_LITE_CFG": (NVFP4, NVFP4, "awq_lite"),
    "NVFP4_AWQ_CLIP_CFG": (NVFP4, NVFP4, "awq_clip"),
    "NVFP4_AWQ_FULL_CFG": (NVFP4, NVFP4, "awq_full"),
    "W4A16_NVFP4_CFG": (NVFP4, None, "max"),
    "NVFP4_W4A4_WEIGHT_MSE_FP8_SWEEP_CFG": ((Kind.NVFP4, (2, 1), None, (16,), False), NVFP4, "mse"),
    "W4A8_NVFP4_FP8_CFG": ((Kind.NVFP4, (2, 1), None, (32,), True), (Kind.FP8, (4, 3), None, None, False), "max"),
}
# name: (quantized quantizer names, names left disabled)
MOE = "model.layers.0.mlp.experts.gate_up_proj_weight_quantizer"
SCOPES = {
    "NVFP4_EXPERTS_ONLY_CFG": ([MOE, "model.layers.0.block_sparse_moe.experts.0.w1.input_quantizer"],
                               ["model.layers.0.mlp.down_proj.weight_quantizer", "model.layers.0.self_attn.o_proj.weight_quantizer"]),
    "NVFP4_MLP_ONLY_CFG": ([MOE, "model.layers.0.mlp.down_proj.weight_quantizer"], ["model.layers.0.self_attn.o_proj.weight_quantizer",
                                                                                    "model.layers.0.mlp.gate.weight_quantizer"]),
    "NVFP4_OMLP_ONLY_CFG": (["model.layers.0.self_attn.o_proj.weight_quantizer", "model.layers.0.mlp.up_proj.input_quantizer"],
                            ["model.layers.0.self_attn.q_proj.weight_quantizer"]),
    "MXFP8_EXPERTS_ONLY_CFG": ([MOE], ["model.layers.0.mlp.down_proj.weight_quantizer", "lm_head.weight_quantizer"]),
    "MXFP8_MLP_ONLY_CFG": ([MOE, "model.layers.0.mlp.up_proj.input_quantizer"], ["model.layers.0.self_attn.k_proj.input_quantizer"]),
    "NVFP4_MLP_WEIGHT_ONLY_CFG": (["model.layers.0.mlp.down_proj.weight_quantizer",
                                   "model.layers.0.block_sparse_moe.experts.0.w1.weight_quantizer"],
                                   ["model.layers.0.mlp.up_proj.input_quantizer", "model.layers.0.self_attn.o_proj.weight_quantizer"]),
    "MXFP4_MLP_WEIGHT_ONLY_CFG": (["model.layers.0.mlp.down_proj.weight_quantizer"], ["model.layers.0.mlp.down_proj.input_quantizer"]),
}


def _meaning(attrs) -> tuple:
    s = attrs.format_spec()
    return (s.kind, s.num_bits if s.kind == Kind.INT else s.element, attrs.axis, s.block, s.dynamic)


@pytest.mark.parametrize("name", sorted(MEANINGS))
def test_preset_formats_and_algorithm(name):
    weight, inp, algorithm = MEANINGS[name]
    cfg = QuantizeConfig.from_any(ql.PRESETS[name])
    assert cfg.algorithm_name == algorithm
    wattrs, _ = cfg.resolve("layers.0.fc1.weight_quantizer", ("Linear",))
    if weight is not None:
        assert _meaning(wattrs) == weight
    iattrs, ien = cfg.resolve("layers.0.fc1.input_quantizer", ("Linear",))
    assert ien is False if inp is None else _meaning(iattrs) == inp
    assert cfg.resolve("lm_head.weight_quantizer", ("Linear",))[1] is False


@pytest.mark.parametrize("name", sorted(SCOPES))
def test_scoped_presets_quantize_only_their_scope(name):
    on, off = SCOPES[name]
    cfg = QuantizeConfig.from_any(ql.PRESETS[name])
    for q in on:
        attrs, enable = cfg.resolve(q, ("Linear",))
        assert attrs is not None and attrs.enable and enable is None, q
    for q in off:
        attrs, enable = cfg.resolve(q, ("Linear",))
        assert enable is False or attrs is None or not attrs.enable, q
    assert ("MXFP8" in name) == (_meaning(cfg.resolve(on[0], ("Linear",))[0]) == MXFP8)


def test_every_calibration_preset_is_registered():
    from quantlib import presets

    assert set(presets.CALIBRATION_PRESETS) <= set(ql.PRESETS)
    assert {"INT4_AWQ_CFG", "W4A8_AWQ_BETA_CFG", "INT8_SMOOTHQUANT_CFG", "NVFP4_AWQ_LITE_CFG", "W4A16_NVFP4_CFG"} <= set(ql.PRESETS)


@pytest.mark.parametrize("name", sorted(MEANINGS))
def test_preset_calibrates_an_mlp_and_stays_close(name):
    data = outlier_data()
    model = ql.quantize(mlp(), ql.PRESETS[name], loop(data))
    with torch.no_grad():
        out, ref = model(data[0]), mlp()(data[0])
    assert torch.isfinite(out).all()
    assert float((out - ref).norm() / ref.norm()) < 0.5
    if MEANINGS[name][2] in ("awq_lite", "awq_full", "smoothquant"):
        assert model[0].input_quantizer.pre_quant_scale is not None


def test_w4a8_awq_beats_its_max_calibration():
    data = outlier_data()
    ref = mlp()
    errs = {}
    for algo in ("max", "awq_lite"):
        m = ql.quantize(mlp(), dict(ql.W4A8_AWQ_BETA_CFG, algorithm=algo), loop(data))
        with torch.no_grad():
            errs[algo] = sum(float((m(x) - ref(x)).square().sum()) for x in data)
    assert errs["awq_lite"] < errs["max"]


def test_conv_layers_keep_max_under_awq():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 8, 3), nn.Flatten(), nn.Linear(8 * 4 * 4, 4)).eval()
    data = [torch.randn(2, 3, 6, 6)]
    model = ql.quantize(model, ql.INT4_AWQ_CFG, loop(data))
    assert model[0].input_quantizer.pre_quant_scale is None and model[2].input_quantizer.pre_quant_scale is not None
