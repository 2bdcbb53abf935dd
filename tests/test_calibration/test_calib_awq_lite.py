"""awq_lite: the closed-form scales of the chosen alpha, the alpha a brute-force search picks, an
unchanged float function, ModelOpt 0.47's choices on the same layers and data, refusals, and DP2."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import quantlib as ql
from quantlib.calib.awq_lite import alphas

from ._models import Gain, loop, mlp, outlier_data, register_gain, unregister_gain

INT4 = {"num_bits": 4, "block_sizes": {-1: 32, "type": "static"}, "narrow_range": False}


def _cfg(algorithm="awq_lite", inp=None, weight=INT4) -> dict:
    quant_cfg = {"default": {"enable": False}, "*weight_quantizer": weight}
    if inp is not None:
        quant_cfg["*input_quantizer"] = inp
    return {"quant_cfg": quant_cfg, "algorithm": algorithm}


def _planted():
    """A linear with a planted outlier input channel (3) and its calibration inputs."""
    torch.manual_seed(7)
    model = nn.Sequential(nn.Linear(64, 32)).eval()
    g = torch.Generator().manual_seed(8)
    data = [torch.randn(16, 64, generator=g) for _ in range(2)]
    for x in data:
        x[:, 3] *= 40.0
    return model, data


def _closed_form(x: list[torch.Tensor], w: torch.Tensor, alpha: float, block: int) -> torch.Tensor:
    act = torch.stack([t.abs().mean(0) for t in x]).mean(0)
    wn = w.abs().reshape(-1, block)
    wn = (wn / (wn.amax(1, keepdim=True) + torch.finfo(torch.float32).tiny)).reshape(w.shape).mean(0)
    s = (act.pow(alpha) / (wn.pow(1 - alpha) + torch.finfo(torch.float32).tiny)).clamp(1e-4, 1e4)
    return s / (s.max() * s.min()).sqrt()


def _brute_force_alpha(w: torch.Tensor, data: list[torch.Tensor], bias: torch.Tensor, block: int) -> float:
    q = ql.TensorQuantizer(INT4)
    best, best_loss = None, float("inf")
    for alpha in alphas(0.1):
        s = _closed_form(data, w, alpha, block)
        loss = 0.0
        for x in data:
            ws = w * s
            q.reset_amax()
            loss += float((F.linear(x / s, q(ws), bias) - F.linear(x, w, bias)).pow(2).mean())
        if loss < best_loss:
            best, best_loss = alpha, loss
    return best


def test_planted_outlier_gets_the_closed_form_scale_of_the_best_alpha():
    model, data = _planted()
    w0, b0 = model[0].weight.detach().clone(), model[0].bias.detach().clone()
    model = ql.quantize(model, _cfg(), loop(data))
    alpha = model[0].awq_lite_alpha
    assert alpha == _brute_force_alpha(w0, data, b0, 32)
    assert alpha > 0  # scaling the outlier channel up before quantizing the weight pays
    s = _closed_form(data, w0, alpha, 32)
    torch.testing.assert_close(model[0].input_quantizer.pre_quant_scale, 1 / s, rtol=1e-6, atol=0)
    assert int(torch.argmax(s)) == 3
    assert torch.equal(model[0].weight.detach(), w0)
    torch.testing.assert_close(model[0].weight_quantizer.pre_quant_scale, s, rtol=1e-6, atol=0)


def test_float_function_is_unchanged():
    data = outlier_data()
    model = ql.quantize(mlp(), _cfg(inp={"num_bits": 8, "axis": None}), loop(data))
    for _, q in ql.model_quant.iter_leaf_quantizers(model):
        q.disable_quant()
    with torch.no_grad():
        torch.testing.assert_close(model(data[0]), mlp()(data[0]), rtol=1e-5, atol=1e-5)


def test_awq_beats_max_at_int4_blocks():
    data = outlier_data()
    ref = mlp()
    errs = {}
    for algo in ("max", "awq_lite"):
        m = ql.quantize(mlp(), _cfg(algo), loop(data))
        with torch.no_grad():
            errs[algo] = sum(float((m(x) - ref(x)).square().sum()) for x in data)
    assert errs["awq_lite"] < errs["max"]


def _modelopt_int4(alpha_step: float = 0.1, w4a8: bool = False):
    mtq = pytest.importorskip("modelopt.torch.quantization")
    cfg = copy.deepcopy(mtq.W4A8_AWQ_BETA_CFG if w4a8 else mtq.INT4_AWQ_CFG)
    cfg["algorithm"] = {"method": "awq_lite", "alpha_step": alpha_step, "debug": True}
    return mtq, cfg


@pytest.mark.parametrize("alpha_step", [0.1, 0.25])
def test_same_alpha_scales_and_amax_as_modelopt_int4(alpha_step):
    mtq, cfg = _modelopt_int4(alpha_step)
    data = [x[:, :64] for x in outlier_data(d_in=64)]
    theirs = mtq.quantize(mlp(), cfg, loop(data))
    w = {"num_bits": 4, "block_sizes": {-1: 128, "type": "static"}, "narrow_range": False}
    ours = ql.quantize(mlp(), _cfg({"method": "awq_lite", "alpha_step": alpha_step}, weight=w), loop(data))
    for i in (0, 2):
        assert ours[i].awq_lite_alpha == pytest.approx(theirs[i].awq_lite.best_alpha, abs=1e-7)
        torch.testing.assert_close(ours[i].input_quantizer.pre_quant_scale, theirs[i].input_quantizer.pre_quant_scale, rtol=1e-6, atol=0)
        torch.testing.assert_close(ours[i].weight * ours[i].weight_quantizer.pre_quant_scale, theirs[i].weight, rtol=1e-6, atol=0)
        a = ours[i].weight_quantizer.amax
        torch.testing.assert_close(a, theirs[i].weight_quantizer.amax.reshape(a.shape).float(), rtol=1e-6, atol=0)


def test_same_choices_as_modelopt_w4a8():
    mtq, cfg = _modelopt_int4(w4a8=True)
    data = outlier_data()
    theirs = mtq.quantize(mlp(), cfg, loop(data))
    cfg = copy.deepcopy(ql.W4A8_AWQ_BETA_CFG)
    for attrs in cfg["quant_cfg"]["*weight_quantizer"]:  # ModelOpt's integers are full range
        attrs["narrow_range"] = False
    assert cfg["algorithm"] == "awq_lite"
    ours = ql.quantize(mlp(), cfg, loop(data))
    for i in (0, 2):
        assert ours[i].awq_lite_alpha == pytest.approx(theirs[i].awq_lite.best_alpha, abs=1e-7)
        torch.testing.assert_close(ours[i].input_quantizer.pre_quant_scale, theirs[i].input_quantizer.pre_quant_scale, rtol=1e-6, atol=0)
        torch.testing.assert_close(ours[i].input_quantizer.amax, theirs[i].input_quantizer.amax.float(), rtol=1e-6, atol=0)


def test_without_forward_loop_weights_get_max_and_a_warning(caplog):
    model = ql.quantize(mlp(), _cfg(), None)
    assert "awq_lite needs a forward_loop" in caplog.text
    assert model[0].input_quantizer.pre_quant_scale is None
    assert torch.equal(model[0].weight_quantizer.amax, ql.quantize(mlp(), _cfg("max"), None)[0].weight_quantizer.amax)


def test_nan_input_raises_naming_the_quantizer_and_stores_no_scale():
    data = outlier_data()
    data[0][1, 1] = float("nan")
    model = mlp()
    with pytest.raises(ql.CalibrationError, match=r"0\.input_quantizer"):
        ql.quantize(model, _cfg(), loop(data))
    assert all(q.pre_quant_scale is None for _, q in ql.model_quant.iter_leaf_quantizers(model))


def test_weightless_module_is_refused_by_name():
    register_gain()
    try:
        model = nn.Sequential(nn.Linear(32, 32), Gain())
        with pytest.raises(ql.CalibrationError, match=r"awq_lite cannot serve \['1'\]"):
            ql.quantize(model, _cfg(inp={"num_bits": 8}), loop([torch.randn(2, 32)]))
    finally:
        unregister_gain()


class _Skips(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.used = nn.Linear(32, 32)
        self.unused = nn.Linear(32, 32)

    def forward(self, x):
        return self.used(x)


def test_unreached_layer_is_named_even_with_inputs_unquantized():
    with pytest.raises(ql.CalibrationError, match=r"awq_lite: forward_loop never reached \['unused'\]"):
        ql.quantize(_Skips(), _cfg(), loop([torch.randn(2, 32)]))


def test_alpha_grid():
    assert alphas(0.25) == [0.0, 0.25, 0.5, 0.75, 1.0]
    assert len(alphas(0.1)) == 11 and alphas(0.3)[-1] == pytest.approx(0.9)


@pytest.mark.parametrize("bad", [{"alpha_step": 0.0}, {"alpha_step": 1.5}, {"alpha_step": True}, {"alpha": 0.5}])
def test_invalid_fields_are_refused_by_name(bad):
    with pytest.raises(ql.ConfigError, match=next(iter(bad))):
        ql.QuantizeConfig.from_any(_cfg(dict(method="awq_lite", **bad)))


# ------------------------------------------------------------------------------ data parallel


def _dp_rank(rank: int, world: int, data: list[torch.Tensor]) -> dict:
    mine = data[rank::world]
    model = ql.quantize(mlp(), _cfg(inp={"num_bits": 8, "axis": None}), loop(mine))
    return {
        "alpha": [model[i].awq_lite_alpha for i in (0, 2)],
        "pqs": [model[i].input_quantizer.pre_quant_scale for i in (0, 2)],
        "amax": [model[i].input_quantizer.amax for i in (0, 2)],
    }


@pytest.mark.distributed
def test_dp2_ranks_choose_alike_and_as_one_process_on_the_global_data():
    from tests.ranks import run_on_ranks

    data = outlier_data(n=4)
    outs = run_on_ranks(_dp_rank, 2, data, timeout=120)
    single = ql.quantize(mlp(), _cfg(inp={"num_bits": 8, "axis": None}), loop(data))
    assert outs[0]["alpha"] == outs[1]["alpha"] == [single[i].awq_lite_alpha for i in (0, 2)]
    for i, j in enumerate((0, 2)):
        assert torch.equal(outs[0]["pqs"][i], outs[1]["pqs"][i]) and torch.equal(outs[0]["amax"][i], outs[1]["amax"][i])
        torch.testing.assert_close(outs[0]["pqs"][i], single[j].input_quantizer.pre_quant_scale, rtol=1e-5, atol=0)
        torch.testing.assert_close(outs[0]["amax"][i], single[j].input_quantizer.amax, rtol=1e-5, atol=0)


def test_calibrating_again_gives_the_same_scales():
    data = outlier_data()
    model = ql.quantize(mlp(), _cfg(), loop(data))
    first = [model[i].input_quantizer.pre_quant_scale.clone() for i in (0, 2)]
    ql.calibrate(model, "awq_lite", loop(data))  # starts from the weights again, not from W * s
    assert all(torch.equal(a, model[i].input_quantizer.pre_quant_scale) for a, i in zip(first, (0, 2)))


def test_bf16_model_keeps_bf16_scales_and_finite_outputs():
    data = [x.bfloat16() for x in outlier_data()]
    model = ql.quantize(mlp().bfloat16(), _cfg("awq_full"), loop(data))
    assert model[0].input_quantizer.pre_quant_scale.dtype == torch.bfloat16
    with torch.no_grad():
        out = model(data[0])
    assert out.dtype == torch.bfloat16 and torch.isfinite(out).all()
