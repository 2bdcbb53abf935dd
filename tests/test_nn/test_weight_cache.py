"""The cache of fake-quantized weights: reused while nothing changed, invalidated by every change."""

import pytest
import torch
from torch import nn

import quantlib as ql


def _quantized_linear(cfg=ql.INT8_WEIGHT_ONLY_CFG) -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 32))
    return ql.quantize(model, cfg, lambda m: m(torch.randn(4, 64))).eval()


def _count_weight_quant_calls(layer) -> list:
    calls = []
    layer.weight_quantizer.register_forward_hook(lambda *_: calls.append(1))
    return calls


def test_cache_reuses_quantized_weight_in_eval():
    model = _quantized_linear()
    calls = _count_weight_quant_calls(model[0])
    x = torch.randn(3, 64)
    with torch.no_grad():
        a, b = model(x), model(x)
    assert torch.equal(a, b)
    assert len(calls) == 1


def test_optimizer_step_invalidates():
    model = _quantized_linear()
    calls = _count_weight_quant_calls(model[0])
    x = torch.randn(3, 64)
    with torch.no_grad():
        before = model(x)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    model.train()
    model(x).square().sum().backward()
    opt.step()
    model.eval()
    with torch.no_grad():
        after = model(x)
    expected = nn.functional.linear(x, ql.kernels.fake_quant(model[0].weight.detach(), model[0].weight_quantizer.attrs,
                                                             model[0].weight_quantizer.amax), model[0].bias)
    assert not torch.equal(before, after)
    assert torch.equal(after, expected)
    assert len(calls) == 3  # eval, train (grad: never cached), eval again


def test_load_state_dict_invalidates():
    model = _quantized_linear()
    x = torch.randn(3, 64)
    with torch.no_grad():
        model(x)
    sd = {k: v.clone() for k, v in model.state_dict().items()}
    sd["0.weight"] = sd["0.weight"] * 0.5
    model.load_state_dict(sd)
    with torch.no_grad():
        out = model(x)
    wq = ql.kernels.fake_quant(sd["0.weight"], model[0].weight_quantizer.attrs, model[0].weight_quantizer.amax)
    assert torch.equal(out, nn.functional.linear(x, wq, model[0].bias))


def test_amax_change_invalidates():
    model = _quantized_linear()
    x = torch.randn(3, 64)
    with torch.no_grad():
        before = model(x)
        model[0].weight_quantizer.amax = model[0].weight_quantizer.amax * 4
        replaced = model(x)
        model[0].weight_quantizer._amax.mul_(0.5)  # in place: the buffer's version changes
        in_place = model(x)
    assert not torch.equal(before, replaced)
    assert not torch.equal(replaced, in_place)


def test_in_place_write_to_static_block_amax_invalidates():
    nvfp4_static = {"num_bits": (2, 1), "block_sizes": {-1: 16, "type": "static", "scale_bits": (4, 3)}}
    model = _quantized_linear(ql.presets.preset(nvfp4_static))
    q = model[0].weight_quantizer
    assert q.block_amax is not None
    x = torch.randn(3, 64)
    with torch.no_grad():
        before = model(x)
        q._block_amax.mul_(0.5)  # in place: only the block amax buffer's version changes
        after = model(x)
    wq = ql.kernels.fake_quant(model[0].weight.detach(), q.attrs, q.amax, block_amax=q.block_amax)
    assert not torch.equal(before, after)
    assert torch.equal(after, nn.functional.linear(x, wq, model[0].bias))


@pytest.mark.parametrize("change", ["config", "disable"])
def test_quantizer_config_change_invalidates(change):
    model = _quantized_linear()
    x = torch.randn(3, 64)
    with torch.no_grad():
        before = model(x)
        if change == "config":
            ql.quantize(model, ql.INT4_BLOCKWISE_WEIGHT_ONLY_CFG, lambda m: m(x))
        else:
            model[0].weight_quantizer.disable()
        after = model(x)
    assert not torch.equal(before, after)
    if change == "disable":
        assert torch.equal(after, nn.functional.linear(x, model[0].weight, model[0].bias))


def test_qat_gradients_flow_through_weight_quantizer():
    model = _quantized_linear()
    model.train()
    x = torch.randn(3, 64)
    model(x).sum().backward()
    w = model[0].weight
    inside = w.detach().abs() <= model[0].weight_quantizer.amax
    assert torch.equal(w.grad != 0, inside & (x.sum(0).abs() > 0).expand_as(w))


def test_clear_weight_cache_after_write_through_data():
    model = _quantized_linear()
    x = torch.randn(3, 64)
    with torch.no_grad():
        before = model(x)
        model[0].weight.data.mul_(0.25)  # bypasses the version counter
        assert ql.clear_weight_cache(model) == 1
        after = model(x)
    wq = ql.kernels.fake_quant(model[0].weight.detach(), model[0].weight_quantizer.attrs, model[0].weight_quantizer.amax)
    assert not torch.equal(before, after)
    assert torch.equal(after, nn.functional.linear(x, wq, model[0].bias))
