"""torch.compile(fullgraph=True) of quantized modules: no graph break for any preset, outputs (and QAT
gradients) equal to eager. Graph capture is checked with the cheap "aot_eager" backend for every preset
(it also runs the fake kernels and the autograd registration of the ops); a few presets covering every
op family are compiled for real with inductor."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import quantlib as ql
from quantlib.presets import SCOPED_PRESETS

pytestmark = pytest.mark.slow

INDUCTOR_PRESETS = ["INT8_DEFAULT_CFG", "FP8_BLOCKWISE_CFG", "NVFP4_DEFAULT_CFG", "MXFP4_DEFAULT_CFG", "W4A8_AWQ_BETA_CFG"]


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()  # every test starts below the recompile limit
    yield
    torch._dynamo.reset()


def quantized_linear(name: str, calibrate: bool = True) -> nn.Module:
    torch.manual_seed(0)
    data = [torch.randn(4, 64) for _ in range(2)]
    loop = (lambda m: [m(x) for x in data]) if calibrate else None
    return ql.quantize(nn.Linear(64, 48), ql.PRESETS[name], loop)


def probe() -> torch.Tensor:
    return torch.randn(5, 64, generator=torch.Generator().manual_seed(3))


@pytest.mark.parametrize("name", sorted(set(ql.PRESETS) - set(SCOPED_PRESETS)))  # scoped ones leave a bare Linear alone
def test_no_graph_break_and_eager_equal_outputs(name):
    lin = quantized_linear(name)
    x = probe()
    with torch.no_grad():
        explained = torch._dynamo.explain(lin)(x)
        assert (explained.graph_count, explained.graph_break_count) == (1, 0), explained.break_reasons
        compiled = torch.compile(lin, fullgraph=True, backend="aot_eager")
        out = compiled(x)
        assert torch.equal(out, lin(x))
        assert not torch.equal(out, nn.functional.linear(x, lin.weight, lin.bias))


@pytest.mark.parametrize("name", INDUCTOR_PRESETS)
def test_inductor_compile_equals_eager(name):
    lin = quantized_linear(name)
    x = probe()
    with torch.no_grad():
        compiled = torch.compile(lin, fullgraph=True)
        assert torch.equal(compiled(x), lin(x))


@pytest.mark.parametrize("name", ["INT8_DEFAULT_CFG", "FP8_PER_CHANNEL_PER_TOKEN_CFG", "INT4_BLOCKWISE_WEIGHT_ONLY_CFG",
                                  "W4A8_AWQ_BETA_CFG"])
def test_qat_backward_compiles_and_matches_eager(name):
    lin = quantized_linear(name).train()
    x = probe().requires_grad_()
    compiled = torch.compile(lin, fullgraph=True, backend="aot_eager")
    out = compiled(x)
    out.square().sum().backward()
    grads = (x.grad.clone(), lin.weight.grad.clone())
    x.grad, lin.weight.grad, lin.bias.grad = None, None, None
    ref = lin(x)
    ref.square().sum().backward()
    assert torch.equal(out, ref)
    assert torch.equal(grads[0], x.grad) and torch.equal(grads[1], lin.weight.grad)


def test_uncalibrated_static_quantizer_compiles():
    lin = quantized_linear("INT8_DEFAULT_CFG", calibrate=False)  # input amax computed from each input
    x = probe()
    with torch.no_grad():
        assert torch.equal(torch.compile(lin, fullgraph=True, backend="aot_eager")(x), lin(x))


def test_recalibrated_amax_reaches_the_compiled_module():
    lin = quantized_linear("INT8_DEFAULT_CFG")
    compiled = torch.compile(lin, fullgraph=True, backend="aot_eager")
    x = probe()
    with torch.no_grad():
        before = compiled(x)
        lin.input_quantizer.amax = lin.input_quantizer.amax / 4  # a new buffer
        after = compiled(x)
        assert not torch.equal(before, after)
        assert torch.equal(after, lin(x))
        lin.input_quantizer._amax.mul_(2)  # in place
        assert torch.equal(compiled(x), lin(x))


def test_disabled_quantizer_compiles_to_the_plain_linear():
    lin = quantized_linear("FP8_DEFAULT_CFG")
    ql.disable_quantizer(lin, "*")
    x = probe()
    with torch.no_grad():
        assert torch.equal(torch.compile(lin, fullgraph=True, backend="aot_eager")(x), nn.functional.linear(x, lin.weight, lin.bias))


@pytest.mark.parametrize("name", ["INT8_DEFAULT_CFG", "NVFP4_DEFAULT_CFG"])
def test_quantized_conv_net_compiles(name, make_model, make_data, make_loop):
    model = ql.quantize(make_model("conv"), ql.PRESETS[name], make_loop(make_data("conv")))
    x = make_data("conv", 1, seed=5)[0]
    with torch.no_grad():
        assert torch.equal(torch.compile(model, fullgraph=True, backend="aot_eager")(x), model(x))
