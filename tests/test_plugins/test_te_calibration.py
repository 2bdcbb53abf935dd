"""Activation-based calibration (AWQ, SmoothQuant) of the quantized TE Linear / LayerNormLinear, driven
through the stand-ins of test_transformer_engine.py (TE's real autograd-function signatures).

TE builds ``bias=False`` layers with ``bias`` an empty tensor, and LayerNormLinear's GEMM reads the
normalized input while the module's forward takes the pre-norm one: the searched ``pre_quant_scale``
and amax must be those of an ``nn.Linear(bias=False)`` calibrated on the normalized inputs, bit for bit.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import quantlib as ql
from quantlib.plugins import te_adapters as ta

from ._te_wheels import real_signature
from .test_transformer_engine import fake_linear_class, fake_linear_namespace, registered  # noqa: F401  (fixture)

PRESETS = {"int4_awq": ql.INT4_AWQ_CFG, "w4a8_awq": ql.W4A8_AWQ_BETA_CFG, "int8_smoothquant": ql.INT8_SMOOTHQUANT_CFG}


def _te_layer(te_source, registered, version: str, layernorm: bool) -> nn.Module:
    """A fresh stand-in te.Linear / te.LayerNormLinear built with bias=False: ``bias`` is an empty
    tensor attribute, as TE sets it (``torch.Tensor().to(...)``)."""
    cls_name, module = ("_LayerNormLinear", "layernorm_linear") if layernorm else ("_Linear", "linear")
    sig = real_signature(te_source(version, module), cls_name)
    ns = fake_linear_namespace(sig, cls_name)
    base_cls = fake_linear_class(ns, cls_name)

    class FakeTENoBias(base_cls):
        def __init__(self) -> None:
            super().__init__()
            self.bias = torch.Tensor()

    base = ta.QuantTELayerNormLinearBase if layernorm else ta.QuantTELinearBase
    registered(FakeTENoBias, type("_QuantFakeNoBias", (base,), {"te_namespace": ns, "te_args": ta.TensorArgs.from_signature(sig)}))
    return FakeTENoBias()


def _data() -> list[torch.Tensor]:
    """Inputs whose channels differ in offset and spread: the pre-norm and normalized per-channel
    statistics (and so the scales searched on them) differ."""
    g = torch.Generator().manual_seed(3)
    spread = torch.linspace(0.5, 8.0, 16)
    return [torch.randn(2, 5, 16, generator=g) * spread + torch.arange(16.0) for _ in range(3)]


def _quantizer_states(model: nn.Module) -> dict[str, torch.Tensor]:
    return {f"{q}.{k}": t for q in ("input_quantizer", "weight_quantizer") for k, t in getattr(model, q).state_dict().items()}


@pytest.mark.parametrize("version", ["1.13.0", "2.20.2"])
@pytest.mark.parametrize("layernorm", [False, True], ids=["linear", "layernorm_linear"])
@pytest.mark.parametrize("preset", sorted(PRESETS))
def test_te_layer_without_bias_calibrates_as_nn_linear_on_the_gemm_input(te_source, registered, version, layernorm, preset):
    cfg, data = PRESETS[preset], _data()
    model = ql.quantize(_te_layer(te_source, registered, version, layernorm), cfg, lambda m: [m(x) for x in data])
    ref_lin = nn.Linear(16, 8, bias=False)
    ref_lin.weight.data.copy_(model.weight.data)
    norm = (lambda x: F.layer_norm(x, (16,))) if layernorm else (lambda x: x)
    ref = ql.quantize(ref_lin, cfg, lambda m: [m(norm(x)) for x in data])

    assert ref.input_quantizer.pre_quant_scale is not None  # the algorithm ran: there are scales to compare
    got, want = _quantizer_states(model), _quantizer_states(ref)
    assert sorted(got) == sorted(want) and any(k.endswith("_pre_quant_scale") for k in want)
    for k in want:
        assert torch.equal(got[k], want[k]), k
    with torch.no_grad():
        assert torch.equal(model(data[0]), ref(norm(data[0])))


@pytest.mark.parametrize("layernorm", [False, True], ids=["linear", "layernorm_linear"])
def test_te_layer_awq_full_clips_on_the_gemm_input(te_source, registered, layernorm):
    cfg = {"quant_cfg": {"*weight_quantizer": {"num_bits": 4, "block_sizes": {-1: 8}}, "*input_quantizer": {"enable": False},
                         "default": {"enable": False}},
           "algorithm": {"method": "awq_full", "alpha_step": 0.25}}  # fmt: skip
    data = _data()
    model = ql.quantize(_te_layer(te_source, registered, "2.20.2", layernorm), cfg, lambda m: [m(x) for x in data])
    ref_lin = nn.Linear(16, 8, bias=False)
    ref_lin.weight.data.copy_(model.weight.data)
    norm = (lambda x: F.layer_norm(x, (16,))) if layernorm else (lambda x: x)
    ref = ql.quantize(ref_lin, cfg, lambda m: [m(norm(x)) for x in data])
    assert torch.equal(model.awq_clip_ratio, ref.awq_clip_ratio) and model.awq_lite_alpha == ref.awq_lite_alpha
    got, want = _quantizer_states(model), _quantizer_states(ref)
    assert sorted(got) == sorted(want) and "weight_quantizer._amax" in want
    for k in want:
        assert torch.equal(got[k], want[k]), k
