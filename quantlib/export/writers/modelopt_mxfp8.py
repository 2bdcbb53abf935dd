"""ModelOpt ``MXFP8``: ``weight`` float8_e4m3fn [out, in]; ``weight_scale`` uint8 E8M0 [out, in/32]."""

from __future__ import annotations

from ...kv.scales import ModelOptKVCache
from ..types import ExportFormat
from . import modelopt_common
from .base import ConfigInfo, MXFP8Packer


class ModelOptMXFP8(ModelOptKVCache, MXFP8Packer):
    fmt = ExportFormat.MODELOPT_MXFP8
    rows_within_why = None  # vLLM's classes of those families load the key whole (test_vllm_rows_within.py)

    def config(self, info: ConfigInfo) -> dict:
        return modelopt_common.config_json_form(self.extra_files(info)["hf_quant_config.json"])

    def extra_files(self, info: ConfigInfo) -> dict[str, dict]:
        return {"hf_quant_config.json": modelopt_common.hf_quant_config("MXFP8", info, group_size=32)}
