"""The inputs of E experts, each with its own input quantizer, fake-quantized as one (rows, in) tensor
whose rows are sorted by expert.

Where the experts' quantizers agree on everything but their amax (same config and switches, no affine
bias, no static blocks) and each quantizes a row alone (a calibrated static amax, or a format that takes
its scale per row or block), one kernel call quantizes every row with its expert's amax gathered per row
((rows, 1) per tensor, (rows, in) per channel; NVFP4: its global amax per row, which the kernels take).
A scale is a function of its group's amax alone, so this is bit for bit each expert's call on its rows.
Nothing is read back to the host: the expert of each row is a device tensor.

While max calibration collects, each expert's statistics come from its own rows in one pass too: the
row-wise max and min reduced per expert on the device (max and min are exact in any order, so these are
the bits of each expert's own amax); an expert without rows adds -inf, which its collector treats as
nothing collected (:class:`~quantlib.nn.max_collector.MaxCalibrator`), as the per-expert loop skips it.
"""

from __future__ import annotations

from typing import Optional

import torch

from ..nn.max_collector import MaxCalibrator
from ..nn.quant_module import _quantizer_token
from ..nn.tensor_quantizer import TensorQuantizer, _raise_named


def rows_refusal(members: list, width: int) -> str:
    """Why :func:`quantize_rows` cannot quantize inputs of ``width`` channels with ``members`` in one call
    ('' where it can)."""
    first = members[0]
    for m in members:
        if type(m) is not TensorQuantizer:
            return f"{m._qname}: not a single TensorQuantizer"
        if m._disabled != first._disabled or m._if_calib != first._if_calib or m._if_quant != first._if_quant:
            return f"{m._qname}: switches differ from {first._qname}'s"
        if (m.pre_quant_scale is None) != (first.pre_quant_scale is None):
            return f"{m._qname}: pre_quant_scale on some experts only"
        if m.pre_quant_scale is not None and m.pre_quant_scale.dim() != 1:
            return f"{m._qname}: pre_quant_scale {tuple(m.pre_quant_scale.shape)} is not one factor per channel"
        if not (m._disabled or m._attrs is first._attrs or m._attrs == first._attrs):
            return f"{m._qname}: config differs from {first._qname}'s"
    if first._disabled:
        return ""
    if first._if_calib:
        for m in members:
            if type(m._calibrator) is not MaxCalibrator or m._bias_calibrator is not None or m.static_blocks:
                return f"{m._qname}: its calibration statistics are not a max of |x| per tensor or channel"
            if m.needs_calibration and _row_amax_shape(m, width) is None:
                return f"{m._qname}: its amax for (rows, {width}) inputs depends on the rows"
    if not first._if_quant:
        return ""
    if first._attrs.bias is not None or first.static_blocks:
        return f"{first._qname}: an affine bias or static blocks depend on which rows are quantized together"
    if not first.spec.calibrated_amax:
        return ""  # the op takes its scale per row or block
    for m in members:
        if not m.needs_calibration or m.amax is None:
            return f"{m._qname}: no calibrated amax (its scale would come from the rows it sees together)"
        shape = _row_amax_shape(m, width)
        if shape is None or m.amax.numel() != shape[0] * shape[1]:
            return f"{m._qname}: amax {tuple(m.amax.shape)} is not one value or one per channel of {width}"
    return ""


def _row_amax_shape(q: TensorQuantizer, width: int) -> Optional[tuple[int, int]]:
    """(1, 1) or (1, width): ``q``'s amax for (rows, width) inputs, when it does not depend on the rows."""
    shape = tuple(q.amax_shape((2, width)))
    shape = (1,) * (2 - len(shape)) + shape
    return shape if len(shape) == 2 and shape[0] == 1 else None


def quantize_rows(members: list, x: torch.Tensor, expert: torch.Tensor, counts: torch.Tensor, cache: Optional[dict] = None) -> torch.Tensor:
    """Row r of ``x`` (rows, in) fake-quantized by ``members[expert[r]]`` in one call, each member collecting
    from its own rows while calibrating (after :func:`rows_refusal` said it can); ``counts``: rows per member;
    ``cache``: where the members' stacked scales are kept while their states do not change."""
    first = members[0]
    pqs, amax = _stacked(members, x.shape[-1], cache)
    if pqs is not None:  # each row times its expert's scale, as TensorQuantizer.pre_scale
        x = x * pqs[expert].to(x.dtype)
    if first._disabled or x.numel() == 0:
        return x
    if first._if_calib and first.needs_calibration:
        _collect_rows(members, x, expert, counts)
    if not first._if_quant:
        return x
    try:
        return first._fake_quant(x, None if amax is None else amax[expert].reshape(x.shape[0], -1), None)
    except Exception as exc:
        _raise_named(exc, first._qname)


def _stacked(members: list, width: int, cache: Optional[dict]) -> tuple[Optional[torch.Tensor], Optional[torch.Tensor]]:
    """(members' pre_quant_scale (E, in), their static amax (E, 1, 1 or in)), None where they have none."""
    token = None if cache is None or torch.compiler.is_compiling() else _quantizer_token(members)
    if token is not None:
        hit = cache.get("rows")
        if hit is not None and hit[0] == token and hit[1] == width:
            return hit[2]
    first = members[0]
    pqs = None if first.pre_quant_scale is None else torch.stack([m.pre_quant_scale for m in members])
    amax = None
    if not first._disabled and first._if_quant and first.spec.calibrated_amax:
        shape = _row_amax_shape(first, width)
        amax = torch.stack([m.amax.reshape(shape) for m in members])
    if token is not None:
        cache["rows"] = (token, width, (pqs, amax))
    return pqs, amax


def _collect_rows(members: list, x: torch.Tensor, expert: torch.Tensor, counts: torch.Tensor) -> None:
    """Each member's max calibration from its own rows (static_amax's max(max x, -min x) per expert)."""
    shape = tuple(members[0].amax_shape((2, x.shape[-1])))
    x = x.detach()
    if len(shape) == 2 and shape[1] > 1:  # per channel: reduce the rows of each expert
        index = expert.unsqueeze(-1).expand_as(x)
        hi_rows, lo_rows, size = x, x, (len(members), x.shape[-1])
    else:
        index, hi_rows, lo_rows, size = expert, x.amax(dim=-1), x.amin(dim=-1), (len(members),)
    hi = torch.full(size, float("-inf"), dtype=x.dtype, device=x.device).scatter_reduce(0, index, hi_rows, "amax")
    lo = torch.full(size, float("inf"), dtype=x.dtype, device=x.device).scatter_reduce(0, index, lo_rows, "amin")
    amax = torch.maximum(hi, lo.neg()).abs().float()
    present = (counts.to(amax.device) > 0).reshape((-1,) + (1,) * (amax.dim() - 1))
    amax = torch.where(present, amax, float("-inf"))  # no rows: nothing collected (see MaxCalibrator)
    for e, m in enumerate(members):
        m._calibrator.collect(amax[e].reshape(shape), maybe_empty=True)


__all__ = ["quantize_rows", "rows_refusal"]
