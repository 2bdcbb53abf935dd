"""quantize() parses its config once and hands the typed objects down (calibrate, the amax sync, the
sequential driver, the checkpoint): nothing is stashed on the user's model, and a checkpoint restore still
knows the model-level settings (expert_input_policy) from the checkpoint's own metadata."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import quantlib as ql
import quantlib.config as qconfig
import quantlib.model_quant as mq
from quantlib.nn.containers import QuantizerContainer
from quantlib.nn.quant_module import QuantModule
from quantlib.nn.tensor_quantizer import TensorQuantizer


def _plain_attributes(model: nn.Module, names=None) -> dict[str, set[str]]:
    """{module name: its attribute names} of every module that quantlib does not own (not converted, not a
    quantizer nor inside one); ``names``: only those."""
    out = {}
    for name, m in model.named_modules():
        if isinstance(m, (QuantModule, TensorQuantizer, QuantizerContainer)) or ".input_quantizer" in name or "_quantizer." in name:
            continue
        if names is None or name in names:
            out[name] = set(vars(m)) - {"quant_coverage"}  # the documented result of quantize (README), not a side channel
    return out


def _moe_mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 32)).eval()


@pytest.mark.parametrize("kind", ["mlp", "conv"])
def test_quantize_calibrate_restore_leave_no_attribute_on_the_users_model(kind, make_model, make_data, make_loop, tmp_path):
    model = make_model(kind)
    before = _plain_attributes(model)
    loop = make_loop(make_data(kind))
    cfg = dict(ql.INT8_DEFAULT_CFG, expert_input_policy="error")
    ql.quantize(model, cfg, loop)
    after = _plain_attributes(model, before)
    assert "" in after and after == {n: before[n] for n in after}
    ql.calibrate(model, "max", loop)
    assert _plain_attributes(model, before) == after
    ql.checkpoint.save(model, tmp_path / "q.pt")
    fresh = make_model(kind)
    restored = ql.checkpoint.restore(fresh, tmp_path / "q.pt")
    assert _plain_attributes(restored, before) == after
    # the checkpoint's metadata brings the settings back, on the converted modules only
    assert mq.applied_config(restored).expert_input_policy == "error"


def test_the_sequential_root_is_left_alone():
    model = _moe_mlp()
    before = set(vars(model))
    ql.quantize(model, ql.FP8_DEFAULT_CFG, lambda m: m(torch.randn(4, 32)))
    assert set(vars(model)) - {"quant_coverage"} == before and not hasattr(model, "_quantlib_config")


def _count(monkeypatch, module, name) -> list:
    calls = []
    real = getattr(module, name)

    def counting(*args, **kwargs):
        calls.append(args[:1])
        return real(*args, **kwargs)

    monkeypatch.setattr(module, name, counting)
    return calls


@pytest.mark.parametrize("algorithm", ["max", {"method": "smoothquant", "alpha": 0.5}, None])
def test_quantize_parses_its_config_once(monkeypatch, algorithm, make_model, make_data, make_loop):
    cfg = copy.deepcopy(ql.INT8_DEFAULT_CFG)
    cfg["algorithm"] = algorithm
    model = make_model("mlp")
    loop = make_loop(make_data("mlp"))
    parses = _count(monkeypatch, qconfig, "parse_algorithm")
    configs = _count(monkeypatch, qconfig.QuantizeConfig, "__post_init__")
    bias_checks = _count(monkeypatch, mq, "check_bias_support")
    ql.quantize(model, cfg, loop)
    assert (len(configs), len(parses), len(bias_checks)) == (1, 1, 1)


def test_calibrate_parses_its_algorithm_once_and_reads_the_applied_settings(monkeypatch, make_model, make_data, make_loop):
    model = ql.quantize(make_model("mlp"), dict(ql.INT8_DEFAULT_CFG, expert_input_policy="skip"), make_loop(make_data("mlp")))
    parses = _count(monkeypatch, qconfig, "parse_algorithm")
    configs = _count(monkeypatch, qconfig.QuantizeConfig, "__post_init__")
    bias_checks = _count(monkeypatch, mq, "check_bias_support")
    seen = []
    real_runner = mq.runner

    def spy(method):
        fn = real_runner(method)
        return lambda m, algo, ctx: (seen.append((ctx.expert_input_policy, ctx.config)), fn(m, algo, ctx))

    monkeypatch.setattr(mq, "runner", spy)
    ql.calibrate(model, {"method": "max"}, make_loop(make_data("mlp")))
    assert (len(configs), len(parses), len(bias_checks)) == (0, 1, 1)
    assert seen == [("skip", mq.applied_config(model))]
