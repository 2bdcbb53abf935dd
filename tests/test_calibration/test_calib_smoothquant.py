"""smoothquant: the closed-form scales, an unchanged float function, ModelOpt 0.47's scales and
weights on the same layer and data, and the refusals (no data, NaN, weight-less, unreached)."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import quantlib as ql
from quantlib.calib.smoothquant import smoothing_scale

from ._models import Gain, int8_cfg, loop, mlp, outlier_data, register_gain, unregister_gain


@pytest.mark.parametrize("alpha", [0.0, 0.5, 0.8, 1.0])
def test_planted_outlier_channel_gets_the_closed_form_scale(alpha):
    lin = nn.Sequential(nn.Linear(4, 3))
    with torch.no_grad():
        lin[0].weight.copy_(torch.tensor([[1.0, -2.0, 0.5, 0.25], [0.5, 1.0, -4.0, 0.5], [-1.0, 0.5, 1.0, 2.0]]))
    x = torch.tensor([[1.0, 0.5, 100.0, 0.25], [-2.0, 0.25, -50.0, 0.5]])  # channel 2: the outlier
    w_amax = torch.tensor([1.0, 2.0, 4.0, 2.0])
    a_amax = torch.tensor([2.0, 0.5, 100.0, 0.5])
    original = lin[0].weight.detach().clone()
    model = ql.quantize(lin, int8_cfg({"method": "smoothquant", "alpha": alpha}), loop([x]))
    s = a_amax.pow(alpha) / w_amax.pow(1 - alpha)
    pqs = model[0].input_quantizer.pre_quant_scale
    torch.testing.assert_close(pqs, 1 / s, rtol=1e-6, atol=0)
    assert torch.equal(model[0].weight.detach(), original)  # the parameter is never changed
    torch.testing.assert_close(model[0].weight_quantizer.pre_quant_scale, s, rtol=1e-6, atol=0)
    torch.testing.assert_close(model[0].input_quantizer.amax, (a_amax / s).amax(), rtol=1e-6, atol=0)
    scaled = original * model[0].weight_quantizer.pre_quant_scale
    assert torch.equal(model[0].weight_quantizer.amax, scaled.abs().amax(1, keepdim=True))


def test_float_function_is_unchanged():
    data = outlier_data()
    ref = mlp()
    model = ql.quantize(mlp(), int8_cfg({"method": "smoothquant", "alpha": 0.5}), loop(data))
    for _, q in ql.model_quant.iter_leaf_quantizers(model):
        q.disable_quant()
    with torch.no_grad():
        torch.testing.assert_close(model(data[0]), ref(data[0]), rtol=1e-5, atol=1e-5)


def test_zero_activation_channel_is_left_unscaled():
    scale = smoothing_scale(torch.tensor([0.0, 4.0]), torch.tensor([2.0, 1.0]), 0.5)
    assert scale[0] == 1.0 and scale[1] == 0.5


def test_smoothing_lowers_the_quantized_output_error():
    data = outlier_data()
    ref = mlp()
    by_max = ql.quantize(mlp(), int8_cfg("max"), loop(data))
    by_sq = ql.quantize(mlp(), int8_cfg({"method": "smoothquant", "alpha": 0.5}), loop(data))
    with torch.no_grad():
        err = {k: sum((m(x) - ref(x)).square().sum() for x in data) for k, m in (("max", by_max), ("sq", by_sq))}
    assert err["sq"] < err["max"]


def test_checkpoint_round_trip_restores_the_smoothed_model(tmp_path):
    data = outlier_data()
    model = ql.quantize(mlp(), int8_cfg({"method": "smoothquant", "alpha": 0.5}), loop(data))
    ql.save(model, tmp_path / "sq.pt")
    fresh = ql.restore(mlp(), tmp_path / "sq.pt")  # the weights are the original ones
    with torch.no_grad():
        assert torch.equal(fresh(data[1]), model(data[1]))


@pytest.mark.parametrize("alpha", [0.5, 1.0])
def test_same_scales_and_weights_as_modelopt(alpha):
    mtq = pytest.importorskip("modelopt.torch.quantization")
    data = outlier_data()
    cfg = copy.deepcopy(mtq.INT8_SMOOTHQUANT_CFG)
    cfg["algorithm"] = {"method": "smoothquant", "alpha": alpha}
    theirs = mtq.quantize(mlp(), cfg, loop(data))
    ours = ql.quantize(mlp(), int8_cfg({"method": "smoothquant", "alpha": alpha}), loop(data))
    for i in (0, 2):
        torch.testing.assert_close(ours[i].input_quantizer.pre_quant_scale, theirs[i].input_quantizer.pre_quant_scale, rtol=1e-6, atol=0)
        # ModelOpt folds s into the weight parameter; quantlib's weight quantizer applies it
        torch.testing.assert_close(ours[i].weight * ours[i].weight_quantizer.pre_quant_scale, theirs[i].weight, rtol=1e-6, atol=0)
        torch.testing.assert_close(ours[i].weight_quantizer.amax, theirs[i].weight_quantizer.amax.float(), rtol=1e-6, atol=0)
        torch.testing.assert_close(ours[i].input_quantizer.amax, theirs[i].input_quantizer.amax.float(), rtol=1e-6, atol=0)
    with torch.no_grad():
        torch.testing.assert_close(ours(data[0]), theirs(data[0]), rtol=1e-5, atol=1e-5)


def test_without_forward_loop_weights_get_max_and_a_warning(caplog):
    model = ql.quantize(mlp(), int8_cfg("smoothquant"), None)
    assert "smoothquant needs a forward_loop" in caplog.text
    assert model[0].input_quantizer.pre_quant_scale is None and model[0].input_quantizer.amax is None
    assert torch.equal(model[0].weight_quantizer.amax, model[0].weight.detach().abs().amax(1, keepdim=True))


def test_nan_activation_raises_naming_the_quantizer_and_stores_no_scale():
    data = outlier_data()
    data[1][2, 5] = float("nan")
    model = mlp()
    with pytest.raises(ql.CalibrationError, match=r"0\.input_quantizer"):
        ql.quantize(model, int8_cfg("smoothquant"), loop(data))
    assert all(q.pre_quant_scale is None for _, q in ql.model_quant.iter_leaf_quantizers(model))


def test_weightless_module_is_refused_by_name():
    register_gain()
    try:
        model = nn.Sequential(nn.Linear(8, 8), Gain())
        with pytest.raises(ql.CalibrationError, match=r"smoothquant cannot serve \['1'\]"):
            ql.quantize(model, int8_cfg("smoothquant"), loop([torch.randn(2, 8)]))
    finally:
        unregister_gain()


class _Skips(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.used = nn.Linear(8, 8)
        self.unused = nn.Linear(8, 8)

    def forward(self, x):
        return self.used(x)


def test_layer_the_forward_loop_never_reaches_is_named():
    with pytest.raises(ql.CalibrationError, match="unused"):
        ql.quantize(_Skips(), int8_cfg("smoothquant"), loop([torch.randn(2, 8)]))
