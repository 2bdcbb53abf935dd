"""Mixed precision: one compressed-tensors export with a config group per scheme (W4A16 MLP + FP8 128x128
attention, NVFP4 experts + FP8 attention); compressed-tensors decompresses each module by its group's format
to quantlib's fake-quantized weight, and transformers loads the MoE one (FP8 attention, INT4 experts).
ModelOpt MIXED_PRECISION: its qtensors dequantize each layer by the algorithm ``quantized_layers`` names."""

from __future__ import annotations

import json
import re
import warnings

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("compressed_tensors")
from compressed_tensors.compressors import BaseCompressor
from compressed_tensors.quantization import QuantizationConfig
from safetensors.torch import load_file

import quantlib as ql
from quantlib.export import ExportError, export_checkpoint
from tests.test_export._export_models import fake_quant_weights, llama, quantized, qwen3_moe, tokens

FP8_BLOCK = {"num_bits": (4, 3), "block_sizes": {-1: 128, -2: 128}}
INT4 = {"num_bits": 4, "block_sizes": {-1: 128, "type": "static"}}
NVFP4 = {"num_bits": (2, 1), "block_sizes": {-1: 16, "type": "dynamic", "scale_bits": (4, 3)}}


def _cfg(**rules) -> dict:
    return {"quant_cfg": {**{f"*{k}*weight_quantizer": v for k, v in rules.items()}, "default": {"enable": False}}, "algorithm": "max"}


def _decompress(out_dir) -> tuple[dict, dict[str, torch.Tensor]]:
    """Each module's weight as compressed-tensors decompresses it with the format of the group targeting it."""
    qc = json.loads((out_dir / "config.json").read_text())["quantization_config"]
    groups = QuantizationConfig.model_validate(qc).config_groups  # CT's own parser
    sd = load_file(out_dir / "model.safetensors")
    by_module: dict[str, dict] = {}
    for k, t in sd.items():
        mod, _, local = k.rpartition(".")
        by_module.setdefault(mod, {})[local] = t
    out = {}
    for mod, local in by_module.items():
        hits = [g for g in groups.values() if any(t == mod or (t.startswith("re:") and re.match(t[3:], mod)) for t in g.targets)]
        if "weight_scale" in local:
            assert len(hits) == 1, mod
            out[mod] = BaseCompressor.get_value_from_registry(hits[0].format).decompress(local, hits[0])["weight"]
        else:
            assert not hits, mod
    return qc, out


def _check(model, out_dir, formats: set[str], int_rows: str) -> dict:
    qc, got = _decompress(out_dir)
    assert qc["format"] == "mixed-precision" and {g["format"] for g in qc["config_groups"].values()} == formats
    expected = fake_quant_weights(model)
    assert set(got) == set(expected)
    for name, ref in expected.items():
        if int_rows in name:  # INT: the consumer multiplies by 1/s, quantlib divides by s
            assert torch.allclose(got[name].float(), ref.float(), rtol=2**-22, atol=0), name
        else:
            assert torch.equal(got[name].to(torch.bfloat16), ref.to(torch.bfloat16)), name
    return qc


def test_w4a16_mlp_fp8_attention(tmp_path):
    model = quantized(llama(), _cfg(mlp=INT4, self_attn=FP8_BLOCK))
    with pytest.raises(ExportError,
                       match=r"gate_proj.weight_quantizer = int num_bits=4 block=\(128,\): format ct_fp8_block cannot carry it"):
        export_checkpoint(model, tmp_path / "one", "ct_fp8_block")
    export_checkpoint(model, tmp_path / "c", "ct_mixed")
    qc = _check(model, tmp_path / "c", {"pack-quantized", "float-quantized"}, "mlp")
    attn = next(g for g in qc["config_groups"].values() if g["format"] == "float-quantized")
    assert attn["targets"][:4] == [f"model.layers.0.self_attn.{p}_proj" for p in "qkvo"]


def test_nvfp4_experts_fp8_attention(tmp_path):
    model = quantized(qwen3_moe(), _cfg(experts=NVFP4, self_attn=FP8_BLOCK))
    export_checkpoint(model, tmp_path / "c", "ct_mixed")
    qc = _check(model, tmp_path / "c", {"nvfp4-pack-quantized", "float-quantized"}, "<none>")
    experts = next(g for g in qc["config_groups"].values() if g["format"] == "nvfp4-pack-quantized")
    assert experts["targets"][0] == r"re:^model\.layers\.0\.mlp\.experts\.0\.gate_proj$"


def test_transformers_loads_fp8_attention_int4_experts(tmp_path):
    from transformers import AutoModelForCausalLM, CompressedTensorsConfig

    model = quantized(qwen3_moe(), _cfg(experts=INT4, self_attn=FP8_BLOCK))
    export_checkpoint(model, tmp_path / "c", "ct_mixed")
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "c", dtype=torch.float32,
                                                  quantization_config=CompressedTensorsConfig(dequantize=True))
    with torch.no_grad():
        got, ref = loaded(tokens()).logits, model(tokens()).logits
    assert (got - ref).abs().max() <= 1e-5 * ref.abs().max()


def test_scheme_no_member_carries_refused(tmp_path):
    model = quantized(llama(), _cfg(mlp=INT4, self_attn={"num_bits": (4, 3), "axis": None}))
    with pytest.raises(ExportError, match=r"^model.layers.0.self_attn.q_proj.weight_quantizer = fp8 element=\(4, 3\) / .*: no member of "
                                          r"format ct_mixed carries it"):
        export_checkpoint(model, tmp_path / "c", "ct_mixed")


def test_modelopt_mixed_precision(tmp_path):
    """ModelOpt MIXED_PRECISION: NVFP4 (W4A16) MLP + FP8 128x128 attention; ModelOpt's own config.json form of
    its hf_quant_config.json, and its qtensors dequantize every layer by its algorithm to the fake-quant weight."""
    pytest.importorskip("modelopt")
    from tests.test_export.test_modelopt import _dequantize, convert_hf_quant_config_format

    model = quantized(llama(), _cfg(mlp=NVFP4, self_attn=FP8_BLOCK))
    export_checkpoint(model, tmp_path / "c", "modelopt_mixed")
    hf_quant = json.loads((tmp_path / "c" / "hf_quant_config.json").read_text())
    quant = hf_quant["quantization"]
    assert quant["quant_algo"] == "MIXED_PRECISION" and "lm_head" in quant["exclude_modules"]
    assert quant["quantized_layers"]["model.layers.1.mlp.up_proj"] == {"quant_algo": "W4A16_NVFP4", "group_size": 16}
    assert quant["quantized_layers"]["model.layers.1.self_attn.o_proj"] == {"quant_algo": "FP8_PB_WO", "group_size": 128}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # ModelOpt has no compressed-tensors group for FP8_PB_WO and says so
        assert json.loads((tmp_path / "c" / "config.json").read_text())["quantization_config"] == convert_hf_quant_config_format(hf_quant)
    sd = load_file(tmp_path / "c" / "model.safetensors")
    fmt = {"W4A16_NVFP4": "modelopt_nvfp4", "FP8_PB_WO": "modelopt_fp8_pb"}
    expected = fake_quant_weights(model)
    assert set(expected) == set(quant["quantized_layers"])
    for name, ref in expected.items():
        t = {k.rpartition(".")[2]: v for k, v in sd.items() if k.rpartition(".")[0] == name}
        assert torch.equal(_dequantize(fmt[quant["quantized_layers"][name]["quant_algo"]], t, ref.shape), ref.float()), name


def test_modelopt_mixed_one_scheme_is_the_plain_config(tmp_path):
    model = quantized(llama(), _cfg(mlp=FP8_BLOCK, self_attn=FP8_BLOCK))
    export_checkpoint(model, tmp_path / "m", "modelopt_mixed")
    export_checkpoint(model, tmp_path / "p", "modelopt_fp8_pb")
    assert (tmp_path / "m" / "hf_quant_config.json").read_text() == (tmp_path / "p" / "hf_quant_config.json").read_text()


@pytest.mark.parametrize("fmt,rules,member,first", [
    ("ct_mixed", dict(mlp=INT4, up_proj=FP8_BLOCK), "model.layers.0.mlp.up_proj", "model.layers.0.mlp.gate_proj"),
    ("modelopt_mixed", dict(q_proj=NVFP4, k_proj=FP8_BLOCK, v_proj=FP8_BLOCK), "model.layers.0.self_attn.k_proj",
     "model.layers.0.self_attn.q_proj"),
])  # fmt: skip
def test_siblings_of_other_schemes_refused(tmp_path, fmt, rules, member, first):
    # vLLM runs q/k/v (gate/up) as one GEMM of one scheme and refuses the load ("Mixed quant_algo within fused layer"):
    # before, the mixed formats wrote each sibling in its own scheme without a word
    model = quantized(llama(), _cfg(**rules))
    with pytest.raises(ExportError, match=rf"^{member}.weight_quantizer and {first}.weight_quantizer: siblings fused by consumers into "
                                          r"one GEMM need one scheme, but .* is weight (fp8_block|int) .* and .* weight (int|nvfp4)"):
        export_checkpoint(model, tmp_path / "c", fmt)
    assert not (tmp_path / "c").exists()


def test_modelopt_mixed_refuses_an_nvfp4_kv_cache(tmp_path):
    """vLLM reads a MIXED_PRECISION config's NVFP4 KV cache as none and runs it at scales of 1
    (tests/test_vllm/test_vllm_mixed.py); one scheme for all layers is the plain config, which it reads."""
    model = quantized(llama(), ql.merge_kv_config(_cfg(mlp=NVFP4, self_attn=FP8_BLOCK), ql.NVFP4_KV_CFG))
    with pytest.raises(ExportError, match=r"^format modelopt_mixed: the KV cache is NVFP4 \(NVFP4_KV_CFG\), which vLLM 0.32 reads"):
        export_checkpoint(model, tmp_path / "c", "modelopt_mixed")
    assert not (tmp_path / "c").exists()
    export_checkpoint(quantized(llama(), ql.merge_kv_config(_cfg(mlp=NVFP4, self_attn=NVFP4), ql.NVFP4_KV_CFG)), tmp_path / "o",
                      "modelopt_mixed")
    assert json.loads((tmp_path / "o" / "hf_quant_config.json").read_text())["quantization"]["kv_cache_quant_algo"] == "NVFP4"
