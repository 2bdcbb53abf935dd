"""The Megatron sync on a TE-spec GPT on one GPU (TE's fused ``layer_norm_weight`` on ``linear_qkv`` / ``linear_fc1``, TE
linears in SequentialMLP experts): the TP1 stream packed on the GPU is, tensor for tensor, the Megatron file export
(gathered and packed on the CPU); TEGroupedMLP experts are refused by name. Skipped without a GPU, TE's binding or
Megatron-Core (TE cannot be imported on a CPU torch)."""

from __future__ import annotations

import os

import pytest
import torch

import quantlib as ql
from tests.test_plugins import te_gpu

pytestmark = [pytest.mark.gpu, pytest.mark.te, pytest.mark.megatron]
te_gpu.require_megatron_te()

from tests.test_export._export_models import bit_equal  # noqa: E402

VOCAB, SEQ = 64, 16
WEIGHTS = {"quant_cfg": {"*weight_quantizer": ql.NVFP4_DEFAULT_CFG["quant_cfg"]["*weight_quantizer"], "*router*": {"enable": False},
                         "default": {"enable": False}},
           "algorithm": "max"}  # fmt: skip


@pytest.fixture(scope="module", autouse=True)
def tp1():
    created = te_gpu.init_megatron_tp1()
    yield
    te_gpu.release_megatron(created)


def _gpt(experts, grouped: bool = False):
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_with_transformer_engine_spec
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.module import Float16Module

    torch.manual_seed(0)
    model_parallel_cuda_manual_seed(0)
    moe = {} if experts is None else dict(num_moe_experts=experts, moe_router_topk=2, moe_ffn_hidden_size=64, moe_grouped_gemm=grouped,
                                          moe_token_dispatcher_type="allgather")  # fmt: skip
    cfg = TransformerConfig(num_layers=2, hidden_size=64, ffn_hidden_size=128, num_attention_heads=4, bf16=True,
                            params_dtype=torch.bfloat16,
                            add_bias_linear=experts is None, hidden_dropout=0.0, attention_dropout=0.0,
                            transformer_impl="transformer_engine",
                            **moe)  # fmt: skip
    spec = get_gpt_layer_with_transformer_engine_spec(num_experts=experts, moe_grouped_gemm=grouped)
    return Float16Module(cfg, GPTModel(config=cfg, transformer_layer_spec=spec, vocab_size=VOCAB, max_sequence_length=SEQ)).cuda().eval()


def _loop(model) -> None:
    g = torch.Generator(device="cuda").manual_seed(1)
    for _ in range(2):
        t = torch.randint(0, VOCAB, (2, SEQ), device="cuda", generator=g)
        model(t, torch.arange(SEQ, device="cuda").expand(2, SEQ), attention_mask=None)


@pytest.mark.parametrize("experts", [None, 4], ids=["dense", "sequential_mlp"])
def test_te_gpt_stream_equals_the_file_export(experts, tmp_path):
    from safetensors.torch import load_file

    from quantlib.export.megatron_export import export_megatron_checkpoint
    from quantlib.export.megatron_sync import megatron_sync_pairs

    model = ql.quantize(_gpt(experts), WEIGHTS, _loop)
    stream = {k: t.cpu() for k, t in megatron_sync_pairs(model, "modelopt_nvfp4", scales="calibrated", experts="per_expert")}
    export_megatron_checkpoint(model, str(tmp_path / "out"), "modelopt_nvfp4", hf_config={})  # (LayerNorm: no transformers family)
    files = load_file(os.path.join(tmp_path, "out", "model.safetensors"))
    assert "model.layers.0.input_layernorm.weight" in stream and not [k for k in stream if "linear_" in k]
    assert sorted(stream) == sorted(files)
    assert [k for k in files if not bit_equal(files[k], stream[k])] == []


def test_te_grouped_experts_refused_by_name():
    from quantlib.export import ExportError
    from quantlib.export.megatron_sync import megatron_sync_tensors

    model = ql.quantize(_gpt(4, grouped=True), WEIGHTS, _loop)
    with pytest.raises(ExportError, match="mlp.experts.linear_fc1: .*grouped expert GEMMs"):
        list(megatron_sync_tensors(model, "modelopt_nvfp4"))
