"""What the per-input-channel searches (SmoothQuant, AWQ) need to know of a linear split over
tensor-parallel ranks, so that every shard makes the choice one process makes on the whole linear.

A column-parallel shard holds a slice of the weight's rows (output channels) and the whole input; a
row-parallel one a slice of the columns (input channels) and the matching slice of the input, its
output a partial sum that the ranks add up. Hence, per quantity of a search:

- per input channel, over the rows (SmoothQuant's max |W|, AWQ's mean normalised |W|): reduced over
  the shards of a column-parallel linear, local to a row-parallel one;
- per group of a row (the amax a weight quantizer takes, AWQ's normalising group max): local where the
  group lies in one shard, MAX-reduced over the shards where it spans them (a row-parallel row, or one
  block covering every shard; the rule of :func:`~quantlib.parallel_state.tp_shard_dim`, which the amax
  sync follows); a block straddling the shards has no single-process equivalent and is refused;
- an output error: a column-parallel shard's is a slice of the output (its squares are summed over the
  shards); a row-parallel shard's is a partial sum, added over the shards before it is squared.
"""

from __future__ import annotations

from typing import Any, Optional

import torch

from ..collectives import StatSync
from ..nn.max_collector import static_amax
from ..nn.tensor_quantizer import CalibrationError, TensorQuantizer
from ..parallel_state import LayoutError, tp_shard_dim


def groups_span_shards(block: Optional[int], target: Any, sync: StatSync, where: str) -> bool:
    """Whether a row's groups of ``block`` input channels (None: the whole row) span the shards of
    ``target``: only for a row-parallel one, whose row is split. A block that divides the local columns
    lies in one shard; one that covers every shard spans them; any other straddles them: refused."""
    if sync.role(target) != "row":
        return False
    if block is None:
        return True
    extent, tp = target.weight.shape[-1], sync.shards(target)
    if extent % block == 0:
        return False
    if extent * tp <= block:
        return True
    raise CalibrationError(f"{where}: blocks of {block} input channels straddle the {tp} tensor-parallel shards of {extent} columns each; "
                           f"use a block size that divides {extent} or covers all {extent * tp}")


def search_amax(q: TensorQuantizer, x: torch.Tensor, target: Any, sync: StatSync, where: str) -> Optional[torch.Tensor]:
    """The amax with which a search quantizes ``x`` (the target's weight as its quantizer sees it):
    the amax of ``x`` itself in the quantizer's shape (None for a dynamic one, and for NVFP4 on a whole
    weight: its global amax is then taken from ``x`` by the quantizer), MAX-reduced over the shards
    where it does not keep the split axis."""
    nvfp4 = q.spec.two_level
    if not q.needs_calibration and not nvfp4:
        return None
    group = sync.shard_group(target)
    if nvfp4 and group is None:
        return None
    amax = static_amax(x, q.spec, q.axis, q.attrs.backend)
    if group is None:
        return amax
    axis = 0 if sync.role(target) == "column" else 1
    try:
        dim = tp_shard_dim(q.spec, q.axis, amax.dim(), axis, x.shape[axis], sync.shards(target), where)
    except LayoutError as exc:
        raise CalibrationError(str(exc)) from None
    return sync.over_shards(amax, "max", target) if dim is None else amax


def output_mse(err: torch.Tensor, role: Optional[str], target: Any, sync: StatSync) -> torch.Tensor:
    """The mean squared output error of a shard's ``err``: a row-parallel shard's partial errors are added
    over the shards before squaring (the module docstring)."""
    if role == "row":
        err = sync.over_shards(err, "sum", target)
    return err.pow(2).mean()


def peer_mean(losses: torch.Tensor, target: Any, sync: StatSync) -> torch.Tensor:
    """``losses`` averaged over ``target``'s tensor-parallel peers (the shards' output slices, or the copies
    of one loss that ranks holding whole copies computed); unchanged without peers."""
    return sync.over_peers(losses, "sum", target) / sync.peers(target) if sync.peer_group(target) else losses


__all__ = ["groups_span_shards", "output_mse", "peer_mean", "search_amax"]
