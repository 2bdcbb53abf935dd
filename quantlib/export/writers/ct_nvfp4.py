"""compressed-tensors NVFP4 (``nvfp4-pack-quantized``).

``weight_packed`` uint8 [out, in/2] (low nibble = even element, as quantlib packs); ``weight_scale``
float8_e4m3fn [out, in/16] (quantlib's ``sb8``); ``weight_global_scale`` fp32 [1] = ``1 / s2``: CT divides by
its global scale (``w = code * (sb8 / gs)``), where quantlib multiplies by ``s2``. The quotient rounds
differently from ``sb8 * s2`` in fp32, so the consumer's weight equals quantlib's after rounding to bf16
(what CT's decompressor returns); a shape of [1], not 0-dim, keeps CT's quotient in fp32.
"""

from __future__ import annotations

from typing import Optional

import torch

from ...formats import FormatSpec, QuantizedTensor
from ...kv.scales import CTKVCache
from ..types import ExportFormat
from . import ct_common
from .base import ConfigInfo, NVFP4Packer


class CTNVFP4(CTKVCache, NVFP4Packer):
    fmt = ExportFormat.CT_NVFP4
    input_why = "W4A4 NVFP4 takes NVFP4 activations; disable the input quantizer for W4A16"

    def pack(self, q: QuantizedTensor) -> dict[str, torch.Tensor]:
        return {"weight_packed": q.codes, "weight_scale": q.scale,
                "weight_global_scale": torch.reciprocal(q.global_scale.float()).reshape(1)}

    def pack_input(self, spec: FormatSpec, amax: Optional[torch.Tensor]) -> dict[str, torch.Tensor]:
        return ct_common.input_tensors(spec, amax)

    def config(self, info: ConfigInfo) -> dict:
        weights = {"num_bits": 4, "type": "float", "symmetric": True, "strategy": "tensor_group", "group_size": 16, "dynamic": False,
                   "observer": "static_minmax", "scale_dtype": "torch.float8_e4m3fn", "zp_dtype": None}
        return ct_common.ct_config("nvfp4-pack-quantized", weights, info)
