"""Where a ModelOpt preset quantizes modules of classes quantlib does not convert (nn.LayerNorm's input under
``*input_quantizer``, pools, ...), quantize() names them in a warning: the enabled quantizers differ from
ModelOpt's by exactly the modules it names, and the rest matches (same names, same outputs without them)."""

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
    cfg = GPTNeoXConfig(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
                        max_position_embeddings=64)
    return GPTNeoXForCausalLM(cfg).eval()


def opt() -> nn.Module:
    torch.manual_seed(0)
    cfg = OPTConfig(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, ffn_dim=64, max_position_embeddings=64,
                    word_embed_proj_dim=32)
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
def test_int8_default_differs_from_modelopt_only_by_the_layernorms_it_names(name, caplog):
    model = MODELS[name]()
    theirs = mtq.quantize(copy.deepcopy(model), copy.deepcopy(mtq.INT8_DEFAULT_CFG), loop)
    with caplog.at_level(logging.WARNING, logger="quantlib"):
        ours = ql.quantize(copy.deepcopy(model), copy.deepcopy(ql.INT8_DEFAULT_CFG), loop)
    norms = [n for n, m in model.named_modules() if isinstance(m, nn.LayerNorm)]
    assert modelopt_enabled(theirs) - quantlib_enabled(ours) == {f"{n}.input_quantizer" for n in norms}
    assert quantlib_enabled(ours) <= modelopt_enabled(theirs)
    assert f"{len(norms)} nn.LayerNorm module(s) {norms[:5]} stay in full precision: ModelOpt would quantize them" in caplog.text
    # with ModelOpt's LayerNorm quantizers off too, both compute the same
    mtq.disable_quantizer(theirs, lambda n: any(n == f"{m}.input_quantizer" for m in norms))
    with torch.no_grad():
        assert torch.equal(ours(BATCH).logits, theirs(BATCH).logits)


def test_pool_named_and_batchnorm_not_when_the_preset_disables_it(make_model, make_data, make_loop, caplog):
    model = make_model("conv")  # Conv2d, BatchNorm2d, ReLU, Conv2d, AdaptiveAvgPool2d, Linear
    theirs = mtq.quantize(copy.deepcopy(model), copy.deepcopy(mtq.INT8_DEFAULT_CFG), make_loop(make_data("conv")))
    with caplog.at_level(logging.WARNING, logger="quantlib"):
        ours = ql.quantize(model, ql.INT8_DEFAULT_CFG, make_loop(make_data("conv")))
    assert modelopt_enabled(theirs) - quantlib_enabled(ours) == {"pool.input_quantizer"}  # the preset's BatchNorm rule
    assert "1 nn.AdaptiveAvgPool2d module(s) ['pool'] stay in full precision: ModelOpt would quantize them" in caplog.text
    assert "BatchNorm2d" not in caplog.text


def test_no_warning_where_the_config_leaves_those_classes_off(make_model, make_data, make_loop, caplog):
    weights_only = {"quant_cfg": {"default": {"enable": False}, "*weight_quantizer": {"num_bits": 8, "axis": 0}}, "algorithm": "max"}
    with caplog.at_level(logging.WARNING, logger="quantlib"):
        ql.quantize(make_model("conv"), weights_only, make_loop(make_data("conv")))
    assert "ModelOpt would quantize" not in caplog.text
