"""``pass_through_bwd``, ModelOpt's straight-through switch: True (its default, and quantlib's) passes
the gradient everywhere and keeps nothing for the backward; False zeroes it where ``|x| > amax``. Both
against ModelOpt 0.47's own quantizers, the config checks, and old checkpoints (schema 5, which always
clipped) restoring with the clipped backward."""

from __future__ import annotations

import copy
import os

import pytest
import torch
from torch import nn

import quantlib as ql
from quantlib import checkpoint as ckpt
from quantlib.config import ConfigError, QuantizerAttributeConfig
from tests._scripts import load_golden_writer

mtq = pytest.importorskip("modelopt.torch.quantization")
from modelopt.torch.quantization.config import QuantizerAttributeConfig as MoAttributeConfig  # noqa: E402
from modelopt.torch.quantization.nn import TensorQuantizer as MoTensorQuantizer  # noqa: E402

DATA = os.path.join(os.path.dirname(os.path.dirname(__file__)), "data")
# (name, attribute config, amax): a static amax well inside the data, so that clipping matters
CASES = [
    ("int8 per channel", {"num_bits": 8, "axis": 0}, torch.tensor([[0.5], [1.0], [2.0], [0.25]])),
    ("int4 per tensor", {"num_bits": 4, "axis": None}, torch.tensor(1.0)),
    ("fp8 per tensor", {"num_bits": (4, 3), "axis": None}, torch.tensor(1.5)),
]


def _input_grad(q: nn.Module, x: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
    x = x.clone().requires_grad_(True)
    q(x).backward(grad)
    return x.grad


@pytest.mark.parametrize("pass_through", [None, True, False], ids=["default", "true", "false"])
@pytest.mark.parametrize("name, cfg, amax", CASES, ids=[c[0] for c in CASES])
def test_gradient_equals_modelopts_quantizer(name, cfg, amax, pass_through):
    cfg = cfg if pass_through is None else {**cfg, "pass_through_bwd": pass_through}
    ours, theirs = ql.TensorQuantizer(cfg, amax=amax.clone()), MoTensorQuantizer(MoAttributeConfig(**cfg))
    theirs.amax = amax.clone()
    g = torch.Generator().manual_seed(0)
    x, grad = torch.randn(4, 64, generator=g) * 2, torch.randn(4, 64, generator=g)
    got, expected = _input_grad(ours, x, grad), _input_grad(theirs, x, grad)
    assert torch.equal(got, expected)
    clipped = (x.abs() > amax).any() and not torch.equal(got, grad)
    assert clipped == (pass_through is False)  # the default passes everywhere, as ModelOpt's


@pytest.mark.parametrize("pass_through", [True, False])
def test_qat_step_of_a_quantized_model_equals_modelopts(pass_through):
    # INT8_DEFAULT_CFG through both libraries' quantize(): same calibration, same weight and input gradients
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 16))
    calib, x = torch.randn(8, 32), torch.randn(16, 32) * 3  # beyond the calibrated input amax
    cfg = copy.deepcopy(mtq.INT8_DEFAULT_CFG)
    for entry in cfg["quant_cfg"]:
        if entry.get("quantizer_name") in ("*weight_quantizer", "*input_quantizer"):
            entry["cfg"] = {**entry["cfg"], "pass_through_bwd": pass_through}
    grads = []
    for quantize in (ql.quantize, mtq.quantize):
        m = quantize(copy.deepcopy(model), copy.deepcopy(cfg), lambda m: m(calib))
        xr = x.clone().requires_grad_(True)
        m(xr).square().sum().backward()
        grads.append([xr.grad] + [p.grad for p in m.parameters()])
    for ours, theirs in zip(*grads):
        assert torch.equal(ours, theirs)


def test_pass_through_saves_nothing_for_the_backward():
    x = torch.randn(8, 32, requires_grad=True)
    for pass_through, saved in ((True, 0), (False, 2)):
        q = ql.TensorQuantizer({"num_bits": 8, "axis": 0, "pass_through_bwd": pass_through}, amax=torch.full((8, 1), 0.5))
        assert len(q(x).grad_fn.saved_tensors) == saved


def test_non_bool_is_refused_by_name():
    with pytest.raises(ConfigError, match=r"pass_through_bwd must be a bool, got 'no'"):
        QuantizerAttributeConfig(num_bits=8, pass_through_bwd="no")
    assert QuantizerAttributeConfig.from_dict({"num_bits": 8, "pass_through_bwd": False}).pass_through_bwd is False


def test_schema_5_checkpoint_restores_with_the_clipped_backward():
    """The schema-5 golden file (written when every static quantizer clipped) migrates to
    pass_through_bwd=False everywhere, in the quantizers and in the saved config, and restores with the
    gradient it had then; a fresh save round-trips the field."""
    state = torch.load(os.path.join(DATA, "v5_mlp.pt"), weights_only=True)
    assert state["schema"] == 5 and ckpt.MIGRATIONS[5] is ckpt.migrate_v5_to_v6
    before = copy.deepcopy(state)
    v6 = ckpt.migrate_v5_to_v6(state)
    assert v6["schema"] == 6 and repr(state) == repr(before)  # input untouched
    attrs = [v6["quantizers"]["fc1.weight_quantizer"]["members"][i]["attrs"] for i in range(2)]
    attrs += [v6["quantizers"][n]["attrs"] for n in ("fc1.input_quantizer", "fc2.weight_quantizer", "fc2.input_quantizer",
                                                     "fc2.output_quantizer")]
    assert all(a["pass_through_bwd"] is False for a in attrs)
    cfgs = [item["cfg"] for item in v6["config"]["quant_cfg"] if item["cfg"] is not None]
    assert cfgs and all(c["pass_through_bwd"] is False for cfg in cfgs for c in (cfg if isinstance(cfg, list) else [cfg]))

    v2 = load_golden_writer(2)
    restored = ql.restore(v2.build(), os.path.join(DATA, "v5_mlp.pt"))
    q = restored.fc2.input_quantizer
    assert q.attrs.pass_through_bwd is False
    x = (q.amax * torch.linspace(-2, 2, 32)).repeat(2, 1)
    assert torch.equal(_input_grad(q, x, torch.ones_like(x)), (x.abs() <= q.amax).float())
    assert ql.model_quant.applied_config(restored).quant_cfg[-1].attrs.pass_through_bwd is False

    again = ckpt.restore_state(v2.build(), ckpt.quantizer_state(restored))
    assert again.fc2.input_quantizer.attrs.pass_through_bwd is False


def test_kernels_fake_quant_follows_the_configs_field():
    from quantlib import kernels

    x0, amax = torch.tensor([-2.0, 0.5, 1.5]), torch.tensor(1.0)
    for attrs, expected in (
        (QuantizerAttributeConfig(num_bits=8), [1.0, 1.0, 1.0]),
        (QuantizerAttributeConfig(num_bits=8, pass_through_bwd=False), [0.0, 1.0, 0.0]),
        (QuantizerAttributeConfig(num_bits=8).format_spec(), [0.0, 1.0, 0.0]),  # a FormatSpec has no field: clipped
    ):
        x = x0.clone().requires_grad_(True)
        kernels.fake_quant(x, attrs, amax).sum().backward()
        assert torch.equal(x.grad, torch.tensor(expected))
