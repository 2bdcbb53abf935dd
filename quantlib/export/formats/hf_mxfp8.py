"""Hugging Face ``quant_method: "mxfp8"`` (transformers maps it onto the fine-grained FP8 quantizer).

``weight`` float8_e4m3fn [out, in]; ``weight_scale_inv`` uint8 E8M0 bytes [out, in/32] (``2^(b-127)``);
``weight_block_size: [1, 32]``.
"""

from __future__ import annotations

from typing import Optional

import torch

from ...formats import FormatSpec, QuantizedTensor
from ..types import ExportFormat
from .base import ConfigInfo, Packer, is_mx


class HFMXFP8(Packer):
    fmt = ExportFormat.HF_MXFP8

    def weight_ok(self, spec: FormatSpec, amax_shape: tuple[int, ...]) -> Optional[str]:
        return None if is_mx(spec, (4, 3)) else "needs MXFP8 weights (E4M3 elements, E8M0 scales per 32)"

    def input_ok(self, spec: FormatSpec) -> Optional[str]:
        return None if is_mx(spec, (4, 3)) else "activations are MXFP8, quantized dynamically by the consumer"

    def pack(self, q: QuantizedTensor) -> dict[str, torch.Tensor]:
        return {"weight": q.codes, "weight_scale_inv": q.scale}

    def config(self, info: ConfigInfo) -> dict:
        return {"quant_method": "mxfp8", "activation_scheme": "dynamic", "weight_block_size": [1, 32], "ignored_layers": list(info.ignore)}
