"""What the two compressed-tensors INT formats share: the weight args and the multiplier scales.

CT dequantizes ``q * weight_scale``; quantlib's fake quant divides, ``q / s`` with ``s = Q / a``. The
exported scale is ``fp32(1 / s)``, so the consumer's weight is exactly ``codes * weight_scale`` and at most
one ulp from quantlib's (docs/numerics.md, "Export").
"""

from __future__ import annotations

from typing import Optional

import torch

from ...formats import FormatSpec, Kind, QuantizedTensor


def int_weight_ok(spec: FormatSpec, amax_shape: tuple[int, ...], bits: tuple[int, ...]) -> Optional[str]:
    """Why compressed-tensors cannot carry this INT weight quantizer of ``bits`` bits, or None where it can."""
    if spec.kind != Kind.INT or spec.num_bits not in bits:
        return f"needs INT weights of {' or '.join(map(str, bits))} bits"
    if spec.unsigned:
        return "compressed-tensors' symmetric INT takes signed codes (unsigned=False)"
    if spec.block is not None and len(spec.block) != 1:
        return "INT blocks must run along the input dim (block_sizes {-1: G})"
    if spec.block is None and len(amax_shape) == 2 and amax_shape[1] != 1:
        return f"per-channel amax of shape {amax_shape}: compressed-tensors takes one scale per output row (axis=0)"
    return None


def strategy_args(spec: FormatSpec, per_tensor: bool) -> dict:
    """``weights`` args: strategy group (blocks along the input dim), tensor or channel."""
    args = {"num_bits": spec.num_bits, "type": "int", "symmetric": True, "dynamic": False}
    if spec.block is not None:
        return {**args, "strategy": "group", "group_size": spec.block[0]}
    return {**args, "strategy": "tensor" if per_tensor else "channel"}


def multiplier_scale(q: QuantizedTensor) -> torch.Tensor:
    """fp32 ``1 / s`` in CT's shapes: [out, groups] for groups and channels, [1] per tensor."""
    inv = torch.reciprocal(q.scale.float())
    if q.spec.block is not None:
        return inv
    if inv.numel() == 1:
        return inv.reshape(1)
    return inv.reshape(q.shape[0], 1)
