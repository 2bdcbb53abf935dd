"""ModelOpt's unified HF checkpoint: ``hf_quant_config.json`` and the same embedded in config.json as
``quantization_config`` (the form ModelOpt's ``convert_hf_quant_config_format`` writes), shared by the
``modelopt_*`` format modules. vLLM reads either; it requires ``kv_cache_quant_algo`` and
``exclude_modules`` (and ``group_size`` for NVFP4)."""

from __future__ import annotations

from typing import Optional

from ...kv.scales import modelopt_kv_algo, modelopt_kv_scheme
from .base import ConfigInfo

_FP8 = {"dynamic": False, "num_bits": 8, "type": "float"}


def _fp4_args(group_size: int) -> dict:
    return {"dynamic": False, "num_bits": 4, "type": "float", "group_size": group_size}


def group_args(algo: str, group_size: Optional[int]) -> dict:
    """The compressed-tensors-like group ModelOpt's config.json form gives a layer of ``algo``; an algorithm
    it has no form for (FP8_PB_WO) is named alone, as ModelOpt does."""
    if algo == "FP8":
        return {"input_activations": dict(_FP8), "weights": dict(_FP8)}
    if algo in ("NVFP4", "W4A16_NVFP4"):
        args = _fp4_args(group_size or 16)
        return {"weights": args} if algo == "W4A16_NVFP4" else {"input_activations": dict(args), "weights": args}
    if algo == "MXFP8":
        g = group_size or 32
        return {"input_activations": {**_FP8, "group_size": g}, "weights": {**_FP8, "group_size": g}}
    if algo == "W4A16_AWQ":
        return {"weights": {"dynamic": False, "num_bits": 4, "type": "int", "group_size": group_size or 128}}
    return {"quant_algo": algo}


def hf_quant_config(quant_algo: str, info: ConfigInfo, group_size: Optional[int] = None) -> dict:
    """The ``hf_quant_config.json`` dict."""
    quant = {"quant_algo": quant_algo, "kv_cache_quant_algo": modelopt_kv_algo(info.kv_spec)}
    if group_size is not None:
        quant["group_size"] = group_size
    if info.pre_quant_scale:  # ModelOpt's AWQ algorithms (process_layer_quant_config)
        quant["has_zero_point"], quant["pre_quant_scale"] = False, True
    quant["exclude_modules"] = list(info.ignore)
    return {"producer": {"name": "quantlib", "version": info.producer_version}, "quantization": quant}


def config_json_form(hf_quant: dict) -> dict:
    """``quantization_config`` of config.json for an ``hf_quant_config.json`` dict."""
    quant = hf_quant["quantization"]
    algo = quant["quant_algo"]
    out: dict = {}
    if algo in ("FP8", "NVFP4", "W4A16_NVFP4"):  # the single algorithms ModelOpt gives a config group
        out["config_groups"] = {"group_0": {**group_args(algo, quant.get("group_size")), "targets": ["Linear"]}}
    elif algo == "MIXED_PRECISION":  # one group per distinct layer config, and the layers themselves
        by_cfg: dict[tuple, list[str]] = {}
        for name, layer in quant["quantized_layers"].items():
            by_cfg.setdefault(tuple(sorted(layer.items())), []).append(name)
        groups = {f"group_{i}": {**group_args(dict(k)["quant_algo"], dict(k).get("group_size")), "targets": sorted(names)}
                  for i, (k, names) in enumerate(by_cfg.items())}
        out["config_groups"], out["quantized_layers"] = groups, quant["quantized_layers"]
    out["ignore"] = list(quant["exclude_modules"])
    out["quant_algo"] = algo
    kv = modelopt_kv_scheme(quant["kv_cache_quant_algo"])
    if kv is not None:
        out["kv_cache_scheme"] = kv
    out["producer"] = hf_quant["producer"]
    out["quant_method"] = "modelopt"
    return out
