"""GPT-2's ``Conv1D`` (weight stored (in, out)) is quantized per output channel by every preset, and a
config that leaves weights unquantized without naming them says so (real tiny GPT-2 and Qwen3-MoE)."""

from __future__ import annotations

import copy
import logging

import pytest
import torch

T = pytest.importorskip("transformers", reason="needs transformers (pip install quantlib[transformers])")
from transformers.pytorch_utils import Conv1D  # noqa: E402

import quantlib as ql  # noqa: E402
from quantlib.nn import QuantModule, TensorQuantizer  # noqa: E402
from quantlib.plugins import huggingface as hf  # noqa: E402


@pytest.fixture(autouse=True)
def _plugin_sees_the_modeling_modules():
    hf.refresh()


def gpt2(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return T.GPT2LMHeadModel(T.GPT2Config(vocab_size=64, n_positions=64, n_embd=32, n_layer=2, n_head=4)).eval()


def ids(seed: int = 0) -> torch.Tensor:
    return torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(seed))


def conv1ds(model) -> list:
    return [(n, m) for n, m in model.named_modules() if isinstance(m, Conv1D)]


@pytest.mark.parametrize("preset", ["INT8_WEIGHT_ONLY_CFG", "INT8_DEFAULT_CFG", "FP8_DEFAULT_CFG", "NVFP4_DEFAULT_CFG",
                                    "INT4_BLOCKWISE_WEIGHT_ONLY_CFG", "MXFP8_DEFAULT_CFG"])
def test_gpt2_presets_quantize_every_conv1d(preset):
    model = ql.quantize(gpt2(), getattr(ql, preset), lambda m: m(ids(1)))
    layers = conv1ds(model)
    assert len(layers) == 8  # c_attn, c_proj, c_fc, mlp.c_proj per block
    for name, m in layers:
        assert isinstance(m, QuantModule) and m.weight_quantizer.is_enabled, name
    assert model.quant_coverage.silent == {} and model.quant_coverage.quantized > 0
    with torch.no_grad():
        assert torch.isfinite(model(ids(2)).logits).all()


def test_gpt2_conv1d_weight_amax_is_per_output_channel_and_output_matches_by_hand():
    original = gpt2()
    model = ql.quantize(copy.deepcopy(original), ql.INT8_WEIGHT_ONLY_CFG)
    attn = model.transformer.h[0].attn.c_attn  # weight (in=32, out=96)
    assert attn.weight_quantizer.amax.shape == (96, 1)
    assert torch.equal(attn.weight_quantizer.amax.flatten(), attn.weight.detach().abs().amax(dim=0))
    ref = copy.deepcopy(original)
    with torch.no_grad():
        for (_, q), (_, r) in zip(conv1ds(model), conv1ds(ref)):
            r.weight.copy_(TensorQuantizer(q.weight_quantizer.attrs)(r.weight.t().contiguous()).t())
        assert torch.equal(model(ids(3)).logits, ref(ids(3)).logits)
        assert not torch.equal(model(ids(3)).logits, original(ids(3)).logits)


def test_gpt2_with_every_quantizer_off_is_the_original():
    original = gpt2()
    model = ql.quantize(copy.deepcopy(original), {"quant_cfg": {"default": {"enable": False}}, "algorithm": None})
    with torch.no_grad():
        assert torch.equal(model(ids(4)).logits, original(ids(4)).logits)


def test_misspelled_weight_pattern_is_reported(caplog):
    cfg = {"quant_cfg": {"*wieght_quantizer": {"num_bits": 8, "axis": 0}, "*input_quantizer": {"num_bits": 8, "axis": None},
                         "default": {"enable": False}}, "algorithm": "max"}
    with caplog.at_level(logging.WARNING, logger="quantlib"):
        model = ql.quantize(gpt2(), cfg, lambda m: m(ids(1)))
    cov = model.quant_coverage
    assert cov.unmatched_patterns == ["*wieght_quantizer"]
    assert cov.quantized == 0 and cov.silent_share == 1.0
    assert "*wieght_quantizer" in caplog.text and "100.0% of the weight elements" in caplog.text


def test_qwen3_moe_routers_disabled_by_the_preset_are_not_silent(caplog):
    cfg = T.Qwen3MoeConfig(vocab_size=64, hidden_size=32, intermediate_size=48, moe_intermediate_size=16, num_hidden_layers=2,
                           num_attention_heads=4,
                           num_key_value_heads=2, head_dim=8, num_experts=4, num_experts_per_tok=2,
                           experts_implementation="eager")  # fmt: skip
    torch.manual_seed(0)
    with caplog.at_level(logging.WARNING, logger="quantlib"):
        model = ql.quantize(T.Qwen3MoeForCausalLM(cfg).eval(), ql.NVFP4_DEFAULT_CFG, lambda m: m(ids(1)))
    cov = model.quant_coverage
    assert cov.silent == {} and "stay unquantized" not in caplog.text
    assert sorted(cov.disabled) == ["lm_head", "model.layers.0.mlp.gate", "model.layers.1.mlp.gate"]
    assert ql.weight_coverage(model) == cov
