"""compressed-tensors FP8 block (``float-quantized``, strategy ``block``).

``weight`` float8_e4m3fn [out, in]; ``weight_scale`` fp32 [ceil(out/bm), ceil(in/bn)] = quantlib's ``d``
(a multiplier; fp32 keeps the consumer's product exact).
"""

from __future__ import annotations

from typing import Optional

import torch

from ...formats import FormatSpec, QuantizedTensor
from ...kv.scales import CTKVCache
from ..types import ExportFormat
from . import ct_common
from .base import ConfigInfo, Packer, fp8_block_weight_ok


class CTFP8Block(CTKVCache, Packer):
    fmt = ExportFormat.CT_FP8_BLOCK
    packs_stacks = True

    def weight_ok(self, spec: FormatSpec, amax_shape: tuple[int, ...]) -> Optional[str]:
        return fp8_block_weight_ok(spec)

    def input_ok(self, spec: FormatSpec) -> Optional[str]:
        return None if ct_common.input_args(spec) is not None else "compressed-tensors has no such activation scheme"

    def pack(self, q: QuantizedTensor) -> dict[str, torch.Tensor]:
        return {"weight": q.codes, "weight_scale": q.scale.float()}

    def pack_input(self, spec: FormatSpec, amax: Optional[torch.Tensor]) -> dict[str, torch.Tensor]:
        return ct_common.input_tensors(spec, amax)

    def config(self, info: ConfigInfo) -> dict:
        weights = ct_common.fp8_args("block", False, block_structure=list(info.weight_spec.block))
        return ct_common.ct_config("float-quantized", weights, info)
