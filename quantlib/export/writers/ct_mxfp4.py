"""compressed-tensors MXFP4 (``mxfp4-pack-quantized``): ``weight_packed`` uint8 [out, in/2] (low nibble =
even element), ``weight_scale`` uint8 E8M0 [out, in/32]; no global scale."""

from __future__ import annotations

from typing import Optional

import torch

from ...formats import FormatSpec, QuantizedTensor
from ...kv.scales import CTKVCache
from ..types import ExportFormat
from . import ct_common
from .base import ConfigInfo, Packer, is_mx


class CTMXFP4(CTKVCache, Packer):
    fmt = ExportFormat.CT_MXFP4

    def weight_ok(self, spec: FormatSpec, amax_shape: tuple[int, ...]) -> Optional[str]:
        return None if is_mx(spec, (2, 1)) else "needs MXFP4 weights (E2M1 elements, E8M0 scales per 32)"

    def input_ok(self, spec: FormatSpec) -> Optional[str]:
        return None if is_mx(spec, (2, 1)) or is_mx(spec, (4, 3)) else "activations must be MX (dynamic, per 32)"

    def pack(self, q: QuantizedTensor) -> dict[str, torch.Tensor]:
        return {"weight_packed": q.codes, "weight_scale": q.scale}

    def config(self, info: ConfigInfo) -> dict:
        weights = {"num_bits": 4, "type": "float", "symmetric": True, "strategy": "group", "group_size": 32, "dynamic": False,
                   "scale_dtype": "torch.uint8", "zp_dtype": None}
        return ct_common.ct_config("mxfp4-pack-quantized", weights, info)
