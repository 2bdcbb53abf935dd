"""ModelOpt ``FP8`` (W8A8 per tensor): ``weight`` float8_e4m3fn [out, in]; ``weight_scale`` fp32 scalar;
``input_scale`` fp32 scalar. Both scales are quantlib's own ``1 / s`` (``reciprocal(448 / a)``), which
ModelOpt writes as ``a / 448``: the two differ by an ulp for about a quarter of all amax, and only the
former makes ``fp8 * scale`` the fake-quantized weight."""

from __future__ import annotations

from typing import Optional

import torch

from ...formats import FormatSpec, Kind, QuantizedTensor
from ...formats.fp8 import fp8_scale
from ...kv.scales import ModelOptKVCache
from ..types import ExportFormat
from . import modelopt_common
from .base import ConfigInfo, Packer


def per_tensor_fp8(spec: FormatSpec) -> bool:
    """FP8 E4M3 with a static scale (per tensor where its amax has one element)."""
    return spec.kind == Kind.FP8 and spec.element == (4, 3) and not spec.dynamic


def fp8_tensor_scale(spec: FormatSpec, amax: torch.Tensor) -> torch.Tensor:
    """The fp32 scalar ``1 / s`` of an FP8 per-tensor quantizer: ``fp8 * scale`` is its fake-quantized value."""
    return torch.reciprocal(fp8_scale(amax.float().reshape(()), spec.element))


class ModelOptFP8(ModelOptKVCache, Packer):
    fmt = ExportFormat.MODELOPT_FP8
    rows_within_why = None  # vLLM's classes of those families load the key whole (test_vllm_rows_within.py)
    siblings_share_global = True
    input_required = "a calibrated FP8 E4M3 per-tensor input quantizer (e.g. FP8_DEFAULT_CFG)"

    def weight_ok(self, spec: FormatSpec, amax_shape: tuple[int, ...]) -> Optional[str]:
        if not per_tensor_fp8(spec) or any(s != 1 for s in amax_shape):
            return "needs FP8 E4M3 weights with one amax per tensor (axis=None)"
        return None

    def input_ok(self, spec: FormatSpec) -> Optional[str]:
        return None if per_tensor_fp8(spec) else "activations must be FP8 E4M3 per tensor with a static amax"

    def pack(self, q: QuantizedTensor) -> dict[str, torch.Tensor]:
        return {"weight": q.codes, "weight_scale": q.scale.float().reshape(())}

    def pack_input(self, spec: FormatSpec, amax: Optional[torch.Tensor]) -> dict[str, torch.Tensor]:
        return {"input_scale": fp8_tensor_scale(spec, amax)}

    def config(self, info: ConfigInfo) -> dict:
        return modelopt_common.config_json_form(self.extra_files(info)["hf_quant_config.json"])

    def extra_files(self, info: ConfigInfo) -> dict[str, dict]:
        return {"hf_quant_config.json": modelopt_common.hf_quant_config("FP8", info)}
