"""Hugging Face ``quant_method: "mxfp8"`` (transformers maps it onto the fine-grained FP8 quantizer).

``weight`` float8_e4m3fn [out, in]; ``weight_scale_inv`` uint8 E8M0 bytes [out, in/32] (``2^(b-127)``);
``weight_block_size: [1, 32]``.
"""

from __future__ import annotations

from ..types import ExportFormat
from .base import ConfigInfo, MXFP8Packer


class HFMXFP8(MXFP8Packer):
    fmt = ExportFormat.HF_MXFP8
    scale_key = "weight_scale_inv"
    input_why = "activations are MXFP8, quantized dynamically by the consumer"

    def config(self, info: ConfigInfo) -> dict:
        return {"quant_method": "mxfp8", "activation_scheme": "dynamic", "weight_block_size": [1, 32], "ignored_layers": list(info.ignore)}
