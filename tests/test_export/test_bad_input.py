"""Bad input: each case a clear ExportError naming the module, quantizer and value, and nothing written."""

from __future__ import annotations

import os

import pytest
import torch
from torch import nn

import quantlib as ql
from quantlib.export import ExportError, ModelLayout, export_checkpoint

FP8_BLOCK_W = {"quant_cfg": {"*weight_quantizer": {"num_bits": (4, 3), "block_sizes": {-1: 128, -2: 128}}, "default": {"enable": False}},
               "algorithm": "max"}


def mlp(d_out: int = 256, cfg: dict = FP8_BLOCK_W) -> nn.Module:
    torch.manual_seed(0)
    return ql.quantize(nn.Sequential(nn.Linear(256, 512), nn.GELU(), nn.Linear(512, d_out)), cfg)


def refused(tmp_path, model, fmt, match, **kw):
    with pytest.raises(ExportError, match=match):
        export_checkpoint(model, tmp_path / "out", fmt, **kw)
    assert os.listdir(tmp_path) == []


def test_sibling_amax_differ_refused_then_unified(tmp_path):
    pytest.importorskip("transformers")
    from tests.test_export._export_models import llama, quantized, weight_only

    model = quantized(llama(), weight_only(ql.NVFP4_DEFAULT_CFG), share_siblings=False)
    refused(tmp_path, model, "ct_nvfp4", r"siblings \('model.layers.0.self_attn.q_proj', .*k_proj', .*v_proj'\) .* differ: "
                                         r"model.layers.0.self_attn.q_proj.weight_quantizer = ")
    man = export_checkpoint(model, tmp_path / "out", "ct_nvfp4", unify_siblings=True)
    group = ("model.layers.1.mlp.gate_proj", "model.layers.1.mlp.up_proj")
    amax = [float(model.get_submodule(n).weight_quantizer.amax) for n in group]
    assert man.unified_siblings[group] == max(amax) and len(man.unified_siblings) == 4
    from safetensors.torch import load_file

    sd = load_file(tmp_path / "out" / "model.safetensors")
    gs = [sd[f"{n}.weight_global_scale"] for n in group]
    assert torch.equal(gs[0], gs[1]) and float(gs[0]) == float(torch.reciprocal(torch.tensor(max(amax)) / torch.tensor(2688.0)))
    assert float(model.get_submodule(group[0]).weight_quantizer.amax) == amax[0]  # the model is left as it was


def test_expert_without_amax(tmp_path):
    pytest.importorskip("transformers")
    from tests.test_export._export_models import quantized, qwen3_moe, weight_only

    model = quantized(qwen3_moe(), weight_only(ql.FP8_2D_BLOCKWISE_WEIGHT_ONLY_CFG))
    model.model.layers[1].mlp.experts.gate_up_proj_weight_quantizer[2].reset_amax()
    refused(tmp_path, model, "hf_fp8_block", r"model.layers.1.mlp.experts.gate_up_proj_weight_quantizer\[2\]: expert 2 weight quantizer "
                                             r"has no amax")


def test_nan_amax(tmp_path):
    model = mlp()
    amax = model[2].weight_quantizer.amax.clone()
    amax[1, 0] = float("nan")
    model[2].weight_quantizer.amax = amax
    refused(tmp_path, model, "ct_fp8_block", r"^2.weight_quantizer: amax holds NaN")


def test_block_does_not_divide_weight(tmp_path):
    refused(tmp_path, mlp(d_out=200), "hf_fp8_block", r"^2.weight_quantizer: weight 200x512 is not a whole number of 128x128 blocks")


def test_block_does_not_divide_tp_shard(tmp_path):
    model = mlp(d_out=384)
    layout = ModelLayout("two-linears", column=frozenset({"2"}))
    export_checkpoint(model, tmp_path / "tp1", "ct_fp8_block", layout=layout)  # whole: 3 blocks of 128 rows
    os.rename(tmp_path / "tp1", tmp_path.parent / f"{tmp_path.name}-tp1")
    refused(tmp_path, model, "ct_fp8_block", r"^2.weight_quantizer: at tensor parallel 2 the rows \(384\) split into shards of 192, not a "
                                             r"whole number of blocks of 128", layout=layout, tp=2)


def test_format_cannot_carry_weight_quantizer(tmp_path):
    model = mlp(cfg=ql.INT8_WEIGHT_ONLY_CFG)
    refused(tmp_path, model, "hf_fp8_block", r"^0.weight_quantizer = int num_bits=8: format hf_fp8_block cannot carry it \(needs FP8 E4M3 "
                                             r"weights in 2-D blocks")


def test_format_cannot_carry_input_quantizer(tmp_path):
    cfg = {"quant_cfg": {**FP8_BLOCK_W["quant_cfg"], "*input_quantizer": {"num_bits": (4, 3), "axis": None}}, "algorithm": "max"}
    model = ql.quantize(nn.Sequential(nn.Linear(256, 256)), cfg, lambda m: m(torch.randn(4, 256)))
    refused(tmp_path, model, "hf_fp8_block", r"^0.input_quantizer = fp8 element=\(4, 3\): format hf_fp8_block cannot carry it")


@pytest.mark.parametrize("preset,what", [("MXFP6_DEFAULT_CFG", r"mx element=\(3, 2\) block=\(32,\) dynamic"),
                                         ("MXINT8_DEFAULT_CFG", r"mx num_bits=8 block=\(32,\) dynamic")])
@pytest.mark.parametrize("fmt", ["ct_mxfp8", "ct_mxfp4", "hf_mxfp8", "modelopt_mxfp8", "ct_int8", "ct_int_pack", "ct_fp8_block",
                                 "modelopt_fp8"])
def test_no_format_carries_mxfp6_or_mxint8(tmp_path, preset, what, fmt):
    # no consumer format (compressed-tensors 0.20, HF, ModelOpt's checkpoints) has MXFP6 or MXINT8 weights
    model = mlp(cfg=ql.PRESETS[preset])
    refused(tmp_path, model, fmt, rf"^0.weight_quantizer = {what}: format {fmt} cannot carry it")


def test_ue8m0_needs_pow2_scales(tmp_path):
    refused(tmp_path, mlp(), "hf_fp8_block_ue8m0", r"ue8m0 scales need power-of-two block scales \(pow2_scale=True\)")


def test_existing_non_empty_dir(tmp_path):
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "x").write_text("keep")
    with pytest.raises(ExportError, match="exists and is not empty; pass overwrite=True"):
        export_checkpoint(mlp(), tmp_path / "out", "ct_fp8_block")
    assert os.listdir(tmp_path / "out") == ["x"]


def test_unknown_format():
    with pytest.raises(ExportError, match="unknown export format 'gguf'"):
        export_checkpoint(mlp(), "/nonexistent/out", "gguf")


def test_format_cannot_carry_expert_quantizer_names_the_member(tmp_path):
    pytest.importorskip("transformers")
    from tests.test_export._export_models import quantized, qwen3_moe

    cfg = {"quant_cfg": {"*experts*weight_quantizer": {"num_bits": 8, "axis": 0}, "default": {"enable": False}}, "algorithm": "max"}
    model = quantized(qwen3_moe(), cfg)
    refused(tmp_path, model, "ct_mxfp8", r"^model.layers.0.mlp.experts.gate_up_proj_weight_quantizer\[0\] = int num_bits=8: format "
                                         r"ct_mxfp8 cannot carry it")


def test_pre_quant_scale_refused(tmp_path):
    """A SmoothQuant / AWQ scale on a quantizer: no format carries it, so the export must not drop it silently."""
    from quantlib.export.weight_sync import serialize_weight

    model = mlp()
    model[2].input_quantizer.pre_quant_scale = torch.full((512,), 0.5)
    refused(tmp_path, model, "ct_fp8_block", r"^2.input_quantizer: pre_quant_scale is set")
    model = mlp()
    model[0].weight_quantizer.pre_quant_scale = torch.full((256,), 2.0)
    with pytest.raises(ExportError, match=r"^0.weight_quantizer: pre_quant_scale is set"):
        list(serialize_weight("0.weight", model[0].weight, model[0].weight_quantizer, "ct_fp8_block"))


@pytest.mark.parametrize("fmt", ["ct_nvfp4", "modelopt_nvfp4"])
def test_nvfp4_blocks_of_32_refused_by_the_nvfp4_formats(tmp_path, fmt):
    refused(tmp_path, mlp(cfg=ql.W4A8_NVFP4_FP8_CFG), fmt, r"0.weight_quantizer = nvfp4 .*block=\(32,\).*per 16")


def test_static_block_siblings_with_other_global_amax_refused_even_with_unify(tmp_path):
    pytest.importorskip("transformers")
    from tests.test_export._export_models import llama, quantized, weight_only

    model = quantized(llama(), weight_only(ql.NVFP4_W4A4_WEIGHT_MSE_FP8_SWEEP_CFG), share_siblings=False)
    q = model.model.layers[0].self_attn.q_proj.weight_quantizer
    q.amax = q.amax * 2  # as if changed after the search: its block scales were chosen against another one
    refused(tmp_path, model, "modelopt_nvfp4", r"q_proj.weight_quantizer has static NVFP4 block scales", unify_siblings=True)


@pytest.mark.parametrize("cfg,fmt,scales,amax", [
    (FP8_BLOCK_W, "hf_fp8_block", "calibrated", r"amax of shape \(4, 2\)"),
    (FP8_BLOCK_W, "ct_fp8_block", "static", r"amax of shape \(4, 2\)"),
    (ql.INT8_WEIGHT_ONLY_CFG, "ct_int8", "dynamic", r"amax of shape \(512, 1\)"),
    (ql.INT4_BLOCKWISE_WEIGHT_ONLY_CFG, "ct_int_pack", "calibrated", r"amax of shape \(512, 2\)"),
    (ql.NVFP4_W4A4_WEIGHT_MSE_FP8_SWEEP_CFG, "modelopt_nvfp4", "calibrated", r"block amax of shape \(512, 16\)"),
])  # fmt: skip
def test_tensor_rows_not_the_quantizers_refused(tmp_path, cfg, fmt, scales, amax):
    # a tensor of other rows than the weight its quantizer's per-row / per-block amax was calibrated on: those scales
    # belong to other rows (before: a raw RuntimeError / ValueError from the cast, or half an export written)
    from quantlib.export.weight_sync import serialize_weight

    torch.manual_seed(0)
    model = ql.quantize(nn.Sequential(nn.Linear(256, 512)), cfg, lambda m: m(torch.randn(4, 256)))
    with pytest.raises(ExportError, match=rf"^0.weight_quantizer: weight 0 of shape \(384, 256\) does not match its quantizer's {amax}"):
        list(serialize_weight("0.weight", torch.randn(384, 256), model[0], fmt, scales=scales))
    model[0].weight = nn.Parameter(torch.randn(384, 256))  # resized after calibration
    refused(tmp_path, model, fmt, rf"^0.weight_quantizer: weight 0 of shape \(384, 256\) does not match its quantizer's {amax}")


@pytest.mark.parametrize("fmt", ["modelopt_w4a8_awq", "hf_fp8_block"])
def test_chain_with_its_first_member_off_is_refused_not_written_unquantized(tmp_path, fmt):
    # a SequentialQuantizer reads as enabled by its first member: with that one off and the second on, the model
    # fake-quantizes the weight while the linear's item would go out unquantized
    model = mlp(cfg={**ql.W4A8_AWQ_BETA_CFG, "algorithm": "max"})
    model[0].weight_quantizer[0].disable()
    x = torch.randn(3, 256)
    with torch.no_grad():
        assert not torch.equal(model[0](x), nn.functional.linear(x, model[0].weight, model[0].bias))  # the second member acts
    refused(tmp_path, model, fmt, r"^0.weight_quantizer = SequentialQuantizer \[disabled, fp8.*\]: export formats carry a chain of two "
                                  r"enabled members only")
