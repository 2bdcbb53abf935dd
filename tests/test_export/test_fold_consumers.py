"""Every AWQ (lite / clip / full) and SmoothQuant recipe exported to every format of its weight scheme, on a
dense GQA family (Llama), one with q/k/v biases (Qwen2) and two MoE families (Qwen3-MoE, Mixtral: attention
under AWQ): the consumer's logits (transformers' compressed-tensors or FP8 loader where it runs the format,
else the format's own dequantizer, weights put into the model) equal quantlib's fake-quant model's with
activations unquantized; a pair no format can express is refused by name."""

from __future__ import annotations

import copy
import re

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("compressed_tensors")

import quantlib as ql  # noqa: E402
from quantlib.export import ExportError, export_checkpoint, share_pre_quant_scale, share_sibling_amax  # noqa: E402
from quantlib.pipeline.check import checkpoint_shapes, reload_export  # noqa: E402
from tests.test_export._families import build, tokens  # noqa: E402

#: blocks of 128 (INT4 along the input dim, FP8 128x128) need 128 features (k/v 128x128: whole FP8 blocks); GQA: 4 query
#: heads on 2 kv heads
SHAPE = dict(hidden_size=128, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=64)
MOE = {"qwen3_moe": dict(moe_intermediate_size=128), "mixtral": {}, "phimoe": {},
       "qwen2_moe": dict(moe_intermediate_size=128, shared_expert_intermediate_size=128)}


def _algo(preset: dict, method: str, **kw) -> dict:
    return {**copy.deepcopy(preset), "algorithm": {"method": method, **kw}}


def _no_row_producers(preset: dict) -> dict:
    """``preset`` with o_proj / down_proj unquantized: their producers (v_proj, up_proj) have no scale per output row
    in FP8 / MX / NVFP4 formats, so only the norms take a scale."""
    cfg = copy.deepcopy(preset)
    cfg["quant_cfg"].update({"*o_proj*": {"enable": False}, "*down_proj*": {"enable": False}})
    return cfg


FP8_BLOCK = ql.FP8_2D_BLOCKWISE_WEIGHT_ONLY_CFG
_NVFP4_ROWS = r"v_proj.weight_quantizer \(nvfp4\) has no scale per output row"
#: recipe -> (config, {format: None (exports, logits compared) or the refusal's pattern})
RECIPES = {
    "int4_awq_lite": (_algo(ql.INT4_AWQ_CFG, "awq_lite", alpha_step=0.5), {"ct_int_pack": None, "modelopt_int4_awq": None}),
    "int4_awq_clip": (_algo(ql.INT4_AWQ_CFG, "awq_clip"), {"ct_int_pack": None, "modelopt_int4_awq": None}),
    "int4_awq_full": (_algo(ql.INT4_AWQ_CFG, "awq_full", alpha_step=0.5), {"ct_int_pack": None, "modelopt_int4_awq": None}),
    "int8_smoothquant": (ql.INT8_SMOOTHQUANT_CFG, {"ct_int8": None}),
    "nvfp4_awq_lite": (_algo(ql.NVFP4_AWQ_LITE_CFG, "awq_lite", alpha_step=0.5), {"modelopt_nvfp4": None, "ct_nvfp4": _NVFP4_ROWS}),
    "nvfp4_awq_full": (_algo(ql.NVFP4_AWQ_FULL_CFG, "awq_full", alpha_step=0.5), {"modelopt_nvfp4": None, "ct_nvfp4": _NVFP4_ROWS}),
    "nvfp4_awq_clip": (ql.NVFP4_AWQ_CLIP_CFG, {"modelopt_nvfp4": None, "ct_nvfp4": None}),
    "nvfp4_awq_norms": (_no_row_producers(_algo(ql.NVFP4_AWQ_LITE_CFG, "awq_lite", alpha_step=0.5)), {"ct_nvfp4": None,
                                                                                                        "modelopt_nvfp4": None}),
    "w4a8_awq": (_algo(ql.W4A8_AWQ_BETA_CFG, "awq_lite", alpha_step=0.5), {"modelopt_w4a8_awq": None}),
    "fp8_block_awq": (_no_row_producers(_algo(FP8_BLOCK, "awq_lite", alpha_step=0.5)), {"hf_fp8_block": None, "ct_fp8_block": None,
                                                                                          "modelopt_fp8_pb": None}),
    "fp8_block_smoothquant": (_no_row_producers(_algo(FP8_BLOCK, "smoothquant")), {"hf_fp8_block": None, "ct_fp8_block": None}),
}  # fmt: skip
#: family -> its recipes: every recipe on the dense GQA family; on the others, each algorithm and format once at least
FAMILIES = {
    "llama": tuple(RECIPES),
    "qwen2": ("int4_awq_lite", "int8_smoothquant", "nvfp4_awq_full", "w4a8_awq", "fp8_block_awq"),  # biases of q/k/v take the fold
    "qwen3_moe": ("int4_awq_full", "int8_smoothquant", "nvfp4_awq_lite", "w4a8_awq", "fp8_block_smoothquant"),
    "mixtral": ("int4_awq_lite", "int4_awq_clip", "nvfp4_awq_norms", "fp8_block_awq"),
    "phimoe": ("int8_smoothquant",),  # LayerNorm (weight and bias), q/k/v/o biases
}
#: transformers runs these formats itself on the CPU (compressed-tensors dequantized on load, fine-grained FP8)
TRANSFORMERS = ("ct_int_pack", "ct_int8", "ct_fp8_block", "hf_fp8_block")


def _loop(model):
    model(tokens(5))


@pytest.fixture(scope="module")
def calibrated():
    cache: dict[tuple[str, str], torch.nn.Module] = {}

    def get(family: str, recipe: str) -> torch.nn.Module:
        if (family, recipe) not in cache:
            model = build(family, **SHAPE, **MOE.get(family, {}))
            cfg = copy.deepcopy(RECIPES[recipe][0])
            if family in MOE:  # experts stay unquantized here (AWQ on the experts: test_fold_experts.py)
                cfg["quant_cfg"]["*experts*"] = {"enable": False}
            ql.quantize(model, cfg, _loop)
            ql.disable_quantizer(model, "*lm_head*")
            share_pre_quant_scale(model, _loop)
            share_sibling_amax(model)
            cache[family, recipe] = model
        return cache[family, recipe]

    return get


def _reference(model) -> torch.Tensor:
    """The fake-quant model's logits with activations unquantized, as a consumer that dequantizes weights runs it
    (pre_quant_scale still multiplies the input: the input quantizer applies it even when disabled)."""
    model = copy.deepcopy(model)
    ql.disable_quantizer(model, "*input_quantizer")
    with torch.no_grad():
        return model(tokens()).logits


def _consumer(model, family: str, out_dir, fmt: str) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM, CompressedTensorsConfig

    # transformers' compressed-tensors loader decompresses every MoE expert by the packed scheme, even an excluded one
    if fmt in TRANSFORMERS and (family not in MOE or fmt.endswith("fp8_block")):
        kw = {"quantization_config": CompressedTensorsConfig(dequantize=True)} if fmt.startswith("ct_") else {}
        return AutoModelForCausalLM.from_pretrained(out_dir, dtype=torch.float32, **kw).eval()
    # compressed-tensors' or ModelOpt's own dequantizer
    loaded, consumer, why = reload_export(str(out_dir), fmt, checkpoint_shapes(model), False)
    assert loaded is not None, why
    return loaded


CASES = [(f, r, fmt) for f, recipes in FAMILIES.items() for r in recipes for fmt in RECIPES[r][1]]


@pytest.mark.parametrize("family, recipe, fmt", CASES, ids=["-".join(c) for c in CASES])
def test_consumer_logits_equal_fake_quant(calibrated, tmp_path, family, recipe, fmt):
    model = calibrated(family, recipe)
    refusal = RECIPES[recipe][1][fmt]
    if refusal is not None:
        with pytest.raises(ExportError, match=r"^model\.layers\.0\.self_attn\.o_proj\.input_quantizer: .*" + refusal):
            export_checkpoint(model, tmp_path / "c", fmt)
        assert not (tmp_path / "c").exists()
        return
    manifest = export_checkpoint(model, tmp_path / "c", fmt)
    assert "model.layers.0.self_attn.q_proj" in manifest.quantized_modules
    with torch.no_grad():
        got = _consumer(model, family, tmp_path / "c", fmt)(tokens()).logits
    ref = _reference(model)
    # INT: the consumer multiplies by a stored 1/s where quantlib divides by s, and the folded norms and row scales
    # round once more: a few ulps of a weight. compressed-tensors dequantizes NVFP4 in bf16 (1 bf16 ulp of a weight).
    tol = 2e-2 if fmt == "ct_nvfp4" else 1e-5
    assert (got - ref).abs().max() <= tol * ref.abs().max(), float((got - ref).abs().max())


def test_qwen2_moe_shared_expert(calibrated, tmp_path):
    """Qwen2-MoE's shared expert reads the post-attention norm with the router and the experts: its gate/up scale folds
    nowhere (compressed-tensors refuses it by name; ModelOpt's W4A16_AWQ carries it), its down_proj's folds into its up_proj."""
    model = calibrated("qwen2_moe", "int4_awq_lite")
    shared = "model.layers.0.mlp.shared_expert"
    with pytest.raises(ExportError, match=rf"^{re.escape(shared)}.gate_proj.input_quantizer: .*no fold rule for this module.*ct_int_pack"):
        export_checkpoint(model, tmp_path / "ct", "ct_int_pack")
    export_checkpoint(model, tmp_path / "c", "modelopt_int4_awq")
    from safetensors.torch import load_file

    carried = sorted(k for k in load_file(tmp_path / "c" / "model.safetensors") if k.endswith("pre_quant_scale"))
    assert carried == [f"{shared}.gate_proj.pre_quant_scale", f"{shared}.up_proj.pre_quant_scale"]
    with torch.no_grad():
        got = _consumer(model, "qwen2_moe", tmp_path / "c", "modelopt_int4_awq")(tokens()).logits
    ref = _reference(model)
    assert (got - ref).abs().max() <= 1e-5 * ref.abs().max(), float((got - ref).abs().max())


def test_gemma_norm_takes_no_scale(calibrated, tmp_path):
    """Gemma's norms compute ``(1 + weight) * normalized``: no fold rule; compressed-tensors refuses by name, ModelOpt's
    W4A16_AWQ carries every scale (q/k/v and gate/up shared by share_pre_quant_scale as siblings) and gives the logits."""
    model = calibrated("gemma", "int4_awq_lite")
    with pytest.raises(ExportError, match=r"^model\.layers\.0\.self_attn\.q_proj\.input_quantizer: .*no fold rule for this module"):
        export_checkpoint(model, tmp_path / "ct", "ct_int_pack")
    export_checkpoint(model, tmp_path / "c", "modelopt_int4_awq")
    with torch.no_grad():
        got = _consumer(model, "gemma", tmp_path / "c", "modelopt_int4_awq")(tokens()).logits
    ref = _reference(model)
    assert (got - ref).abs().max() <= 1e-5 * ref.abs().max(), float((got - ref).abs().max())
