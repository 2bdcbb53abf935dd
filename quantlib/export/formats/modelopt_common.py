"""ModelOpt's unified HF checkpoint: ``hf_quant_config.json`` and the same embedded in config.json as
``quantization_config`` (the form ModelOpt's ``convert_hf_quant_config_format`` writes), shared by the
``modelopt_*`` format modules. vLLM reads either; it requires ``kv_cache_quant_algo`` and
``exclude_modules`` (and ``group_size`` for NVFP4)."""

from __future__ import annotations

from typing import Optional

from .base import ConfigInfo
from .kv_cache import modelopt_kv_algo

_FP8_GROUP = {"input_activations": {"dynamic": False, "num_bits": 8, "type": "float"}, "weights": {"dynamic": False, "num_bits": 8, "type": "float"}, "targets": ["Linear"]}


def _fp4_args(group_size: int) -> dict:
    return {"dynamic": False, "num_bits": 4, "type": "float", "group_size": group_size}


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
    if algo == "FP8":
        out["config_groups"] = {"group_0": dict(_FP8_GROUP)}
    elif algo == "NVFP4":
        g = quant.get("group_size", 16)
        out["config_groups"] = {"group_0": {"input_activations": _fp4_args(g), "weights": _fp4_args(g), "targets": ["Linear"]}}
    elif algo == "W4A16_NVFP4":
        g = quant.get("group_size", 16)
        out["config_groups"] = {"group_0": {"weights": _fp4_args(g), "targets": ["Linear"]}}
    out["ignore"] = list(quant["exclude_modules"])
    out["quant_algo"] = algo
    kv = quant["kv_cache_quant_algo"]
    if kv is not None:  # ModelOpt's config.json form: FP8 as QuantizationArgs-like fields, other algorithms by name
        out["kv_cache_scheme"] = {"dynamic": False, "num_bits": 8, "type": "float"} if kv == "FP8" else kv
    out["producer"] = hf_quant["producer"]
    out["quant_method"] = "modelopt"
    return out
