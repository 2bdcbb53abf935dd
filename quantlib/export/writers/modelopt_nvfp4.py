"""ModelOpt ``NVFP4`` (W4A4) / ``W4A16_NVFP4``: ``weight`` uint8 [out, in/2] (low nibble = even element);
``weight_scale`` float8_e4m3fn [out, in/16]; ``weight_scale_2`` fp32 scalar = quantlib's ``s2`` (a
multiplier: ``w = code * (sb8 * s2)``, quantlib's own product); ``input_scale`` fp32 scalar =
``A_in / 2688`` for W4A4. ``NVFP4_AWQ``: the same, plus ``pre_quant_scale`` [in] (the input's factor,
in the dtype quantlib multiplies by) on each linear whose SmoothQuant / AWQ scale folds into no op
before it (:mod:`quantlib.export.fold`); ModelOpt's has it only with NVFP4 activations."""

from __future__ import annotations

from typing import Optional

import torch

from ...formats import FormatSpec, QuantizedTensor
from ...formats.nvfp4 import nvfp4_global_scale
from ...kv.scales import ModelOptKVCache
from ..types import ExportFormat
from . import modelopt_common
from .base import ConfigInfo, NVFP4Packer


class ModelOptNVFP4(ModelOptKVCache, NVFP4Packer):
    fmt = ExportFormat.MODELOPT_NVFP4
    rows_within_why = None  # vLLM's classes of those families load the key whole (test_vllm_rows_within.py)
    input_why = "W4A4 takes NVFP4 activations; disable the input quantizer for W4A16_NVFP4"
    carries_pre_quant_scale = True

    def pre_quant_scale_ok(self, info: ConfigInfo) -> Optional[str]:
        return "NVFP4_AWQ quantizes activations to NVFP4; W4A16_NVFP4 has no pre_quant_scale" if info.input_spec is None else None

    def pack(self, q: QuantizedTensor) -> dict[str, torch.Tensor]:
        return {"weight": q.codes, "weight_scale": q.scale, "weight_scale_2": q.global_scale.float().reshape(())}

    def pack_input(self, spec: FormatSpec, amax: Optional[torch.Tensor]) -> dict[str, torch.Tensor]:
        return {} if amax is None else {"input_scale": nvfp4_global_scale(amax)}

    def config(self, info: ConfigInfo) -> dict:
        return modelopt_common.config_json_form(self.extra_files(info)["hf_quant_config.json"])

    def extra_files(self, info: ConfigInfo) -> dict[str, dict]:
        algo = "W4A16_NVFP4" if info.input_spec is None else "NVFP4_AWQ" if info.pre_quant_scale else "NVFP4"
        return {"hf_quant_config.json": modelopt_common.hf_quant_config(algo, info, group_size=16)}
