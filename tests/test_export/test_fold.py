"""SmoothQuant / AWQ models exported: each ``pre_quant_scale`` folded into the op before it (norm weights,
v_proj / up_proj / fc1 rows) or carried as ModelOpt's ``pre_quant_scale`` tensor, and the consumer's
logits equal quantlib's fake-quant model's (INT formats: within the rounding of a multiplied scale)."""

from __future__ import annotations

import copy
import json

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("compressed_tensors")
from safetensors.torch import load_file

import quantlib as ql
from quantlib.export import ExportError, export_checkpoint, share_pre_quant_scale
from tests.test_export._awq_models import FAMILIES, _calibrated, _llama, _loop  # noqa: F401
from tests.test_export._export_models import tokens

INT4_AWQ_CLIP = {**ql.INT4_AWQ_CFG, "algorithm": {"method": "awq_clip"}}
INT4_AWQ_FULL = {**ql.INT4_AWQ_CFG, "algorithm": {"method": "awq_full", "alpha_step": 0.25}}


def _ct_logits(out_dir) -> torch.Tensor:
    from transformers import AutoModelForCausalLM, CompressedTensorsConfig

    loaded = AutoModelForCausalLM.from_pretrained(out_dir, dtype=torch.float32,
                                                  quantization_config=CompressedTensorsConfig(dequantize=True))
    with torch.no_grad():
        return loaded(tokens()).logits


def _weight_only_logits(model) -> torch.Tensor:
    """Logits of the fake-quant model with its activations unquantized, as a consumer that dequantizes weights
    runs it (pre_quant_scale still applies: the input quantizer's scale multiplies even when disabled)."""
    model = copy.deepcopy(model)
    ql.disable_quantizer(model, "*input_quantizer")
    with torch.no_grad():
        return model(tokens()).logits


def _assert_close(got: torch.Tensor, ref: torch.Tensor) -> None:
    # INT formats: the consumer multiplies by fp32 1/s (quantlib divides), and the folded norm weights and
    # row scales round once more: a few ulps of each weight, nowhere near one quantization step
    assert (got - ref).abs().max() <= 1e-5 * ref.abs().max(), float((got - ref).abs().max())


def _pqs(model, name: str) -> torch.Tensor:
    return model.get_submodule(name).input_quantizer.pre_quant_scale


@pytest.mark.parametrize(
    "family, cfg, fmt",
    [
        ("llama", ql.INT4_AWQ_CFG, "ct_int_pack"),
        ("qwen3", ql.INT4_AWQ_CFG, "ct_int_pack"),
        ("opt", ql.INT4_AWQ_CFG, "ct_int_pack"),
        ("llama", INT4_AWQ_CLIP, "ct_int_pack"),
        ("qwen3", INT4_AWQ_FULL, "ct_int_pack"),
        ("llama", ql.INT8_SMOOTHQUANT_CFG, "ct_int8"),
        ("qwen3", ql.INT8_SMOOTHQUANT_CFG, "ct_int8"),
        ("opt", ql.INT8_SMOOTHQUANT_CFG, "ct_int8"),
    ],
)
def test_awq_and_smoothquant_export_to_compressed_tensors(tmp_path, family, cfg, fmt):
    model = _calibrated(family, cfg)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    layer = "model.decoder.layers.0" if family == "opt" else "model.layers.0"
    attn, first = f"{layer}.self_attn", ("self_attn_layer_norm" if family == "opt" else "input_layernorm")
    scaled = cfg is not INT4_AWQ_CLIP  # awq_clip searches clip ratios only: no pre_quant_scale
    assert (_pqs(model, f"{attn}.q_proj") is not None) == scaled
    export_checkpoint(model, tmp_path / "c", fmt)
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())  # the model is untouched
    sd = load_file(tmp_path / "c" / "model.safetensors")
    assert not [k for k in sd if "pre_quant_scale" in k]
    norm = model.get_submodule(f"{layer}.{first}")
    p = _pqs(model, f"{attn}.q_proj") if scaled else torch.ones(())
    assert torch.equal(sd[f"{layer}.{first}.weight"], (norm.weight.float() * p.float()).to(norm.weight.dtype))
    _assert_close(_ct_logits(tmp_path / "c"), _weight_only_logits(model))


def test_quantized_v_proj_rows_take_o_proj_scale(tmp_path):
    """o_proj's scale goes into v_proj's INT4 row scales: codes unchanged, scale / p per kv row."""
    model = _calibrated("llama", ql.INT4_AWQ_CFG)
    export_checkpoint(model, tmp_path / "c", "ct_int_pack")
    sd = load_file(tmp_path / "c" / "model.safetensors")
    v = model.model.layers[1].self_attn.v_proj
    p = _pqs(model, "model.layers.1.self_attn.o_proj").reshape(2, 2, 32)[:, 0].reshape(-1)  # kv head h serves query heads 2h, 2h+1
    from quantlib.export.quantize import real_quantize

    q = real_quantize(v.weight.detach() * v.weight_quantizer.pre_quant_scale, v.weight_quantizer.spec, v.weight_quantizer.amax)
    assert torch.equal(sd["model.layers.1.self_attn.v_proj.weight_scale"], torch.reciprocal(q.scale / p[:, None]))


def test_siblings_with_different_scales_refused_by_name(tmp_path):
    model = _calibrated("llama", ql.INT4_AWQ_CFG, share=False)  # quantlib's AWQ searches q, k and v each on its own
    with pytest.raises(ExportError, match=r"^model.layers.0.self_attn.q_proj.input_quantizer: .*model.layers.0.input_layernorm feeds "
                                          r".*q_proj and .*k_proj, whose pre_quant_scales differ"):
        export_checkpoint(model, tmp_path / "c", "ct_int_pack")
    assert not (tmp_path / "c").exists()


def test_gqa_heads_with_different_scales_refused_then_shared(tmp_path):
    model = _calibrated("llama", ql.INT4_AWQ_CFG, share=False)
    changed = share_pre_quant_scale(model, _loop)
    o = "model.layers.0.self_attn.o_proj"
    assert (o,) in changed and ("model.layers.0.self_attn.q_proj", "model.layers.0.self_attn.k_proj",
                                "model.layers.0.self_attn.v_proj") in changed
    grouped = _pqs(model, o).reshape(2, 2, 32)
    assert torch.equal(grouped[:, 0], grouped[:, 1])
    grouped[:, 1] *= 2  # the two query heads of a kv head now disagree
    with pytest.raises(ExportError, match=rf"^{o}.input_quantizer: .*query heads sharing a key/value head"):
        export_checkpoint(model, tmp_path / "c", "ct_int_pack")


def test_static_input_amax_needs_forward_loop():
    model = _calibrated("llama", ql.INT8_SMOOTHQUANT_CFG, share=False)
    with torch.no_grad():
        model.model.layers[0].self_attn.k_proj.input_quantizer.pre_quant_scale *= 2
    with pytest.raises(ExportError, match=r"self_attn.q_proj.input_quantizer: a static input amax depends on pre_quant_scale; pass "
                                          r"forward_loop"):
        share_pre_quant_scale(model)


def test_fp8_block_with_awq_norm_folds_to_hf_fp8(tmp_path):
    """FP8 128x128 blocks have no per-row scale: with o_proj / down_proj left out of AWQ, q/k/v and gate/up fold into the norms."""
    from transformers import AutoModelForCausalLM

    cfg = copy.deepcopy(ql.FP8_2D_BLOCKWISE_WEIGHT_ONLY_CFG)
    cfg["quant_cfg"] = {"*weight_quantizer": cfg["quant_cfg"]["*weight_quantizer"], "*o_proj*": {"enable": False},
                        "*down_proj*": {"enable": False}, "default": {"enable": False}}
    cfg["algorithm"] = "awq_lite"
    model = _calibrated("llama_mha", cfg)  # k/v of 128 rows: whole 128x128 blocks
    assert _pqs(model, "model.layers.0.mlp.up_proj") is not None
    export_checkpoint(model, tmp_path / "c", "hf_fp8_block")
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "c", dtype=torch.float32)
    with torch.no_grad():
        _assert_close(loaded(tokens()).logits, model(tokens()).logits)


def test_nvfp4_awq_refused_by_ct_carried_by_modelopt(tmp_path):
    """NVFP4 v_proj / up_proj have no per-row scale: o_proj and down_proj keep their scale, which compressed-tensors
    cannot hold and ModelOpt's NVFP4_AWQ writes as pre_quant_scale; q/k/v and gate/up fold into the norms."""
    qtensor = pytest.importorskip("modelopt.torch.quantization.qtensor")
    model = _calibrated("llama", ql.NVFP4_AWQ_LITE_CFG)
    with pytest.raises(ExportError, match=r"^model.layers.0.self_attn.o_proj.input_quantizer: .*v_proj.weight_quantizer \(nvfp4\) has no "
                                          r"scale per output row"):
        export_checkpoint(model, tmp_path / "ct", "ct_nvfp4")
    export_checkpoint(model, tmp_path / "mo", "modelopt_nvfp4")
    hf_quant = json.loads((tmp_path / "mo" / "hf_quant_config.json").read_text())["quantization"]
    assert (hf_quant["quant_algo"], hf_quant["pre_quant_scale"], hf_quant["has_zero_point"]) == ("NVFP4_AWQ", True, False)
    sd = load_file(tmp_path / "mo" / "model.safetensors")
    assert sorted(k for k in sd if k.endswith("pre_quant_scale")) == [f"model.layers.{i}.{m}.pre_quant_scale" for i in (0, 1)
                                                                      for m in ("mlp.down_proj", "self_attn.o_proj")]
    # the consumer: ModelOpt's dequantize, pre_quant_scale on the input, the folded norms
    ref = copy.deepcopy(model)
    ql.disable_quantizer(ref, "*input_quantizer")
    plain = _llama()
    with torch.no_grad():
        for name, m in plain.named_modules():
            if f"{name}.weight_scale" in sd:
                w = qtensor.NVFP4QTensor(m.weight.shape, torch.float32, sd[f"{name}.weight"])
                m.weight.copy_(w.dequantize(dtype=torch.float32, scale=sd[f"{name}.weight_scale"],
                                            double_scale=sd[f"{name}.weight_scale_2"], block_sizes={-1: 16}))
                if f"{name}.pre_quant_scale" in sd:
                    m.register_forward_pre_hook(lambda _m, a, p=sd[f"{name}.pre_quant_scale"]: (a[0] * p,))
            elif f"{name}.weight" in sd and hasattr(m, "weight"):
                m.weight.copy_(sd[f"{name}.weight"])
        _assert_close(plain(tokens()).logits, ref(tokens()).logits)


def test_modelopt_nvfp4_w4a16_cannot_carry(tmp_path):
    cfg = copy.deepcopy(ql.NVFP4_AWQ_LITE_CFG)
    cfg["quant_cfg"]["*input_quantizer"] = {"enable": False}
    model = _calibrated("llama", cfg)
    with pytest.raises(ExportError, match=r"o_proj.input_quantizer: pre_quant_scale folds nowhere and format modelopt_nvfp4 cannot carry "
                                          r"it \(NVFP4_AWQ quantizes"):
        export_checkpoint(model, tmp_path / "c", "modelopt_nvfp4")


def test_modelopt_int4_awq(tmp_path):
    """W4A16_AWQ: two output rows per byte as ModelOpt packs them, its pre_quant_scale where no fold exists."""
    pytest.importorskip("modelopt")
    from modelopt.torch.export.quant_utils import pack_int4_in_uint8

    model = _calibrated("llama", ql.INT4_AWQ_CFG)  # siblings share their scales (they fold into the norms)
    o = "model.layers.0.self_attn.o_proj"
    with torch.no_grad():
        _pqs(model, o).reshape(2, 2, 32)[:, 1] *= 2  # its query heads disagree (GQA): it folds nowhere, so it is carried
    export_checkpoint(model, tmp_path / "c", "modelopt_int4_awq")
    hf_quant = json.loads((tmp_path / "c" / "hf_quant_config.json").read_text())["quantization"]
    assert (hf_quant["quant_algo"], hf_quant["group_size"], hf_quant["pre_quant_scale"]) == ("W4A16_AWQ", 128, True)
    sd = load_file(tmp_path / "c" / "model.safetensors")
    assert torch.equal(sd[f"{o}.pre_quant_scale"], _pqs(model, o))
    assert "model.layers.0.mlp.down_proj.pre_quant_scale" not in sd  # folded into up_proj's rows
    assert "model.layers.0.self_attn.q_proj.pre_quant_scale" not in sd  # folded into input_layernorm
    m = model.get_submodule(o)
    fq = m.quantize_weight(m.weight).detach()
    assert torch.equal(pack_int4_in_uint8(fq, sd[f"{o}.weight_scale"], 128), sd[f"{o}.weight"])  # ModelOpt's packing of our weights
    packed = sd[f"{o}.weight"]
    codes = torch.stack([(packed & 0xF).to(torch.int8), (packed >> 4).to(torch.int8)], 1).reshape(-1, packed.shape[1])
    codes = torch.where(codes > 7, codes - 16, codes)
    got = codes.float() * sd[f"{o}.weight_scale"].repeat_interleave(128, dim=1)
    assert (got - fq).abs().max() <= 1e-6 * fq.abs().max()


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_modelopt_int4_awq_siblings_with_their_own_scales_refused(tmp_path, family):
    """ModelOpt's exporter resmooths q/k/v and gate/up to one pre_quant_scale (TensorRT-LLM runs each group as one GEMM on one
    scaled input); quantlib's AWQ searches each linear on its own, so unshared siblings are refused, naming both."""
    model = _calibrated(family, ql.INT4_AWQ_CFG, share=False)
    with pytest.raises(ExportError, match=r"^model.layers.0.self_attn.k_proj.input_quantizer and "
                                          r"model.layers.0.self_attn.q_proj.input_quantizer: "
                                          r"siblings fused by consumers into one GEMM need one pre_quant_scale, but differ; call "
                                          r"quantlib.export.share_pre_quant_scale"):
        export_checkpoint(model, tmp_path / "c", "modelopt_int4_awq")
    assert not (tmp_path / "c").exists()


def test_model_without_fold_rules_refused(tmp_path):
    from torch import nn

    model = ql.quantize(nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 64)), ql.INT4_AWQ_CFG, lambda m: m(torch.randn(4, 64)))
    with pytest.raises(ExportError, match=r"^0.input_quantizer: pre_quant_scale is set .*no fold rule for this module.*format ct_int_pack "
                                          r"has no pre_quant_scale tensor"):
        export_checkpoint(model, tmp_path / "c", "ct_int_pack")


def test_gpt_neox_layernorm_folds(tmp_path):
    """GPT-NeoX: LayerNorm (weight and bias) before the fused query_key_value and dense_h_to_4h; its o-proj
    (dense) and dense_4h_to_h (after GELU) have no fold, so they stay out of AWQ here."""
    from transformers import GPTNeoXConfig, GPTNeoXForCausalLM

    torch.manual_seed(3)
    model = GPTNeoXForCausalLM(GPTNeoXConfig(vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                                             num_attention_heads=4,
                                             max_position_embeddings=64, tie_word_embeddings=False)).eval()  # fmt: skip
    cfg = copy.deepcopy(ql.INT4_AWQ_CFG)
    cfg["quant_cfg"].update({"*attention.dense*": {"enable": False}, "*dense_4h_to_h*": {"enable": False},
                             "*embed_out*": {"enable": False}})
    ql.quantize(model, cfg, _loop)
    assert _pqs(model, "gpt_neox.layers.0.attention.query_key_value") is not None
    export_checkpoint(model, tmp_path / "c", "ct_int_pack")
    sd = load_file(tmp_path / "c" / "model.safetensors")
    norm, p = model.gpt_neox.layers[1].input_layernorm, _pqs(model, "gpt_neox.layers.1.attention.query_key_value")
    assert torch.equal(sd["gpt_neox.layers.1.input_layernorm.bias"], norm.bias.float() * p.float())
    _assert_close(_ct_logits(tmp_path / "c"), _weight_only_logits(model))


def test_fused_experts_scale_refused_by_name(tmp_path):
    from tests.test_export._export_models import qwen3_moe

    cfg = copy.deepcopy(ql.INT4_AWQ_CFG)
    cfg["quant_cfg"]["*self_attn*"] = {"enable": False}
    model = qwen3_moe()
    ql.quantize(model, cfg, _loop)
    with pytest.raises(ExportError, match=r"^model.layers.0.mlp.experts.gate_up_proj_input_quantizer: pre_quant_scale of shape \(4, 256\) "
                                          r"\(one row per expert, SmoothQuant / AWQ\) on a QuantQwen3MoeExperts folds nowhere .*"
                                          r"format ct_int_pack has no pre_quant_scale tensor: export to a ModelOpt AWQ format "
                                          r"\(modelopt_int4_awq, "):
        export_checkpoint(model, tmp_path / "c", "ct_int_pack")


def test_carried_scale_of_an_unquantized_module_refused(tmp_path):
    """A module left unquantized is an excluded module to ModelOpt: a pre_quant_scale there would be ignored."""
    model = _calibrated("llama", ql.NVFP4_AWQ_LITE_CFG)
    model.model.layers[0].self_attn.o_proj.weight_quantizer.disable()
    with pytest.raises(ExportError, match=r"^model.layers.0.self_attn.o_proj.input_quantizer: pre_quant_scale is set and folds nowhere .* "
                                          r"left unquantized"):
        export_checkpoint(model, tmp_path / "c", "modelopt_nvfp4")
