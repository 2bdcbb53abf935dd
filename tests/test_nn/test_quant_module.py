"""QuantModule and QuantModuleRegistry: conversion keeps parameters (no copies), hooks and the meta
device; quantized Linear / Conv1d/2d/3d compute what their quantizers say; custom and grouped modules;
the cache of fake-quantized weights never serves a stale weight."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import quantlib as ql
from quantlib import GroupedQuantizer, QuantModule, QuantModuleRegistry, TensorQuantizer


def _params(model: nn.Module) -> dict[str, nn.Parameter]:
    return dict(model.named_parameters())


# ------------------------------------------------------------------------------------ conversion


def test_conversion_keeps_the_same_parameter_objects(make_model):
    model = make_model("conv")
    before = _params(model)
    ptrs = {n: p.data_ptr() for n, p in before.items()}
    buffers = dict(model.named_buffers())
    converted = ql.quantize(model, ql.INT8_DEFAULT_CFG, None)
    after = _params(converted)
    assert list(after) == list(before)
    assert all(after[n] is before[n] for n in before)
    assert {n: p.data_ptr() for n, p in after.items()} == ptrs
    assert all(dict(converted.named_buffers())[n] is b for n, b in buffers.items())  # BatchNorm stats


def test_converted_classes_are_subclasses_of_the_originals(make_model):
    model = ql.convert(make_model("conv"))
    assert type(model.conv1).__name__ == "QuantConv2d" and isinstance(model.conv1, nn.Conv2d) and isinstance(model.conv1, QuantModule)
    assert type(model.head).__name__ == "QuantLinear" and isinstance(model.head, nn.Linear)
    assert type(model.bn) is nn.BatchNorm2d and type(model.act) is nn.ReLU  # not registered: untouched
    assert QuantModuleRegistry.original_class_of(model.head) is nn.Linear
    assert QuantModuleRegistry.quantized_class(nn.Linear) is type(model.head)  # built once


def test_conversion_is_idempotent(make_model):
    model = ql.convert(make_model("mlp"))
    q = model.fc1.weight_quantizer
    assert ql.convert(model) is model and model.fc1.weight_quantizer is q


def test_disabled_quantizers_give_the_original_output_exactly(make_model, make_data):
    model, ref = make_model("conv"), make_model("conv")
    ql.quantize(model, ql.INT8_DEFAULT_CFG, None)
    ql.disable_quantizer(model, "*")
    x = make_data("conv", 1)[0]
    assert torch.equal(model(x), ref(x))


def test_unquantized_state_dict_loads_into_a_converted_model(make_model):
    src = make_model("mlp", seed=3)
    dst = ql.convert(make_model("mlp"))
    dst.load_state_dict(src.state_dict())
    assert all(torch.equal(p, _params(src)[n]) for n, p in _params(dst).items())


def test_conversion_on_the_meta_device(model_classes):
    with torch.device("meta"):
        model = model_classes["mlp"]()
    before = _params(model)
    model = ql.quantize(model, ql.INT8_WEIGHT_ONLY_CFG, None)
    assert isinstance(model.fc1, QuantModule)
    assert all(_params(model)[n] is p and p.is_meta for n, p in before.items())
    amax = model.fc1.weight_quantizer.amax
    assert amax.is_meta and tuple(amax.shape) == (48, 1)
    assert "(48, 1)" in ql.quant_summary(model)
    out = model(torch.empty(2, 64, device="meta"))
    assert out.is_meta and tuple(out.shape) == (2, 16)


def test_meta_model_materialised_then_calibrated(model_classes, make_data, make_loop):
    with torch.device("meta"):
        model = model_classes["mlp"]()
    model = ql.convert(model)
    model.to_empty(device="cpu")
    with torch.no_grad():
        for p in model.parameters():
            p.normal_()
    ql.quantize(model, ql.INT8_DEFAULT_CFG, make_loop(make_data("mlp")))
    assert torch.equal(model.fc1.weight_quantizer.amax, model.fc1.weight.abs().amax(1, keepdim=True))


def test_forward_hooks_are_kept_and_their_handles_still_remove_them(make_model):
    model = make_model("mlp")
    calls = []
    pre = model.fc1.register_forward_pre_hook(lambda m, args: calls.append(("pre", type(m).__name__)))
    post = model.fc1.register_forward_hook(lambda m, args, out: calls.append(("post", tuple(out.shape))))
    ql.quantize(model, ql.INT8_DEFAULT_CFG, None)
    model(torch.randn(2, 64))
    assert calls == [("pre", "QuantLinear"), ("post", (2, 48))]
    pre.remove()
    post.remove()
    calls.clear()
    model(torch.randn(2, 64))
    assert calls == []


def test_root_module_conversion():
    torch.manual_seed(0)
    lin = nn.Linear(64, 16)
    weight = lin.weight
    q = ql.quantize(lin, ql.INT8_WEIGHT_ONLY_CFG, None)
    assert isinstance(q, QuantModule) and q.weight is weight
    assert torch.equal(q.weight_quantizer.amax, weight.abs().amax(1, keepdim=True))
    x = torch.randn(3, 64)
    assert torch.equal(q(x), F.linear(x, TensorQuantizer({"num_bits": 8, "axis": 0})(weight), lin.bias))


# ------------------------------------------------------------------------------------ quantized modules

CONVS = {
    "conv1d": (nn.Conv1d(4, 6, 3, padding=1), (2, 4, 10), F.conv1d),
    "conv2d": (nn.Conv2d(4, 6, 3, stride=2), (2, 4, 9, 9), F.conv2d),
    "conv3d": (nn.Conv3d(4, 6, 2), (1, 4, 5, 5, 5), F.conv3d),
}


@pytest.mark.parametrize("name", sorted(CONVS))
def test_quantized_conv_computes_conv_of_quantized_input_and_weight(name):
    torch.manual_seed(0)
    conv, shape, fn = CONVS[name]
    x = torch.randn(*shape)
    q = ql.quantize(conv, ql.INT8_DEFAULT_CFG, lambda m: m(x))
    w_amax = conv.weight.abs().amax(dim=tuple(range(1, conv.weight.dim())), keepdim=True)
    assert torch.equal(q.weight_quantizer.amax, w_amax)  # per output channel
    assert torch.equal(q.input_quantizer.amax, x.abs().amax())
    xq = TensorQuantizer({"num_bits": 8}, amax=x.abs().amax())(x)
    wq = TensorQuantizer({"num_bits": 8, "axis": 0}, amax=w_amax)(conv.weight)
    expected = fn(xq, wq, conv.bias, conv.stride, conv.padding, conv.dilation, conv.groups)
    assert torch.equal(q(x), expected)
    assert not torch.equal(q(x), fn(x, conv.weight, conv.bias, conv.stride, conv.padding))


def test_quantized_linear_applies_the_output_quantizer():
    torch.manual_seed(0)
    lin = ql.quantize(nn.Linear(8, 4), {"quant_cfg": {"*output_quantizer": {"num_bits": 4}, "default": {"enable": False}}}, None)
    x = torch.randn(5, 8)
    assert torch.equal(lin(x), TensorQuantizer({"num_bits": 4})(F.linear(x, lin.weight, lin.bias)))


# ------------------------------------------------------------------------------------ registry


class Scale(nn.Module):
    """y = x * w (elementwise over the last dim)."""

    def __init__(self, n: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.linspace(-2.0, 3.0, n))

    def forward(self, x):
        return x * self.weight


@pytest.fixture
def registered():
    class _QuantScale(QuantModule):
        def forward(self, x):
            return self.output_quantizer(self.input_quantizer(x) * self.quantize_weight(self.weight))

    QuantModuleRegistry.register(Scale, "Scale")(_QuantScale)
    yield
    QuantModuleRegistry.unregister(Scale)


def test_register_a_custom_module(registered):
    model = nn.Sequential(Scale(4), nn.Linear(4, 2))
    model = ql.quantize(model, ql.INT8_WEIGHT_ONLY_CFG, None)
    assert type(model[0]).__name__ == "QuantScale" and isinstance(model[0], Scale)
    assert torch.equal(model[0].weight_quantizer.amax, model[0].weight.detach().abs())  # axis 0 of a 1-D weight
    x = torch.ones(1, 4)
    assert torch.equal(model[0](x), x * TensorQuantizer({"num_bits": 8, "axis": 0})(model[0].weight))


def test_unregister_leaves_the_class_alone(registered):
    QuantModuleRegistry.unregister(Scale)
    assert not QuantModuleRegistry.is_registered(Scale)
    model = ql.convert(nn.Sequential(Scale(4)))
    assert type(model[0]) is Scale


def test_register_requires_a_quant_module_mixin():
    with pytest.raises(TypeError, match="QuantModule"):
        QuantModuleRegistry.register(Scale)(type("NotAMixin", (nn.Module,), {}))
    assert not QuantModuleRegistry.is_registered(Scale)


def test_grouped_weight_members_calibrate_on_their_own_weight(two_experts):
    model = ql.quantize(nn.Sequential(two_experts()), ql.INT8_DEFAULT_CFG, lambda m: m(torch.randn(2, 8)))
    q = model[0].weight_quantizer
    assert isinstance(q, GroupedQuantizer) and [m.num_bits for m in q] == [8, 8]
    assert torch.equal(q[0].amax, model[0].w0.abs().amax(1, keepdim=True))
    assert torch.equal(q[1].amax, model[0].w1.abs().amax(1, keepdim=True))
    assert not torch.equal(q[0].amax, q[1].amax)
    x = torch.randn(3, 8)
    xq = model[0].input_quantizer(x)
    assert torch.equal(model[0](x, 1), F.linear(xq, q[1](model[0].w1)))
    assert [leaf._qname for leaf in q] == ["0.weight_quantizer.0", "0.weight_quantizer.1"]
    assert "0.weight_quantizer.1" in ql.quant_summary(model)


def test_grouped_members_follow_the_containers_pattern(two_experts):
    cfg = {"quant_cfg": {"*weight_quantizer": {"num_bits": 4, "axis": 0}, "*weight_quantizer.1": {"num_bits": 8},
                         "default": {"enable": False}}}
    model = ql.quantize(nn.Sequential(two_experts()), cfg, None)
    assert [m.num_bits for m in model[0].weight_quantizer] == [4, 4]  # members are matched by the container's name


# ------------------------------------------------------------------------------------ weight cache


def _fresh_reference(lin: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return F.linear(lin.input_quantizer(x), lin.weight_quantizer(lin.weight), lin.bias)


def test_cache_never_serves_a_weight_quantized_with_a_replaced_amax():
    """Replacing an amax several times between forwards must never hit an entry of an older amax
    (object ids are reused once the old tensors are freed)."""
    torch.manual_seed(0)
    lin = ql.quantize(nn.Linear(64, 16), ql.INT8_WEIGHT_ONLY_CFG, None)
    x = torch.randn(4, 64)
    q = lin.weight_quantizer
    with torch.no_grad():
        for i in range(60):
            q.amax = torch.full((16, 1), 0.01 * (i % 7 + 1))
            lin(x)
            q.amax = torch.full((16, 1), 1.0)
            q.amax = torch.full((16, 1), 2.0)
            q.amax = torch.full((16, 1), 0.03 * (i % 5 + 1))
            assert torch.equal(lin(x), _fresh_reference(lin, x)), i


def test_cache_never_serves_a_weight_of_a_replaced_quantizer(make_model):
    torch.manual_seed(0)
    model = ql.quantize(nn.Sequential(nn.Linear(64, 16)), ql.INT8_WEIGHT_ONLY_CFG, None)
    x = torch.randn(4, 64)
    states = [ql.quantizer_state(model)]
    with torch.no_grad():
        for scale in (0.5, 2.0, 0.25):
            model[0].weight_quantizer.amax = model[0].weight_quantizer.amax * scale
            states.append(ql.quantizer_state(model))
        for i in range(20):
            ql.restore_state(model, states[i % 4])
            model(x)
            ql.restore_state(model, states[(i + 1) % 4])
            ql.restore_state(model, states[(i + 2) % 4])
            assert torch.equal(model(x), _fresh_reference(model[0], x)), i


def test_quantize_and_forward_under_inference_mode(make_model, make_data, make_loop):
    model = make_model("mlp")
    x = make_data("mlp", 1)[0]
    with torch.inference_mode():
        ql.quantize(model, ql.INT8_DEFAULT_CFG, make_loop(make_data("mlp")))
        y1 = model(x)
        y2 = model(x)
    assert torch.equal(y1, y2)
    with torch.no_grad():
        assert torch.equal(model(x), y1)


def test_cache_sees_in_place_writes_through_no_grad():
    torch.manual_seed(0)
    lin = ql.quantize(nn.Linear(64, 16), ql.INT8_WEIGHT_ONLY_CFG, None)
    x = torch.randn(4, 64)
    with torch.no_grad():
        before = lin(x)
        lin.weight.mul_(0.5)
        lin.weight_quantizer.calibrate(lin.weight)
        after = lin(x)
    assert not torch.equal(before, after)
    assert torch.equal(after, _fresh_reference(lin, x))


@pytest.mark.xfail(strict=True, reason="weight cache: writes through .data do not bump the version counter the cache keys on")
def test_cache_sees_in_place_writes_through_data():
    torch.manual_seed(0)
    lin = ql.quantize(nn.Linear(64, 16), ql.INT8_WEIGHT_ONLY_CFG, None)
    x = torch.randn(4, 64)
    with torch.no_grad():
        before = lin(x)
        lin.weight.data.mul_(0.5)
        after = lin(x)
    assert not torch.equal(before, after)


class Gated(nn.Module):
    """A registered module with a registered child of its own (``proj``) and a shared child used twice."""

    def __init__(self) -> None:
        super().__init__()
        self.gate = nn.Parameter(torch.ones(8))
        self.proj = nn.Linear(8, 8)

    def forward(self, x):
        return self.proj(x) * self.gate


@pytest.fixture
def gated():
    class _QuantGated(QuantModule):
        quantizer_names = ("input_quantizer",)
        weight_quantizer_names = ()

        def _setup(self):
            self.input_quantizer = TensorQuantizer({"num_bits": 8})

        def weight_groups(self):
            return iter(())

        def forward(self, x):
            return super().forward(self.input_quantizer(x))

    QuantModuleRegistry.register(Gated, "Gated")(_QuantGated)
    yield Gated
    QuantModuleRegistry.unregister(Gated)


def test_registered_children_of_a_registered_module_are_converted(gated):
    model = ql.convert(nn.Sequential(gated(), nn.ReLU()))
    assert isinstance(model[0], QuantModule) and isinstance(model[0].proj, QuantModule)
    root = ql.convert(gated())
    assert isinstance(root, QuantModule) and isinstance(root.proj, QuantModule)
    names = [n for n, _, _, _ in ql.model_quant.iter_quantizers(model)]
    assert sorted(names) == ["0.input_quantizer", "0.proj.input_quantizer", "0.proj.output_quantizer", "0.proj.weight_quantizer"]


def test_a_module_used_twice_is_converted_once():
    shared = nn.Linear(8, 8)
    model = ql.convert(nn.Sequential(shared, nn.ReLU(), shared))
    assert isinstance(model[0], QuantModule) and model[0] is model[2]
    ql.quantize(model, ql.INT8_DEFAULT_CFG, lambda m: m(torch.randn(2, 8)))
    assert [n for n, _ in ql.model_quant.iter_leaf_quantizers(model)] == ["0.input_quantizer", "0.weight_quantizer", "0.output_quantizer"]


@pytest.mark.parametrize(
    "role, expected",
    [
        ("replicated", {"weight_quantizer": (None, 0), "input_quantizer": (None, 0), "output_quantizer": (None, 0)}),
        ("column", {"weight_quantizer": (0, 48), "input_quantizer": (None, 0), "output_quantizer": (-1, 48)}),
        ("row", {"weight_quantizer": (1, 64), "input_quantizer": (-1, 64), "output_quantizer": (None, 0)}),
    ],
)
def test_tp_split_follows_the_parallel_role(role, expected):
    """What the amax sync and the checkpoints read as the split of each quantized tensor (local [48, 64] weight)."""
    m = ql.convert(nn.Sequential(nn.Linear(64, 48)))[0]
    m.parallel_role = role
    assert {q: m.tp_split(q) for q in expected} == expected
