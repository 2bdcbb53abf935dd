"""compressed-tensors ``pack-quantized`` (INT4 W4A16 and other widths up to 8 bits).

``weight_packed`` int32 [out, ceil(in * bits / 32)]: codes offset by ``2^(bits-1)``, element i at bit
``i * bits`` of the row's bit stream (dense, elements may straddle words); ``weight_scale`` fp32
[out, in/G] (``1 / s``, see :mod:`.ct_int`); ``weight_shape`` int64 [2].
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from ...formats import FormatSpec, QuantizedTensor
from ...kv.scales import CTKVCache
from ..types import ExportFormat
from . import ct_common, ct_int
from .base import ConfigInfo, Packer


def pack_int32(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Dense little-endian packing of signed ``codes`` [rows, n] into int32 words, offset ``2^(bits-1)``."""
    rows, n = codes.shape
    v = codes.to(torch.int64) + (1 << (bits - 1))
    pad = -n % 32  # 32 elements always fill exactly ``bits`` words
    v = F.pad(v, (0, pad))
    if 32 % bits == 0:  # no element straddles a word: each word is its elements shifted into place (not a bit stream of 8x n*bits bytes)
        v = v.reshape(rows, -1, 32 // bits)
        words = v[..., 0].clone()
        for k in range(1, 32 // bits):
            words |= v[..., k] << (k * bits)
        words = torch.where(words >= 2**31, words - 2**32, words)
        return words[:, : -(-n * bits // 32)].to(torch.int32).contiguous()
    shifts = torch.arange(bits, device=codes.device, dtype=torch.int64)
    stream = ((v.unsqueeze(-1) >> shifts) & 1).reshape(rows, -1, 32)  # bit i of the row, 32 per word
    words = (stream << torch.arange(32, device=codes.device, dtype=torch.int64)).sum(-1)
    words = torch.where(words >= 2**31, words - 2**32, words)  # same bits as an int32
    return words[:, : -(-n * bits // 32)].to(torch.int32).contiguous()


class CTIntPack(CTKVCache, Packer):
    fmt = ExportFormat.CT_INT_PACK

    def weight_ok(self, spec: FormatSpec, amax_shape: tuple[int, ...]) -> Optional[str]:
        return ct_int.int_weight_ok(spec, amax_shape, (2, 3, 4, 5, 6, 7, 8))

    def input_ok(self, spec: FormatSpec) -> Optional[str]:
        return "pack-quantized is weight-only (W4A16); disable the input quantizer"

    def pack(self, q: QuantizedTensor) -> dict[str, torch.Tensor]:
        codes = q.codes.reshape(q.shape[0], -1)
        return {"weight_packed": pack_int32(codes, q.spec.num_bits), "weight_scale": ct_int.multiplier_scale(q),
                "weight_shape": torch.tensor(q.shape, dtype=torch.int64)}

    def config(self, info: ConfigInfo) -> dict:
        return ct_common.ct_config("pack-quantized", ct_int.strategy_args(info.weight_spec, info.weight_per_tensor), info)
