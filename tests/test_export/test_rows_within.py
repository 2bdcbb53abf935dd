"""Quantized linears that the checkpoint saves as the rows of one key: Param2 / Sarvam's q / k / v as one
``attention.query_key_value``, HRM-Text's gate / q / k / v as ``attn.gqkv_proj`` and gate / up as ``mlp.gate_up_proj``.
The ModelOpt formats write one quantized key of save_pretrained's name, which ModelOpt's own dequantization turns into
transformers' save of the fake-quantized weights, bit for bit (vLLM's loaders: tests/test_vllm/test_vllm_rows_within.py);
formats transformers would misread, members quantized apart and pre_quant_scales are refused by name."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("modelopt")

import quantlib as ql  # noqa: E402
from quantlib.export import ExportError, export_checkpoint  # noqa: E402
from quantlib.pipeline.check import modelopt_dequantize  # noqa: E402
from tests.test_export import _families  # noqa: E402
from tests.test_export._export_models import fake_quant_weights, quantized, weight_only  # noqa: E402

CONFIGS = {"modelopt_fp8": ql.FP8_DEFAULT_CFG, "modelopt_fp8_pb": weight_only(ql.FP8_2D_BLOCKWISE_WEIGHT_ONLY_CFG),
           "modelopt_nvfp4": ql.NVFP4_DEFAULT_CFG, "modelopt_mxfp8": weight_only(ql.MXFP8_DEFAULT_CFG)}
#: family -> a key saved of several quantized linears
KEYS = {"param2moe": "model.layers.0.attention.query_key_value", "sarvam_moe": "model.layers.0.attention.query_key_value",
        "hrm_text": "model.L_module.layers.0.attn.gqkv_proj"}
_bases: dict = {}


def _base(family: str):
    if not _families.built_here(family):
        pytest.skip(f"this transformers has no {family}")
    if family not in _bases:
        # Param2 with q / k / v biases, saved as query_key_value.bias beside the quantized weight
        _bases[family] = _families.build(family, **({"attention_bias": True} if family == "param2moe" else {}))
        with torch.no_grad():
            for n, p in _bases[family].named_parameters():
                if n.endswith(".bias"):
                    p.normal_()
    return _bases[family]


def _saved_fake_quant(model) -> dict[str, torch.Tensor]:
    """transformers' save of the model with every quantized weight replaced by its fake quantization: the keys and the
    tensors a consumer must dequantize the export to."""
    from transformers.core_model_loading import revert_weight_conversion

    fq = {f"{n}.weight": w for n, w in fake_quant_weights(model).items()}  # experts by their checkpoint names
    state = {k: fq.get(k, t.detach()) for k, t in model.state_dict().items() if "_quantizer" not in k}
    return {**revert_weight_conversion(model, state), **fq}


@pytest.mark.parametrize("fmt", sorted(CONFIGS))
@pytest.mark.parametrize("family", sorted(KEYS))
def test_one_key_of_several_quantized_linears_dequantizes_to_their_fake_quant(tmp_path, family, fmt):
    from safetensors.torch import load_file

    base = _base(family)
    model = quantized(base, CONFIGS[fmt])  # share_sibling_amax: the members of a key share its per-tensor scale
    if fmt == "modelopt_fp8_pb":  # no MoE experts in FP8_PB_WO (vLLM cannot load them)
        ql.disable_quantizer(model, "*experts*")
    manifest = export_checkpoint(model, tmp_path / "c", fmt)
    assert KEYS[family] in manifest.quantized_modules
    got = load_file(tmp_path / "c" / "model.safetensors")
    want = _saved_fake_quant(model)
    modules = {k.rpartition(".")[0] for k, t in got.items() if k.endswith(".weight") and t.element_size() == 1}
    assert KEYS[family] in modules and {f"{m}.weight" for m in modules} <= set(want)
    for m in modules:
        tensors = {k.rpartition(".")[2]: t for k, t in got.items() if k.rpartition(".")[0] == m}
        ref = want[f"{m}.weight"]
        assert torch.equal(modelopt_dequantize(fmt, tensors, ref.shape).float(), ref.float()), m
        if "bias" in tensors:
            assert torch.equal(tensors["bias"], want[f"{m}.bias"]), m
    assert family != "param2moe" or f"{KEYS[family]}.bias" in got
    plain = {k: t for k, t in got.items() if k.rpartition(".")[0] not in modules}
    assert set(plain) <= set(want) and all(torch.equal(t, want[k].to(t.dtype)) for k, t in plain.items())


@pytest.mark.parametrize("family", sorted(KEYS))
def test_formats_transformers_would_misread_refuse_the_key(tmp_path, family):
    """transformers 5.25 loads the key's codes as the split weights and drops its scales (only its load report says so)."""
    model = quantized(_base(family), weight_only(ql.MXFP8_DEFAULT_CFG))
    for fmt in ("ct_mxfp8", "hf_mxfp8"):
        with pytest.raises(ExportError, match=rf"^{KEYS[family]} \(.*: transformers saves these weights as one key, "
                                              rf"{KEYS[family]}\.weight, and format {fmt} has no consumer that reads it quantized"):
            export_checkpoint(model, tmp_path / fmt, fmt)
        assert not (tmp_path / fmt).exists()


def test_members_quantized_apart_are_refused(tmp_path):
    model = quantized(_base("hrm_text"), weight_only(ql.MXFP8_DEFAULT_CFG))
    ql.disable_quantizer(model, "*self_attn.gate_proj*")  # no sibling of q / k / v: only the key ties it to them
    with pytest.raises(ExportError, match=r"q_proj.weight_quantizer is enabled, but transformers saves model.L_module.layers.0.self_attn"
                                          r".q_proj.weight within model.L_module.layers.0.attn.gqkv_proj.weight with "
                                          r"\['model.L_module.layers.0.self_attn.gate_proj.weight'\], which are not quantized"):
        export_checkpoint(model, tmp_path / "c", "modelopt_mxfp8")
    mx = {"num_bits": (4, 3), "block_sizes": {-1: 32, "type": "dynamic", "scale_bits": (8, 0)}}
    fp8 = {"num_bits": (4, 3), "axis": None}
    rules = {"*weight_quantizer": mx, "*v_proj*weight_quantizer": fp8, "default": {"enable": False}}
    model = quantized(_base("param2moe"), {"quant_cfg": rules, "algorithm": "max"})
    with pytest.raises(ExportError, match=r"v_proj.weight_quantizer = fp8 .* and model.layers.0.self_attn.q_proj.weight_quantizer = mx"
                                          r".*: transformers saves them as one tensor \(model.layers.0.attention.query_key_value\)"):
        export_checkpoint(model, tmp_path / "c", "modelopt_mixed")


def test_per_tensor_scales_must_be_shared(tmp_path):
    model = quantized(_base("param2moe"), ql.FP8_DEFAULT_CFG, share_siblings=False)
    q = model.model.layers[0].self_attn.k_proj.weight_quantizer
    q.amax = q.amax * 2
    with pytest.raises(ExportError, match=r"are saved as one tensor with one scale, but their amax differ .*share_sibling_amax"):
        export_checkpoint(model, tmp_path / "c", "modelopt_fp8")


def test_a_pre_quant_scale_of_a_member_is_refused(tmp_path):
    """NVFP4_AWQ would carry each member's scale under its own name, where no loader of the key looks."""
    model = quantized(_base("param2moe"), ql.NVFP4_AWQ_LITE_CFG)
    attn = model.model.layers[0].self_attn
    for m in (attn.k_proj, attn.v_proj):  # one input scale, as the key needs: only the pre_quant_scale is left to refuse
        m.input_quantizer.amax = attn.q_proj.input_quantizer.amax.clone()
    with pytest.raises(ExportError, match=r"self_attn.q_proj.input_quantizer: a pre_quant_scale \(SmoothQuant / AWQ\) folds into "
                                          r"model.layers.0.self_attn.q_proj, which the checkpoint saves within "
                                          r"model.layers.0.attention.query_key_value"):
        export_checkpoint(model, tmp_path / "c", "modelopt_nvfp4")


def test_a_bias_of_some_members_only_is_refused(tmp_path):
    """q and k with biases, v without: the key's bias is not every member's, so none is written rather than a wrong one."""
    import copy

    base = copy.deepcopy(_base("param2moe"))
    base.model.layers[0].self_attn.v_proj.bias = None
    model = quantized(base, weight_only(ql.MXFP8_DEFAULT_CFG))
    with pytest.raises(ExportError, match=r"q_proj.weight_quantizer, .*v_proj.weight_quantizer: their bias is not saved as "
                                          r"model.layers.0.attention.query_key_value.bias of all of them"):
        export_checkpoint(model, tmp_path / "c", "modelopt_mxfp8")
    assert not (tmp_path / "c").exists()
