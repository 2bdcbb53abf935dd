"""nn.LayerNorm is quantized as ModelOpt 0.47 quantizes it (an input quantizer), so its presets enable the
same quantizers in both libraries and give the same outputs; classes ModelOpt converts and quantlib does
not are named in a warning where the config would quantize them."""

from __future__ import annotations

import copy
import logging

import pytest
import torch
from torch import nn

import quantlib as ql
from quantlib.model_quant import iter_leaf_quantizers

mtq = pytest.importorskip("modelopt.torch.quantization")
transformers = pytest.importorskip("transformers")
from modelopt.torch.quantization.nn import TensorQuantizer as ModelOptQuantizer  # noqa: E402
from transformers import GPTNeoXConfig, GPTNeoXForCausalLM, OPTConfig, OPTForCausalLM  # noqa: E402


def neox() -> nn.Module:
    torch.manual_seed(0)
    cfg = GPTNeoXConfig(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64, max_position_embeddings=64)
    return GPTNeoXForCausalLM(cfg).eval()


def opt() -> nn.Module:
    torch.manual_seed(0)
    cfg = OPTConfig(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, ffn_dim=64, max_position_embeddings=64, word_embed_proj_dim=32)
    return OPTForCausalLM(cfg).eval()


MODELS = {"gpt_neox": neox, "opt": opt}
BATCH = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(1))


def loop(model: nn.Module) -> None:
    model(BATCH)


def modelopt_enabled(model: nn.Module) -> set[str]:
    return {n for n, m in model.named_modules() if isinstance(m, ModelOptQuantizer) and m.is_enabled}


def quantlib_enabled(model: nn.Module) -> set[str]:
    return {n for n, q in iter_leaf_quantizers(model) if q.is_enabled}


@pytest.mark.parametrize("name", sorted(MODELS))
def test_int8_default_quantizes_what_modelopt_quantizes(name):
    model = MODELS[name]()
    theirs = mtq.quantize(copy.deepcopy(model), copy.deepcopy(mtq.INT8_DEFAULT_CFG), loop)
    ours = ql.quantize(copy.deepcopy(model), copy.deepcopy(ql.INT8_DEFAULT_CFG), loop)
    assert any("layernorm" in n or "layer_norm" in n for n in quantlib_enabled(ours))
    assert quantlib_enabled(ours) == modelopt_enabled(theirs)
    with torch.no_grad():
        assert torch.equal(ours(BATCH).logits, theirs(BATCH).logits)


def test_layernorm_input_amax_is_its_input_max():
    model = ql.quantize(neox(), ql.INT8_DEFAULT_CFG, loop)
    norm = model.gpt_neox.final_layer_norm
    seen = []
    handle = norm.register_forward_pre_hook(lambda _, args: seen.append(args[0].abs().amax()))
    with torch.no_grad():
        ql.disable_quantizer(model, "*")
        loop(model)
    handle.remove()
    assert torch.equal(norm.input_quantizer.amax.reshape(()), seen[0].float())


@pytest.mark.parametrize("algo", ["smoothquant", "awq_lite"])
def test_searches_leave_layernorm_at_max_calibration(algo):
    cfg = {**ql.INT8_SMOOTHQUANT_CFG, "algorithm": algo} if algo == "smoothquant" else {**ql.W4A8_AWQ_BETA_CFG, "algorithm": algo}
    model = ql.quantize(neox(), cfg, loop)
    norm = model.gpt_neox.layers[0].input_layernorm
    assert norm.input_quantizer.is_enabled and norm.input_quantizer.amax is not None
    assert norm.input_quantizer.pre_quant_scale is None


def test_classes_modelopt_converts_and_quantlib_does_not_are_named(make_model, make_data, make_loop, caplog):
    model = make_model("conv")  # Conv2d, BatchNorm2d, ReLU, Conv2d, AdaptiveAvgPool2d, Linear
    theirs = mtq.quantize(copy.deepcopy(model), copy.deepcopy(mtq.INT8_DEFAULT_CFG), make_loop(make_data("conv")))
    with caplog.at_level(logging.WARNING, logger="quantlib"):
        ours = ql.quantize(model, ql.INT8_DEFAULT_CFG, make_loop(make_data("conv")))
    only_theirs = modelopt_enabled(theirs) - quantlib_enabled(ours)
    assert only_theirs == {"pool.input_quantizer"}  # the preset's nn.BatchNorm2d rule turns bn's off in both
    assert "1 nn.AdaptiveAvgPool2d module(s) ['pool'] stay in full precision: ModelOpt would quantize them" in caplog.text
    assert "BatchNorm2d" not in caplog.text


def test_no_warning_where_the_config_leaves_those_classes_off(make_model, make_data, make_loop, caplog):
    with caplog.at_level(logging.WARNING, logger="quantlib"):
        weights_only = {"quant_cfg": {"default": {"enable": False}, "*weight_quantizer": {"num_bits": 8, "axis": 0}}, "algorithm": "max"}
        ql.quantize(make_model("conv"), weights_only, make_loop(make_data("conv")))
    assert "ModelOpt would quantize" not in caplog.text


def test_export_writes_a_quantized_layernorm_unquantized_and_names_it(tmp_path, caplog):
    from quantlib.export import export_checkpoint

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 64), nn.LayerNorm(64), nn.Linear(64, 32))
    model = ql.quantize(model, ql.FP8_DEFAULT_CFG, lambda m: m(torch.randn(4, 64)))
    assert model[1].input_quantizer.is_enabled
    with caplog.at_level(logging.WARNING, logger="quantlib"):
        man = export_checkpoint(model, tmp_path / "c", "modelopt_fp8")
    assert man.quantized_modules == ["0", "2"] and man.unquantized_modules == ["1"]
    assert "the quantized inputs of 1 input-only module(s) ['1'] are written unquantized" in caplog.text
