"""A dense Megatron-Core GPTModel (2 layers, gated MLP, local spec) on 4 gloo ranks: the export at TP2
(DP2) is byte for byte the export at TP1 (DP4), and the TP1 export's q / k / v, gate / up and down
weights dequantize to the rows of quantlib's fake-quantized Megatron weights, under Llama's names."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("psutil")
pytest.importorskip("megatron.core")
import quantlib as ql  # noqa: E402
from tests.test_export.test_megatron_export import export_layouts, nvfp4_weights  # noqa: E402
from tests.test_plugins import megatron_shims as shims  # noqa: E402

pytestmark = [pytest.mark.megatron, pytest.mark.distributed]

#: weight-only: the activation amax of a TP2 forward differ in last bits from TP1's (reduction order)
NVFP4_W = {"quant_cfg": {"*weight_quantizer": ql.NVFP4_DEFAULT_CFG["quant_cfg"]["*weight_quantizer"], "default": {"enable": False}},
           "algorithm": "max"}
CASES = {"modelopt_nvfp4": NVFP4_W, "ct_mxfp8": ql.MXFP8_DEFAULT_CFG}


def _build_dense(tp: int):
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    config = shims.gpt_config(tp, 1, num_moe_experts=None, moe_ffn_hidden_size=None, gated_linear_unit=True)
    model = GPTModel(config=config, transformer_layer_spec=get_gpt_layer_local_spec(), vocab_size=shims.VOCAB,
                     max_sequence_length=shims.SEQ).eval()
    shims.init_global_weights(model, 0)
    return model


def _export_all(rank: int, world: int, tmp: str) -> dict:
    return export_layouts(tmp, ("tp1", "tp2"), CASES, lambda tp, ep: _build_dense(tp), _check_tp1)


def _check_tp1(model, path: str, qkv) -> list[str]:
    deq = nvfp4_weights(path)
    bad = []

    def check(name: str, expected: torch.Tensor) -> None:
        if not torch.equal(deq(name), expected):
            bad.append(name)

    for i, layer in enumerate(model.decoder.layers):
        attn = layer.self_attention
        fq = attn.linear_qkv.weight_quantizer(attn.linear_qkv.weight)
        for leaf, rows in zip(("q_proj", "k_proj", "v_proj"), qkv):
            check(f"model.layers.{i}.self_attn.{leaf}", fq[rows])
        check(f"model.layers.{i}.self_attn.o_proj", attn.linear_proj.weight_quantizer(attn.linear_proj.weight))
        fc1 = layer.mlp.linear_fc1
        fq = fc1.weight_quantizer(fc1.weight)
        half = fq.shape[0] // 2
        check(f"model.layers.{i}.mlp.gate_proj", fq[:half])
        check(f"model.layers.{i}.mlp.up_proj", fq[half:])
        fc2 = layer.mlp.linear_fc2
        check(f"model.layers.{i}.mlp.down_proj", fc2.weight_quantizer(fc2.weight))
    for key in ("model.embed_tokens.weight", "model.norm.weight", "lm_head.weight", "model.layers.0.input_layernorm.weight",
                "model.layers.1.post_attention_layernorm.weight"):
        if key not in deq.keys:
            bad.append(f"missing {key}")
    return bad


def test_dense_tp2_export_equals_tp1_byte_for_byte(tmp_path):
    results = shims.run_distributed(_export_all, 4, str(tmp_path), timeout=300)
    out = results[0]
    assert out["check"] == []
    for fmt in CASES:
        tp1, tp2 = out[("tp1", fmt)], out[("tp2", fmt)]
        assert "model.safetensors" in tp1 and tp1 == tp2, fmt
