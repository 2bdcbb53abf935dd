"""compressed-tensors MXFP8 (``mxfp8-quantized``): ``weight`` float8_e4m3fn [out, in], ``weight_scale``
uint8 E8M0 [out, in/32]."""

from __future__ import annotations

from ...kv.scales import CTKVCache
from ..types import ExportFormat
from . import ct_common
from .base import ConfigInfo, MXFP8Packer


class CTMXFP8(CTKVCache, MXFP8Packer):
    fmt = ExportFormat.CT_MXFP8

    def config(self, info: ConfigInfo) -> dict:
        weights = {"num_bits": 8, "type": "float", "symmetric": True, "strategy": "group", "group_size": 32, "dynamic": False,
                   "scale_dtype": "torch.uint8", "zp_dtype": None}
        return ct_common.ct_config("mxfp8-quantized", weights, info)
