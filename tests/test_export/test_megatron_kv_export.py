"""KV-cache scales in the Megatron export: a GPT (local spec, 2 layers) with FP8_KV_CFG merged into a
weight-only NVFP4 preset, on 2 gloo ranks, exported at TP2 and at TP1 (with TP2's calibrated KV amax)
in compressed-tensors and ModelOpt. The KV tensors are the same bytes at both layouts, under the
transformers export's names, each quantlib's ``1 / s`` of the quantizer's amax; compressed-tensors'
own parser takes the config; a format without a place for KV scales is refused on every rank."""

from __future__ import annotations

import json
import os

import pytest
import torch

pytest.importorskip("psutil")
pytest.importorskip("megatron.core")
import quantlib as ql  # noqa: E402
from quantlib.export import ExportError  # noqa: E402
from quantlib.kv.presets import FP8_KV_CFG, merge_kv_config  # noqa: E402
from tests.test_plugins import megatron_shims as shims  # noqa: E402

pytestmark = [pytest.mark.megatron, pytest.mark.distributed]

LAYERS = 2
WEIGHTS = {"quant_cfg": {"*weight_quantizer": ql.NVFP4_DEFAULT_CFG["quant_cfg"]["*weight_quantizer"], "*router*": {"enable": False},
                         "default": {"enable": False}}, "algorithm": "max"}
FORMATS = ("ct_nvfp4", "modelopt_nvfp4")


def _kv_quantizers(model) -> dict[tuple[int, str], object]:
    return {(i, n): getattr(layer.self_attention.core_attention, f"{n}_bmm_quantizer") for i, layer in enumerate(model.decoder.layers)
            for n in "kv"}


def _quantized(tp: int):
    shims.set_layout(tp, 1)
    model = shims.build_gpt(tp, 1, 0)
    ql.quantize(model, merge_kv_config(WEIGHTS, FP8_KV_CFG), shims.forward_loop(shims.token_batches(2, 1)),
                parallel_state=ql.ParallelState.from_megatron())
    return model


def _read(path: str) -> dict:
    from safetensors.torch import load_file

    sd = load_file(os.path.join(path, "model.safetensors"))
    out = {"kv": {k: v for k, v in sd.items() if k.endswith(("k_scale", "v_scale"))},
           "config": json.load(open(os.path.join(path, "config.json")))["quantization_config"]}
    if os.path.exists(os.path.join(path, "hf_quant_config.json")):
        out["hf_quant"] = json.load(open(os.path.join(path, "hf_quant_config.json")))["quantization"]
    return out


def _export(rank: int, world: int, tmp: str) -> dict:
    from quantlib.export.megatron_export import export_megatron_checkpoint

    out: dict = {}
    model = _quantized(2)
    amax = {key: q.amax.detach().clone() for key, q in _kv_quantizers(model).items()}
    out["amax"] = amax
    for fmt in FORMATS:
        export_megatron_checkpoint(model, f"{tmp}/tp2-{fmt}", fmt, hf_config={})
    try:
        export_megatron_checkpoint(model, f"{tmp}/refused", "hf_fp8_block", hf_config={})
    except ExportError as exc:
        out["refused"] = str(exc)
    model = _quantized(1)
    for key, q in _kv_quantizers(model).items():
        q.amax = amax[key].clone()  # the same calibrated model: TP changes an activation amax's last bits
    for fmt in FORMATS:
        export_megatron_checkpoint(model, f"{tmp}/tp1-{fmt}", fmt, hf_config={})
    if rank == 0:
        out.update({(tp, fmt): _read(f"{tmp}/{tp}-{fmt}") for tp in ("tp1", "tp2") for fmt in FORMATS})
    return out


def _one_over_s(amax: torch.Tensor) -> torch.Tensor:
    return torch.reciprocal(torch.tensor(448.0) / amax.float().reshape(()))


def test_megatron_fp8_kv_scales_tp2_equal_tp1_and_quantlib_scale(tmp_path):
    from compressed_tensors.quantization import QuantizationConfig, QuantizationStrategy

    results = shims.run_distributed(_export, 2, str(tmp_path), timeout=300)
    r0 = results[0]
    for key, a in r0["amax"].items():  # MAX-reduced over TP by calibration: both ranks hold it
        assert a.numel() == 1 and torch.equal(a, results[1]["amax"][key]), key
    for r in results:  # refused on every rank, before the gather: nothing written
        assert "core_attention.k_bmm_quantizer = fp8" in r["refused"] and "format hf_fp8_block cannot carry" in r["refused"], r["refused"]
    assert not (tmp_path / "refused").exists()
    names = {"ct_nvfp4": "model.layers.{i}.self_attn.{n}_scale", "modelopt_nvfp4": "model.layers.{i}.self_attn.{n}_proj.{n}_scale"}
    for fmt in FORMATS:
        tp1, tp2 = r0[("tp1", fmt)], r0[("tp2", fmt)]
        assert sorted(tp2["kv"]) == sorted(names[fmt].format(i=i, n=n) for i in range(LAYERS) for n in "kv")
        assert tp1["config"] == tp2["config"]
        for i in range(LAYERS):
            for n in "kv":
                t1, t2 = tp1["kv"][names[fmt].format(i=i, n=n)], tp2["kv"][names[fmt].format(i=i, n=n)]
                assert t2.dtype == torch.float32 and t2.shape == ((1,) if fmt == "ct_nvfp4" else ())
                assert t1.shape == t2.shape and torch.equal(t1.view(torch.int32), t2.view(torch.int32)), (fmt, i, n)
                assert t2.reshape(()).view(torch.int32) == _one_over_s(r0["amax"][(i, n)]).view(torch.int32), (fmt, i, n)
    kv = QuantizationConfig.model_validate(r0[("tp2", "ct_nvfp4")]["config"]).kv_cache_scheme
    assert kv is not None and kv.num_bits == 8 and kv.strategy == QuantizationStrategy.TENSOR and kv.dynamic is False
    assert r0[("tp2", "modelopt_nvfp4")]["hf_quant"]["kv_cache_quant_algo"] == "FP8"
    assert r0[("tp2", "modelopt_nvfp4")]["config"]["kv_cache_scheme"]["num_bits"] == 8
