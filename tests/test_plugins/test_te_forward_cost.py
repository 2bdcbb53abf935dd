"""What a no-grad forward of a quantized TE GroupedLinear stand-in runs: the fake-quantized weights are
reused (W4A8's SequentialQuantizer members included), so the second forward fake-quantizes only the
input; and the per-forward checks do not walk the module through ``named_modules``."""

from __future__ import annotations

import collections

import pytest
import torch
from torch import nn

import quantlib as ql
from quantlib.kernels import ops

from .test_transformer_engine import _batches, _loop, grouped, registered  # noqa: F401  (fixtures)


@pytest.fixture
def fq_calls(monkeypatch):
    """Counter of fake-quant implementation calls by (format kind, input shape)."""
    calls: collections.Counter = collections.Counter()
    real = ops.select

    def counting(op, backend, device):
        fn = real(op, backend, device)
        if op != "fake_quant":
            return fn

        def call(x, spec, *args):
            calls[(spec.kind.value, tuple(x.shape))] += 1
            return fn(x, spec, *args)

        return call

    monkeypatch.setattr(ops, "select", counting)
    return calls


W4A8_MAX = dict(ql.W4A8_AWQ_BETA_CFG, algorithm="max")


@pytest.mark.parametrize("cfg", [ql.INT8_DEFAULT_CFG, W4A8_MAX, ql.FP8_DEFAULT_CFG], ids=["INT8", "W4A8", "FP8"])
def test_second_no_grad_forward_quantizes_only_the_input(grouped, fq_calls, cfg):
    cls, _, _ = grouped
    data = _batches()
    model = ql.quantize(cls(4, 16, 8), cfg, _loop(data)).eval()
    x, s = data[0]
    with torch.no_grad():
        first = model(x, s)
        fq_calls.clear()
        second = model(x, s)
    assert torch.equal(first, second)
    assert dict(fq_calls) == {(model.input_quantizer.spec.kind.value, tuple(x.shape)): 1}


def test_qat_forward_then_no_grad_forward_reuses_weights(grouped, fq_calls):
    cls, _, _ = grouped
    data = _batches()
    model = ql.quantize(cls(4, 16, 8), W4A8_MAX, _loop(data))
    x, s = data[0]
    model.train()
    model(x.clone().requires_grad_(True), s).sum().backward()
    model.eval()
    with torch.no_grad():
        model(x, s)
        fq_calls.clear()
        model(x, s)
    assert sum(n for (_, shape), n in fq_calls.items() if shape != tuple(x.shape)) == 0


def test_forward_does_not_walk_named_modules(grouped, monkeypatch):
    cls, _, _ = grouped
    data = _batches()
    model = ql.quantize(cls(4, 16, 8), W4A8_MAX, _loop(data)).eval()
    x, s = data[0]
    with torch.no_grad():
        model(x, s)

    def walked(*args, **kwargs):
        raise AssertionError("named_modules walked in a forward")

    monkeypatch.setattr(nn.Module, "named_modules", walked)
    with torch.no_grad():
        model(x, s)
    model.train()
    model(x.clone().requires_grad_(True), s).sum().backward()


def test_calibrating_check_sees_nested_and_disabled_quantizers(grouped):
    from quantlib.plugins.te_adapters import _calibrating

    cls, _, _ = grouped
    model = ql.quantize(cls(4, 16, 8), W4A8_MAX, _loop(_batches()))
    assert not _calibrating(model)
    member = model.weight_quantizer[2][1]  # inside a GroupedQuantizer of SequentialQuantizers
    member.enable_calib()
    assert _calibrating(model)
    member.disable()
    assert not _calibrating(model)  # a disabled quantizer does not count
    member.enable()
    member.disable_calib()
    member.disable_quant()
    assert _calibrating(model)
