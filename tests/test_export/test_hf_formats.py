"""transformers loads quantlib's HF fine-grained FP8 (128x128, ue8m0) and MXFP8 exports of a tiny Llama and
a tiny Qwen3-MoE (per-expert): every weight equals quantlib's fake-quantized weight bit for bit in fp32,
and so do the logits. Needs transformers and accelerate (test extras)."""

from __future__ import annotations

import json

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("accelerate")
from transformers import AutoModelForCausalLM  # noqa: E402
from transformers.quantizers.auto import AutoQuantizationConfig  # noqa: E402

import quantlib as ql  # noqa: E402
from quantlib.export import export_checkpoint  # noqa: E402
from tests.test_export._export_models import (  # noqa: E402
    fake_quant_weights,
    llama,
    loaded_weights,
    quantized,
    qwen3_moe,
    tokens,
    weight_only,
)

FP8_POW2 = weight_only(ql.FP8_2D_BLOCKWISE_WEIGHT_ONLY_CFG)
FP8_POW2["quant_cfg"]["*weight_quantizer"] = {**FP8_POW2["quant_cfg"]["*weight_quantizer"], "pow2_scale": True}
CASES = {
    "hf_fp8_block": weight_only(ql.FP8_2D_BLOCKWISE_WEIGHT_ONLY_CFG),
    "hf_fp8_block_ue8m0": FP8_POW2,
    "hf_mxfp8": weight_only(ql.MXFP8_DEFAULT_CFG),
}


@pytest.fixture(scope="module")
def bases():
    return {"llama": llama(), "qwen3_moe": qwen3_moe()}


@pytest.mark.parametrize("fmt", sorted(CASES))
@pytest.mark.parametrize("family", ["llama", "qwen3_moe"])
def test_transformers_loads_export_bit_exact(bases, tmp_path, fmt, family):
    model = quantized(bases[family], CASES[fmt])
    export_checkpoint(model, tmp_path / "ckpt", fmt)
    qc = json.loads((tmp_path / "ckpt" / "config.json").read_text())["quantization_config"]
    parsed = AutoQuantizationConfig.from_dict(dict(qc))  # transformers' own parser accepts it
    assert "lm_head" in parsed.modules_to_not_convert and "model.embed_tokens" in parsed.modules_to_not_convert
    # the experts run as in the exported model (eager): transformers' default, grouped_mm, sums in
    # another order, so equal weights would give logits a few ulp apart
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "ckpt", dtype=torch.float32,
                                                  experts_implementation=bases[family].config._experts_implementation)
    expected = fake_quant_weights(model)
    assert len(expected) == (14 if family == "llama" else 8 + 2 * 3 * 4)
    got = loaded_weights(loaded, expected)
    for name, ref in expected.items():
        assert got[name].dtype == torch.float32
        assert torch.equal(got[name], ref.float()), name
    ids = tokens()
    with torch.no_grad():
        assert torch.equal(loaded(ids).logits, model(ids).logits)


def test_ue8m0_scales_are_fp32_powers_of_two(bases, tmp_path):
    """DeepSeek-V3.1's form: vLLM's generic fp8 loader ignores ``scale_fmt`` and copies the stored numbers,
    so E8M0 bytes would load as scales 120.0 instead of 2^-7; fp32 powers of two read right everywhere."""
    from safetensors.torch import load_file

    model = quantized(bases["llama"], FP8_POW2)
    export_checkpoint(model, tmp_path / "c", "hf_fp8_block_ue8m0")
    assert json.loads((tmp_path / "c" / "config.json").read_text())["quantization_config"]["scale_fmt"] == "ue8m0"
    sd = load_file(tmp_path / "c" / "model.safetensors")
    s = sd["model.layers.0.self_attn.q_proj.weight_scale_inv"]
    assert s.dtype == torch.float32 and tuple(s.shape) == (2, 2)
    assert torch.equal(torch.exp2(torch.log2(s).round()), s)  # powers of two, stored as numbers
    linear = model.model.layers[0].self_attn.q_proj
    assert torch.equal(s, ql.kernels.fp8_blockwise_cast(linear.weight, (128, 128), pow2=True)[1]) and linear.weight_quantizer.is_enabled


@pytest.mark.parametrize("family", ["llama", "qwen3_moe"])
def test_mxfp8_byte_scales_mean_powers_of_two_on_the_quantized_path(bases, tmp_path, family):
    """transformers' quantized (GPU) path keeps the checkpoint's uint8 scales and views them as E8M0 only with
    ``scale_fmt: "ue8m0"``; without it byte 120 multiplies as 120.0, not 2^-7. Its CPU path dequantizes either way,
    so transformers' own post-load step is run here on modules holding the exported scales, dense and expert."""
    from safetensors.torch import load_file
    from transformers.quantizers.auto import AutoHfQuantizer

    export_checkpoint(quantized(bases[family], CASES["hf_mxfp8"]), tmp_path / "c", "hf_mxfp8")
    qc = json.loads((tmp_path / "c" / "config.json").read_text())["quantization_config"]
    quantizer = AutoHfQuantizer.from_config(AutoQuantizationConfig.from_dict(dict(qc)), pre_quantized=True)
    stored = {k: v for k, v in load_file(tmp_path / "c" / "model.safetensors").items() if k.endswith("weight_scale_inv")}
    assert stored and all(v.dtype == torch.uint8 for v in stored.values())
    holder = torch.nn.Module()  # parameters as transformers' loader leaves them: the checkpoint's tensors, as stored
    for i, v in enumerate(stored.values()):
        holder.register_parameter(f"p{i}_scale_inv", torch.nn.Parameter(v.clone(), requires_grad=False))
    quantizer._process_model_after_weight_loading(torch.nn.Sequential(holder))
    for i, v in enumerate(stored.values()):
        assert torch.equal(getattr(holder, f"p{i}_scale_inv").float(), torch.exp2(v.float() - 127))
