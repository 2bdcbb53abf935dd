"""A Megatron-Core GPT against the transformers model of its family: the Megatron file export and the TP1 in-memory
sync stream, loaded by ``AutoConfig`` / ``AutoModelForCausalLM.from_pretrained``, give the Megatron model's logits.
Qwen2-MoE (q/k/v biases, a gated shared expert) and Llama with biases on every linear; MXFP8 weights, the output
layer and the shared experts quantized. Before: config.json held only ``quantization_config`` (AutoConfig
refused it), the quantized output layer went out as a full-precision ``lm_head``, the shared experts under
Megatron names unquantized, the biases as ``linear_qkv.bias`` fused per query group."""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch

pytest.importorskip("psutil")
pytest.importorskip("megatron.core")
pytest.importorskip("accelerate")  # transformers' fine-grained FP8 / MXFP8 loader
import quantlib as ql  # noqa: E402
from tests.test_export._export_models import bit_equal  # noqa: E402
from tests.test_export.test_megatron_sync import DENSE, MOE, quantized, weight_only  # noqa: E402
from tests.test_plugins import megatron_shims as shims  # noqa: E402

pytestmark = [pytest.mark.megatron, pytest.mark.distributed]
FMT = "hf_mxfp8"


def _export(rank: int, world: int, tmp: str, overrides: dict, fmt: str = FMT, preset: str = "MXFP8_DEFAULT_CFG") -> dict:
    from quantlib.export.megatron_export import export_megatron_checkpoint
    from quantlib.export.megatron_sync import megatron_sync_pairs

    shims.set_layout(1, 1)
    model = quantized(1, 1, overrides, weight_only(getattr(ql, preset)))
    tokens = shims.token_batches(1, 7)[0]
    export_megatron_checkpoint(model, os.path.join(tmp, "export"), fmt)
    stream = {k: t.clone() for k, t in megatron_sync_pairs(model, fmt, experts="per_expert")}
    return {"tokens": tokens, "logits": shims.gpt_logits(model, tokens), "stream": stream}


def _hf_logits(path: str, tokens: torch.Tensor, **kwargs) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, **kwargs).eval()
    with torch.no_grad():
        return model(tokens).logits


def _exported(tmp_path, overrides: dict, model_type: str, fmt: str = FMT, preset: str = "MXFP8_DEFAULT_CFG") -> tuple[dict, dict]:
    """The TP1 export and stream of the Megatron GPT of ``overrides``: (what ``_export`` returns, the export's
    tensors); ``AutoConfig`` reads the family, the stream holds the file's tensors bit for bit, and the stream
    alone is written beside the export's config.json in ``tmp_path / "stream"``."""
    from safetensors.torch import load_file, save_file
    from transformers import AutoConfig

    out = shims.run_distributed(_export, 1, str(tmp_path), overrides, fmt, preset, timeout=300)[0]
    path = str(tmp_path / "export")
    assert AutoConfig.from_pretrained(path).model_type == model_type
    files = load_file(os.path.join(path, "model.safetensors"))
    assert not [k for k in files if "linear_" in k or "shared_experts" in k]
    assert sorted(out["stream"]) == sorted(files)
    assert [k for k in files if not bit_equal(files[k], out["stream"][k])] == []
    stream_dir = str(tmp_path / "stream")
    os.makedirs(stream_dir)
    save_file(
        {k: t.contiguous() for k, t in out["stream"].items()}, os.path.join(stream_dir, "model.safetensors"), metadata={"format": "pt"}
    )
    shutil.copy(os.path.join(path, "config.json"), stream_dir)
    return out, files


def _check(tmp_path, overrides: dict, model_type: str, keys: tuple) -> None:
    out, files = _exported(tmp_path, overrides, model_type)
    for key in keys:
        assert key in files, key
    assert files["lm_head.weight"].dtype == torch.float8_e4m3fn and "lm_head.weight_scale_inv" in files
    for path in (tmp_path / "export", tmp_path / "stream"):  # the file export, and the stream alone
        torch.testing.assert_close(_hf_logits(str(path), out["tokens"]), out["logits"], rtol=1e-4, atol=1e-4)
    assert json.load(open(tmp_path / "export" / "config.json"))["quantization_config"]["quant_method"] == "mxfp8"


def test_qwen2_moe_export_and_stream_give_megatron_logits(tmp_path):
    keys = ("model.layers.0.self_attn.q_proj.bias", "model.layers.1.mlp.shared_expert.gate_proj.weight_scale_inv",
            "model.layers.1.mlp.shared_expert.down_proj.weight_scale_inv", "model.layers.1.mlp.shared_expert_gate.weight",
            "model.layers.0.mlp.experts.3.up_proj.weight_scale_inv", "model.layers.0.mlp.gate.weight")  # fmt: skip
    _check(tmp_path, MOE, "qwen2_moe", keys)


def test_qwen3_moe_export_and_stream_give_megatron_logits(tmp_path):
    """q / k norms, no biases, no shared expert; the router picks before its softmax (norm_topk_prob False)."""
    overrides = {k: v for k, v in MOE.items() if not k.startswith(("add_qkv", "moe_shared"))}
    overrides.update(qk_layernorm=True, moe_router_pre_softmax=True)
    _check(tmp_path, overrides, "qwen3_moe", ("model.layers.0.self_attn.q_norm.weight", "model.layers.1.self_attn.k_norm.weight"))


def test_llama_with_biases_export_and_stream_give_megatron_logits(tmp_path):
    keys = ("model.layers.0.self_attn.k_proj.bias", "model.layers.0.self_attn.o_proj.bias", "model.layers.1.mlp.gate_proj.bias",
            "model.layers.1.mlp.up_proj.bias", "model.layers.1.mlp.down_proj.bias")  # fmt: skip
    _check(tmp_path, DENSE, "llama", keys)


def test_llama_with_biases_ct_int8_export_and_stream_through_compressed_tensors_give_megatron_logits(tmp_path):
    """compressed-tensors' own loader (transformers' CT path, decompressed): INT8 per channel with the output layer
    quantized and biases on every linear."""
    pytest.importorskip("compressed_tensors")
    from transformers import CompressedTensorsConfig

    out, files = _exported(tmp_path, DENSE, "llama", "ct_int8", "INT8_WEIGHT_ONLY_CFG")
    assert files["lm_head.weight"].dtype == torch.int8 and files["model.layers.0.self_attn.q_proj.bias"].dtype == torch.float32
    qc = json.load(open(tmp_path / "export" / "config.json"))["quantization_config"]
    assert qc["quant_method"] == "compressed-tensors"
    for path in (tmp_path / "export", tmp_path / "stream"):
        ct = CompressedTensorsConfig(run_compressed=False, dequantize=True)
        torch.testing.assert_close(_hf_logits(str(path), out["tokens"], quantization_config=ct), out["logits"], rtol=1e-4, atol=1e-4)


def _export_layouts(rank: int, world: int, tmp: str) -> dict:
    from quantlib.export.megatron_export import export_megatron_checkpoint
    from tests.test_export.test_megatron_export import _digest

    out = {}
    for layout in ("tp1", "tp2ep2"):
        tp, ep = shims.LAYOUTS[layout]
        shims.set_layout(tp, ep)
        model = quantized(tp, ep, MOE, weight_only(ql.NVFP4_DEFAULT_CFG))
        export_megatron_checkpoint(model, os.path.join(tmp, layout), "modelopt_nvfp4")
        if rank == 0:
            out[layout] = _digest(os.path.join(tmp, layout))
    return out


def test_qwen2_moe_export_at_tp2ep2_equals_tp1_byte_for_byte(tmp_path):
    """Shared experts, q/k/v biases and the output layer gathered from TP2xEP2 as at TP1 (NVFP4: one global amax)."""
    out = shims.run_distributed(_export_layouts, 4, str(tmp_path), timeout=300)[0]
    assert {"model.safetensors", "config.json", "hf_quant_config.json"} <= set(out["tp1"]) and out["tp1"] == out["tp2ep2"]
