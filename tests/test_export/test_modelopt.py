"""ModelOpt's own qtensor ``dequantize`` on quantlib's ModelOpt-format exports (FP8, FP8_PB_WO, NVFP4,
MXFP8): value-equal to quantlib's fake-quantized weights; config.json's quantization_config is what
ModelOpt's ``convert_hf_quant_config_format`` makes of hf_quant_config.json. Needs nvidia-modelopt."""

from __future__ import annotations

import copy
import json
import warnings

import pytest
import torch

pytest.importorskip("transformers")
with warnings.catch_warnings():
    warnings.simplefilter("ignore")  # "transformers X is not tested with this modelopt"
    qtensor = pytest.importorskip("modelopt.torch.quantization.qtensor")
    from modelopt.torch.export.convert_hf_config import convert_hf_quant_config_format  # noqa: E402
from safetensors.torch import load_file  # noqa: E402

import quantlib as ql  # noqa: E402
from quantlib.export import ExportError, export_checkpoint  # noqa: E402
from quantlib.pipeline.check import modelopt_dequantize  # noqa: E402
from tests.test_export._export_models import fake_quant_weights, llama, quantized, qwen3_moe, weight_only  # noqa: E402

CASES = {
    "modelopt_fp8": ql.FP8_DEFAULT_CFG,
    "modelopt_fp8_pb": weight_only(ql.FP8_2D_BLOCKWISE_WEIGHT_ONLY_CFG),
    "modelopt_nvfp4": weight_only(ql.NVFP4_DEFAULT_CFG),
    "modelopt_mxfp8": weight_only(ql.MXFP8_DEFAULT_CFG),
}


@pytest.fixture(scope="module")
def bases():
    return {"llama": llama(), "qwen3_moe": qwen3_moe()}


def _dequantize(fmt: str, t: dict, shape) -> torch.Tensor:
    if fmt == "modelopt_fp8_pb":
        assert t["weight_scale"].dim() == 4
    elif fmt == "modelopt_fp8":
        assert t["weight_scale"].dim() == 0 and t["input_scale"].dim() == 0
    return modelopt_dequantize(fmt, t, shape)


@pytest.mark.parametrize("fmt", sorted(CASES))
@pytest.mark.parametrize("family", ["llama", "qwen3_moe"])
def test_modelopt_dequantize_value_equal(bases, tmp_path, fmt, family):
    model = quantized(bases[family], CASES[fmt])
    if fmt == "modelopt_fp8_pb" and family == "qwen3_moe":
        # vLLM's ModelOpt FP8 MoE loader fails on block-scaled experts ("shape '[]' is invalid for input of size 2")
        with pytest.raises(ExportError, match=r"model\.layers\.0\.mlp\.experts\.gate_up_proj_weight_quantizer\[0\]: expert 0: format "
                                              r"modelopt_fp8_pb cannot carry MoE experts"):
            export_checkpoint(model, tmp_path / "c", fmt)
        assert not list(tmp_path.iterdir())
        ql.disable_quantizer(model, "*experts*")  # the dense layers still export
        fmt_ok = export_checkpoint(model, tmp_path / "c", fmt)
        assert "model.layers.0.self_attn.q_proj" in fmt_ok.quantized_modules and not [n for n in fmt_ok.quantized_modules
                                                                                      if ".experts." in n]
        return
    export_checkpoint(model, tmp_path / "c", fmt)
    hf_quant = json.loads((tmp_path / "c" / "hf_quant_config.json").read_text())
    qc = json.loads((tmp_path / "c" / "config.json").read_text())["quantization_config"]
    assert qc == convert_hf_quant_config_format(hf_quant)
    assert {"quant_algo", "kv_cache_quant_algo", "exclude_modules"} <= set(hf_quant["quantization"])
    sd = load_file(tmp_path / "c" / "model.safetensors")
    for name, ref in fake_quant_weights(model).items():
        t = {k.rpartition(".")[2]: v for k, v in sd.items() if k.rpartition(".")[0] == name}
        got = _dequantize(fmt, t, ref.shape)
        assert torch.equal(got, ref.float()), name


@pytest.mark.parametrize("family", ["llama", "qwen3_moe"])
def test_modelopt_dequantize_equals_fake_quant_with_swept_static_block_scales(bases, tmp_path, family):
    model = quantized(bases[family], weight_only(ql.NVFP4_W4A4_WEIGHT_MSE_FP8_SWEEP_CFG))
    statics = [q for q in model.modules() if isinstance(q, ql.TensorQuantizer) and q.block_amax is not None]
    assert statics
    if family == "llama":  # the search ran against the global amax q/k/v share (as ModelOpt's shared state)
        attn = model.model.layers[0].self_attn
        assert torch.equal(attn.q_proj.weight_quantizer.amax, attn.k_proj.weight_quantizer.amax)
        assert torch.equal(attn.q_proj.weight_quantizer.amax, attn.v_proj.weight_quantizer.amax)
        fresh = ql.quantize(copy.deepcopy(bases[family]), weight_only(ql.NVFP4_W4A4_WEIGHT_MSE_FP8_SWEEP_CFG), lambda m: None)
        k = fresh.model.layers[0].self_attn.k_proj
        assert torch.equal(k.weight_quantizer.amax, attn.k_proj.weight_quantizer.amax)
        assert len({float(p.weight.abs().max()) for p in (attn.q_proj, attn.k_proj, attn.v_proj)}) > 1  # not the same by chance
    export_checkpoint(model, tmp_path / "c", "modelopt_nvfp4")
    sd = load_file(tmp_path / "c" / "model.safetensors")
    for name, ref in fake_quant_weights(model).items():
        t = {k.rpartition(".")[2]: v for k, v in sd.items() if k.rpartition(".")[0] == name}
        assert torch.equal(_dequantize("modelopt_nvfp4", t, ref.shape), ref.float()), name
