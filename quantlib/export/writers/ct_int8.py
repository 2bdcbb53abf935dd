"""compressed-tensors ``int-quantized`` (INT8 W8A8 / W8A16): ``weight`` int8 [out, in]; ``weight_scale``
fp32 [out, 1] per channel, [out, in/G] per group or [1] per tensor (``1 / s``, see :mod:`.ct_int`);
``input_scale`` fp32 [1] for a static per-tensor INT8 input quantizer."""

from __future__ import annotations

from typing import Optional

import torch

from ...formats import FormatSpec, QuantizedTensor
from ...kv.scales import CTKVCache
from ..types import ExportFormat
from . import ct_common, ct_int
from .base import ConfigInfo, Packer


class CTInt8(CTKVCache, Packer):
    fmt = ExportFormat.CT_INT8

    def weight_ok(self, spec: FormatSpec, amax_shape: tuple[int, ...]) -> Optional[str]:
        return ct_int.int_weight_ok(spec, amax_shape, (8,))

    def input_ok(self, spec: FormatSpec) -> Optional[str]:
        args = ct_common.input_args(spec)
        return None if args is not None and args["type"] == "int" else "activations must be INT8 per tensor (static) or per token (dynamic)"

    def pack(self, q: QuantizedTensor) -> dict[str, torch.Tensor]:
        return {"weight": q.codes.to(torch.int8), "weight_scale": ct_int.multiplier_scale(q)}

    def pack_input(self, spec: FormatSpec, amax: Optional[torch.Tensor]) -> dict[str, torch.Tensor]:
        return ct_common.input_tensors(spec, amax)

    def config(self, info: ConfigInfo) -> dict:
        weights = ct_int.strategy_args(info.weight_spec, info.weight_per_tensor)
        return ct_common.ct_config("int-quantized", weights, info)
