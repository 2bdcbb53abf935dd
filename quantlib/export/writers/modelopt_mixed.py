"""ModelOpt ``MIXED_PRECISION``: ``hf_quant_config.json`` names every quantized layer's algorithm in
``quantized_layers`` ({module: {"quant_algo", "group_size", ...}}); each module's tensors as the
single-algorithm ``modelopt_*`` formats write them. One scheme in all gives that scheme's plain config."""

from __future__ import annotations

from ...formats.spec import is_nvfp4
from ...kv.scales import ModelOptKVCache
from ..types import ExportError, ExportFormat
from . import modelopt_common
from .base import ConfigInfo
from .mixed import MixedPacker
from .modelopt_fp8 import ModelOptFP8
from .modelopt_fp8_pb import ModelOptFP8PB
from .modelopt_int4_awq import ModelOptInt4AWQ
from .modelopt_mxfp8 import ModelOptMXFP8
from .modelopt_nvfp4 import ModelOptNVFP4

_LAYER_KEYS = ("quant_algo", "group_size", "has_zero_point", "pre_quant_scale")


class ModelOptMixed(ModelOptKVCache, MixedPacker):
    fmt = ExportFormat.MODELOPT_MIXED
    members = (ModelOptFP8(), ModelOptFP8PB(), ModelOptNVFP4(), ModelOptMXFP8(), ModelOptInt4AWQ())

    def config(self, info: ConfigInfo) -> dict:
        return modelopt_common.config_json_form(self.extra_files(info)["hf_quant_config.json"])

    def extra_files(self, info: ConfigInfo) -> dict[str, dict]:
        parts = self.parts(info)
        singles = [member.extra_files(sub)["hf_quant_config.json"] for member, _, sub in parts]
        if len({str(s["quantization"]) for s in singles}) == 1:
            return {"hf_quant_config.json": singles[0]}
        layers = {}
        for (_, scheme, _), single in zip(parts, singles):
            layer = {k: single["quantization"][k] for k in _LAYER_KEYS if k in single["quantization"]}
            layers.update({name: layer for name in scheme.modules})
        if info.kv_spec is not None and is_nvfp4(info.kv_spec):
            # vLLM 0.32 reads a MIXED_PRECISION config from config.json, where ModelOpt's form names an NVFP4 KV cache by a
            # string its parser drops: it builds the attention without KV scales and runs the NVFP4 cache at scales of 1
            raise ExportError("format modelopt_mixed: the KV cache is NVFP4 (NVFP4_KV_CFG), which vLLM 0.32 reads from a "
                              "MIXED_PRECISION config as no KV quantization and runs with scales of 1.0: use FP8_KV_CFG, or one "
                              "scheme for every layer (then the plain modelopt_* config, which vLLM reads)")
        out = modelopt_common.hf_quant_config("MIXED_PRECISION", info)
        out["quantization"] = {"quant_algo": "MIXED_PRECISION", "kv_cache_quant_algo": out["quantization"]["kv_cache_quant_algo"],
                               "quantized_layers": layers, "exclude_modules": list(info.ignore)}  # fmt: skip
        return {"hf_quant_config.json": out}
