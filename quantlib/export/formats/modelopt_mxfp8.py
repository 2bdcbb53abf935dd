"""ModelOpt ``MXFP8``: ``weight`` float8_e4m3fn [out, in]; ``weight_scale`` uint8 E8M0 [out, in/32]."""

from __future__ import annotations

from typing import Optional

import torch

from ...formats import FormatSpec, QuantizedTensor
from ..types import ExportFormat
from . import modelopt_common
from .base import ConfigInfo, Packer, is_mx


class ModelOptMXFP8(Packer):
    fmt = ExportFormat.MODELOPT_MXFP8

    def weight_ok(self, spec: FormatSpec, amax_shape: tuple[int, ...]) -> Optional[str]:
        return None if is_mx(spec, (4, 3)) else "needs MXFP8 weights (E4M3 elements, E8M0 scales per 32)"

    def input_ok(self, spec: FormatSpec) -> Optional[str]:
        return None if is_mx(spec, (4, 3)) else "activations must be MXFP8 (dynamic, per 32)"

    def pack(self, q: QuantizedTensor) -> dict[str, torch.Tensor]:
        return {"weight": q.codes, "weight_scale": q.scale}

    def config(self, info: ConfigInfo) -> dict:
        return modelopt_common.config_json_form(self.extra_files(info)["hf_quant_config.json"])

    def extra_files(self, info: ConfigInfo) -> dict[str, dict]:
        return {"hf_quant_config.json": modelopt_common.hf_quant_config("MXFP8", info, group_size=32)}
