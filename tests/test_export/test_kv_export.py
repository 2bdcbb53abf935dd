"""KV-cache scales in export: a tiny Llama with FP8_KV_CFG / NVFP4_KV_CFG merged into a weight preset,
exported in each family. compressed-tensors' own parser takes the config (incl. ``kv_cache_scheme``),
ModelOpt's own ``convert_hf_quant_config_format`` gives the written config.json form, and each
``k_scale`` / ``v_scale`` is the multiplier quantlib's fake quantization applies, bit for bit. Formats
without a place for them, NVFP4 KV into compressed-tensors, and uncalibrated KV quantizers are refused
before anything is written."""

from __future__ import annotations

import json
import warnings

import pytest
import torch

pytest.importorskip("transformers")
from safetensors.torch import load_file  # noqa: E402

import quantlib as ql  # noqa: E402
from quantlib.export import ExportError, export_checkpoint, iter_packed  # noqa: E402
from quantlib.formats.fp8 import cast_fp8  # noqa: E402
from quantlib.kv.presets import FP8_KV_CFG, NVFP4_KV_CFG, merge_kv_config  # noqa: E402
from tests.test_export._export_models import llama, quantized, weight_only  # noqa: E402

LAYERS = 2
WEIGHTS = {
    "ct_fp8_block": weight_only(ql.FP8_2D_BLOCKWISE_WEIGHT_ONLY_CFG),
    "ct_nvfp4": weight_only(ql.NVFP4_DEFAULT_CFG),
    "modelopt_fp8": ql.FP8_DEFAULT_CFG,
    "modelopt_nvfp4": weight_only(ql.NVFP4_DEFAULT_CFG),
    "hf_fp8_block": weight_only(ql.FP8_2D_BLOCKWISE_WEIGHT_ONLY_CFG),
}


@pytest.fixture(scope="module")
def base():
    return llama()


def _kv_model(base, fmt: str, kv: dict = FP8_KV_CFG):
    return quantized(base, merge_kv_config(WEIGHTS[fmt], kv))


def _attn(model, layer: int):
    return model.model.layers[layer].self_attn


def _assert_fp8_multiplier(quantizer, scale: torch.Tensor) -> None:
    """``scale`` is the multiplier of the quantizer's fake quant: ``q(x) == fp8(x / scale) * scale`` on
    values spread over the whole E4M3 range, and ``scale`` is fp32 ``1 / (448 / amax)`` bit for bit."""
    amax = quantizer.amax.float()
    expected = torch.reciprocal(torch.tensor(448.0) / amax).reshape(())
    assert scale.dtype == torch.float32
    assert scale.reshape(()).view(torch.int32) == expected.view(torch.int32), (float(scale), float(expected))
    x = torch.linspace(-1.0, 1.0, 4097) * amax * 1.1
    consumer = cast_fp8(x * (torch.tensor(448.0) / amax), (4, 3)).float() * scale.reshape(())
    assert torch.equal(quantizer(x), consumer)


@pytest.mark.parametrize("fmt", ["ct_fp8_block", "ct_nvfp4"])
def test_ct_fp8_kv_scheme_parsed_and_scales_exact(base, tmp_path, fmt):
    from compressed_tensors.quantization import QuantizationConfig, QuantizationStrategy, QuantizationType

    model = _kv_model(base, fmt)
    export_checkpoint(model, tmp_path / "c", fmt)
    qc = json.loads((tmp_path / "c" / "config.json").read_text())["quantization_config"]
    kv = QuantizationConfig.model_validate(qc).kv_cache_scheme  # CT's own parser
    assert kv is not None and kv.num_bits == 8 and kv.type == QuantizationType.FLOAT
    assert kv.strategy == QuantizationStrategy.TENSOR and kv.symmetric and kv.dynamic is False
    sd = load_file(tmp_path / "c" / "model.safetensors")
    assert sorted(k for k in sd if k.endswith(("k_scale", "v_scale"))) == sorted(f"model.layers.{i}.self_attn.{n}_scale"
                                                                                 for i in range(LAYERS) for n in "kv")
    for i in range(LAYERS):
        for n in "kv":
            t = sd[f"model.layers.{i}.self_attn.{n}_scale"]
            assert t.shape == (1,)
            _assert_fp8_multiplier(getattr(_attn(model, i), f"{n}_bmm_quantizer"), t)


@pytest.mark.parametrize("fmt", ["modelopt_fp8", "modelopt_nvfp4"])
def test_modelopt_fp8_kv_algo_and_scales_exact(base, tmp_path, fmt):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "transformers X is not tested with this modelopt"
        convert = pytest.importorskip("modelopt.torch.export.convert_hf_config").convert_hf_quant_config_format
    model = _kv_model(base, fmt)
    export_checkpoint(model, tmp_path / "c", fmt)
    hf_quant = json.loads((tmp_path / "c" / "hf_quant_config.json").read_text())
    assert hf_quant["quantization"]["kv_cache_quant_algo"] == "FP8"
    qc = json.loads((tmp_path / "c" / "config.json").read_text())["quantization_config"]
    assert qc == convert(hf_quant)  # ModelOpt's own config.json form, kv_cache_scheme included
    sd = load_file(tmp_path / "c" / "model.safetensors")
    names = sorted(f"model.layers.{i}.self_attn.{n}_proj.{n}_scale" for i in range(LAYERS) for n in "kv")
    assert sorted(k for k in sd if k.endswith(("k_scale", "v_scale"))) == names
    for i in range(LAYERS):
        for n in "kv":
            t = sd[f"model.layers.{i}.self_attn.{n}_proj.{n}_scale"]
            assert t.dim() == 0
            _assert_fp8_multiplier(getattr(_attn(model, i), f"{n}_bmm_quantizer"), t)


def test_modelopt_nvfp4_kv_writes_global_scale(base, tmp_path):
    model = _kv_model(base, "modelopt_nvfp4", NVFP4_KV_CFG)
    export_checkpoint(model, tmp_path / "c", "modelopt_nvfp4")
    hf_quant = json.loads((tmp_path / "c" / "hf_quant_config.json").read_text())
    assert hf_quant["quantization"]["kv_cache_quant_algo"] == "NVFP4"
    qc = json.loads((tmp_path / "c" / "config.json").read_text())["quantization_config"]
    assert qc["kv_cache_scheme"] == "NVFP4"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        convert = pytest.importorskip("modelopt.torch.export.convert_hf_config").convert_hf_quant_config_format
    assert qc == convert(hf_quant)
    sd = load_file(tmp_path / "c" / "model.safetensors")
    for i in range(LAYERS):
        for n in "kv":
            t = sd[f"model.layers.{i}.self_attn.{n}_proj.{n}_scale"]
            amax = getattr(_attn(model, i), f"{n}_bmm_quantizer").amax.float().reshape(())
            assert t.dtype == torch.float32 and t.dim() == 0
            assert t.view(torch.int32) == (amax / torch.tensor(6.0 * 448.0)).view(torch.int32)  # ModelOpt's amax / (6 * 448)


def test_iter_packed_yields_kv_scales_last(base):
    model = _kv_model(base, "ct_nvfp4")
    packed = list(iter_packed(model, "ct_nvfp4"))
    kv = [p for p in packed if p.role == "kv"]
    assert [p.name for p in kv] == [f"model.layers.{i}.self_attn" for i in range(LAYERS)]
    assert packed[-LAYERS:] == kv and set(kv[0].tensors) == {"k_scale", "v_scale"}


def test_no_kv_quantizer_writes_no_kv_scheme(base, tmp_path):
    export_checkpoint(quantized(base, WEIGHTS["ct_nvfp4"]), tmp_path / "c", "ct_nvfp4")
    assert json.loads((tmp_path / "c" / "config.json").read_text())["quantization_config"]["kv_cache_scheme"] is None
    assert not [k for k in load_file(tmp_path / "c" / "model.safetensors") if k.endswith(("k_scale", "v_scale"))]


@pytest.mark.parametrize("fmt", ["hf_fp8_block", "hf_fp8_block_ue8m0", "hf_mxfp8"])
def test_hf_formats_refuse_kv_quantizers(base, tmp_path, fmt):
    weights = {"hf_fp8_block_ue8m0": ql.FP8_2D_BLOCKWISE_WEIGHT_ONLY_CFG,
               "hf_mxfp8": weight_only(ql.MXFP8_DEFAULT_CFG)}.get(fmt, WEIGHTS["hf_fp8_block"])
    if fmt == "hf_fp8_block_ue8m0":
        weights = {"quant_cfg": {"*weight_quantizer": {"num_bits": (4, 3), "block_sizes": {-1: 128, -2: 128}, "pow2_scale": True},
                                 "default": {"enable": False}}, "algorithm": "max"}
    model = quantized(base, merge_kv_config(weights, FP8_KV_CFG))
    with pytest.raises(ExportError, match=rf"model\.layers\.0\.self_attn\.k_bmm_quantizer = fp8 .*format {fmt} cannot carry .*no place for "
                                          r"KV-cache scales"):
        export_checkpoint(model, tmp_path / "c", fmt)
    assert not (tmp_path / "c").exists() and not list(tmp_path.iterdir())
    ql.disable_quantizer(model, "*_bmm_quantizer")
    export_checkpoint(model, tmp_path / "c", fmt)  # disabled: exported without them


def test_ct_refuses_nvfp4_kv(base, tmp_path):
    model = _kv_model(base, "ct_nvfp4", NVFP4_KV_CFG)
    with pytest.raises(ExportError, match=r"model\.layers\.0\.self_attn\.k_bmm_quantizer = nvfp4 .*block=\(16,\).*format ct_nvfp4 cannot "
                                          r"carry"):
        export_checkpoint(model, tmp_path / "c", "ct_nvfp4")
    assert not list(tmp_path.iterdir())


@pytest.mark.parametrize("fmt", ["ct_nvfp4", "modelopt_nvfp4"])
def test_uncalibrated_kv_quantizer_refused(base, tmp_path, fmt):
    model = _kv_model(base, fmt)
    _attn(model, 1).v_bmm_quantizer.reset_amax()
    with pytest.raises(ExportError, match=r"model\.layers\.1\.self_attn\.v_bmm_quantizer: KV-cache quantizer has no amax"):
        export_checkpoint(model, tmp_path / "c", fmt)
    assert not list(tmp_path.iterdir())


def test_key_without_value_quantizer_refused(base, tmp_path):
    model = _kv_model(base, "ct_nvfp4")
    ql.disable_quantizer(model, "*layers.0.self_attn.v_bmm_quantizer")
    with pytest.raises(ExportError, match=r"model\.layers\.0\.self_attn\.v_bmm_quantizer = disabled while .*k_bmm_quantizer is enabled"):
        export_checkpoint(model, tmp_path / "c", "ct_nvfp4")


def test_non_finite_kv_amax_refused(base, tmp_path):
    model = _kv_model(base, "modelopt_nvfp4")
    _attn(model, 0).k_bmm_quantizer.amax = torch.tensor(float("inf"))
    with pytest.raises(ExportError, match=r"model\.layers\.0\.self_attn\.k_bmm_quantizer: amax holds a non-finite value"):
        export_checkpoint(model, tmp_path / "c", "modelopt_nvfp4")


def test_query_quantizer_refused(base, tmp_path):
    model = _kv_model(base, "ct_nvfp4")
    q = _attn(model, 0).q_bmm_quantizer
    q.enable()
    with pytest.raises(ExportError, match=r"model\.layers\.0\.self_attn\.q_bmm_quantizer = .*no export format carries query quantization"):
        export_checkpoint(model, tmp_path / "c", "ct_nvfp4")


@pytest.mark.parametrize("fmt", ["ct_nvfp4", "modelopt_fp8"])
def test_fp8_kv_scale_is_reciprocal_not_amax_over_448(base, tmp_path, fmt):
    # amaxes where amax / 448 and 1 / (448 / amax) round to different fp32 values (docs/numerics.md, "Export")
    amaxes = torch.linspace(0.5, 3.0, 2001)
    differ = amaxes[(amaxes / 448.0) != torch.reciprocal(torch.tensor(448.0) / amaxes)]
    assert differ.numel() > 100
    model = _kv_model(base, fmt)
    for i in range(LAYERS):
        for j, n in enumerate("kv"):
            getattr(_attn(model, i), f"{n}_bmm_quantizer").amax = differ[2 * i + j].clone()
    export_checkpoint(model, tmp_path / "c", fmt)
    sd = load_file(tmp_path / "c" / "model.safetensors")
    for i in range(LAYERS):
        for n in "kv":
            key = f"model.layers.{i}.self_attn.{n}_scale" if fmt.startswith("ct") else f"model.layers.{i}.self_attn.{n}_proj.{n}_scale"
            _assert_fp8_multiplier(getattr(_attn(model, i), f"{n}_bmm_quantizer"), sd[key])
