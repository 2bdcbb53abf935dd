"""Format ``openai_mxfp4``: a GPT-OSS model whose experts quantlib quantized to MXFP4, written in OpenAI's layout
(``<proj>_blocks`` / ``<proj>_scales``, gate/up interleaved as stored) and read back by transformers' own Mxfp4
loader (dequantized on the CPU): every expert weight equals quantlib's fake-quantized one bit for bit and the logits
agree; what the format cannot carry is refused by name. Needs transformers and accelerate (test extras)."""

from __future__ import annotations

import json

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("accelerate")
from safetensors.torch import load_file  # noqa: E402
from transformers import AutoModelForCausalLM, Mxfp4Config  # noqa: E402

import quantlib as ql  # noqa: E402
from quantlib.export import ExportError, export_checkpoint  # noqa: E402
from quantlib.plugins import huggingface as hf  # noqa: E402
from tests.test_export._families import build, tokens  # noqa: E402
from tests.test_export._gpt_oss import INTER, E, H, gpt_oss, quantized  # noqa: E402


def load(path, dtype=torch.float32):
    """transformers' own loader of OpenAI's checkpoints, dequantizing the experts (its CPU path)."""
    return AutoModelForCausalLM.from_pretrained(
        path, quantization_config=Mxfp4Config(dequantize=True), dtype=dtype, output_loading_info=True, experts_implementation="eager"
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_transformers_loads_the_experts_bit_exact(tmp_path, dtype):
    model = quantized(gpt_oss(dtype=dtype))
    manifest = export_checkpoint(model, tmp_path / "q", "openai_mxfp4")
    ckpt = load_file(tmp_path / "q" / "model.safetensors")
    prefix = "model.layers.1.mlp.experts."
    want = {
        "gate_up_proj_blocks": ((E, 2 * INTER, H // 32, 16), torch.uint8),
        "gate_up_proj_scales": ((E, 2 * INTER, H // 32), torch.uint8),
        "down_proj_blocks": ((E, H, INTER // 32, 16), torch.uint8),
        "down_proj_scales": ((E, H, INTER // 32), torch.uint8),
        "gate_up_proj_bias": ((E, 2 * INTER), dtype),
        "down_proj_bias": ((E, H), dtype),
    }
    assert {k.removeprefix(prefix): (tuple(v.shape), v.dtype) for k, v in ckpt.items() if k.startswith(prefix)} == want
    assert ckpt["model.layers.0.self_attn.q_proj.weight"].dtype == dtype and not any(
        k.endswith(("gate_up_proj", "down_proj")) for k in ckpt
    )
    config = json.loads((tmp_path / "q" / "config.json").read_text())
    assert config["quantization_config"] == {
        "quant_method": "mxfp4",
        "modules_to_not_convert": ["model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"],
    }
    assert manifest.quantized_modules == ["model.layers.0.mlp.experts", "model.layers.1.mlp.experts"]

    loaded, info = load(tmp_path / "q", dtype)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    n = 0
    with torch.no_grad():
        for name, m in model.named_modules():
            if isinstance(m, hf.QuantFusedExperts):
                for proj in m.projections:
                    for e in range(E):
                        fake = m.quantize_weight(hf.expert_weight(m, proj, e), f"{proj}_weight_quantizer", e)
                        assert torch.equal(hf.expert_weight(loaded.get_submodule(name), proj, e), fake), f"{name}.{proj}[{e}]"
                        n += 1
        assert n == 2 * 2 * E
        ids = tokens()
        want, got = model(ids).logits, loaded(ids).logits
    if dtype == torch.float32:
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    else:  # the same bf16 weights; the experts' GEMMs may sum in another order
        torch.testing.assert_close(got.float(), want.float(), rtol=2e-2, atol=2e-2)


def test_the_blocks_are_quantlibs_mxfp4_codes_in_openais_byte_order(tmp_path):
    # low nibble = even element, scale byte = 2^(b - 127) per 32 inputs of one stored row (gate/up interleaved)
    model = quantized(gpt_oss(layers=1))
    export_checkpoint(model, tmp_path / "q", "openai_mxfp4")
    ckpt = load_file(tmp_path / "q" / "model.safetensors")
    lut = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0])
    experts = model.model.layers[0].mlp.experts
    for proj in ("gate_up_proj", "down_proj"):
        blocks, scales = ckpt[f"model.layers.0.mlp.experts.{proj}_blocks"], ckpt[f"model.layers.0.mlp.experts.{proj}_scales"]
        values = torch.stack([lut[(blocks & 0xF).long()], lut[(blocks >> 4).long()]], dim=-1).flatten(-2)  # [E, out, in/32, 32]
        w = (values * torch.exp2(scales.float() - 127).unsqueeze(-1)).flatten(-2)
        for e in range(E):
            fake = experts.quantize_weight(hf.expert_weight(experts, proj, e), f"{proj}_weight_quantizer", e)
            assert torch.equal(w[e], fake), f"{proj}[{e}]"


def test_other_quantized_linears_are_refused(tmp_path):
    model = quantized(gpt_oss(layers=1), ql.MXFP4_DEFAULT_CFG)
    with pytest.raises(
        ExportError,
        match=r"model.layers.0.self_attn.q_proj.weight_quantizer: format openai_mxfp4 quantizes no linear weight .*GPT-OSS experts alone",
    ):
        export_checkpoint(model, tmp_path / "q", "openai_mxfp4")


def test_experts_quantized_other_than_mxfp4_or_in_part_are_refused(tmp_path):
    mxfp8 = quantized(gpt_oss(layers=1), ql.MXFP8_EXPERTS_ONLY_CFG)
    ql.disable_quantizer(mxfp8, "*input_quantizer")
    with pytest.raises(
        ExportError, match=r"model.layers.0.mlp.experts.gate_up_proj_weight_quantizer = mx element=\(4, 3\).*cannot carry it \(needs MXFP4"
    ):
        export_checkpoint(mxfp8, tmp_path / "q", "openai_mxfp4")
    model = quantized(gpt_oss(layers=1))
    model.model.layers[0].mlp.experts.down_proj_weight_quantizer[2].disable()
    with pytest.raises(
        ExportError,
        match=r"model.layers.0.mlp.experts.down_proj_weight_quantizer\[2\] = disabled, .* every projection is quantized alike",
    ):
        export_checkpoint(model, tmp_path / "q2", "openai_mxfp4")


def test_a_model_that_is_not_gpt_oss_is_refused(tmp_path):
    model = quantized(build("qwen3_moe"), ql.MXFP4_MLP_WEIGHT_ONLY_CFG)
    with pytest.raises(
        ExportError, match=r"Qwen3MoeForCausalLM \(config.model_type 'qwen3_moe'\): format openai_mxfp4 is read .* \['gpt_oss'\] only"
    ):
        export_checkpoint(model, tmp_path / "q", "openai_mxfp4")


def test_other_formats_still_refuse_quantized_gpt_oss_experts_and_name_this_one(tmp_path):
    with pytest.raises(
        ExportError, match=r"experts.gate_up_proj_weight_quantizer: .* only format openai_mxfp4 .* carries quantized 3-D experts"
    ):
        export_checkpoint(quantized(gpt_oss(layers=1)), tmp_path / "q", "ct_mxfp4")
