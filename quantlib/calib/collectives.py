"""The one routine through which a calibration search's statistics meet across ranks (docs/design.md §5
and §9): :class:`StatSync`, built on the layout's :class:`~quantlib.parallel_state.ParallelState`.

A searched linear (a *target*) has replicas and, under tensor parallelism, shards:

- its replicas calibrate on different data: a dense linear's are the ranks of ``data_group``; an
  expert's only the ranks of ``data_group`` at the same position of ``expert_group`` and
  ``expert_tensor_group`` (the other data ranks hold other experts). :meth:`StatSync.over_replicas`
  reduces over exactly those, through a payload with one slot per (expert, expert-tensor) position,
  as :func:`quantlib.distributed.sync_amax` does for a per-expert amax;
- its shards (``parallel_role`` "column" or "row") are the ranks of ``tensor_group``
  (``expert_tensor_group`` for an expert): :meth:`StatSync.over_shards`; the ranks of that group
  that see its input (all but a row-parallel linear's, whose inputs are disjoint slices) are its
  peers: :meth:`StatSync.over_peers` makes their input statistics and losses one value.

Fail-fast rules, as the amax sync's: before the statistics meet, :meth:`StatSync.step` makes every rank
of every group agree on the targets (a structure hash) and spreads any rank's CalibrationError, so
either every rank raises or none does, and no rank waits in a collective another never reaches. Every
later collective is called by every rank of its group in the same order: the algorithms call
:meth:`over_replicas` for every target (zeros where a rank's expert got no tokens) and
:meth:`over_shards` only where the shards agree (they hold the same target and see the same tokens).
"""

from __future__ import annotations

import hashlib
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist

from ..distributed import _device_for
from ..nn.tensor_quantizer import CalibrationError
from ..parallel_state import GROUP_NAMES, ParallelState

_OPS = ("sum", "max", "min")


class StatSync:
    """Reductions of calibration statistics over a layout (None: one rank, every call the identity)."""

    def __init__(self, parallel_state: Optional[ParallelState]) -> None:
        self.state = parallel_state

    def size(self, group: str) -> int:
        return 1 if self.state is None else self.state.size(group)

    def shard_group(self, target: Any) -> Optional[str]:
        """The group over which ``target`` is split ("tensor" / "expert_tensor"), or None (whole here)."""
        if getattr(target, "parallel_role", "replicated") not in ("column", "row"):
            return None
        group = "expert_tensor" if getattr(target, "is_expert", False) else "tensor"
        return group if self.size(group) > 1 else None

    def peer_group(self, target: Any) -> Optional[str]:
        """The tensor-parallel group whose ranks feed ``target`` the same input, up to rounding (an MoE
        layer's output is combined in another order on each): a column-parallel linear's shards, or the
        copies of a linear that every tensor rank holds whole; None for a row-parallel one."""
        if getattr(target, "parallel_role", "replicated") == "row":
            return None
        group = "expert_tensor" if getattr(target, "is_expert", False) else "tensor"
        return group if self.size(group) > 1 else None

    def peers(self, target: Any) -> int:
        group = self.peer_group(target)
        return 1 if group is None else self.size(group)

    def role(self, target: Any) -> str:
        """``target``'s parallel role as the search sees it: "replicated" where it is not split here."""
        return target.parallel_role if self.shard_group(target) else "replicated"

    def shards(self, target: Any) -> int:
        group = self.shard_group(target)
        return 1 if group is None else self.size(group)

    # ------------------------------------------------------------------ reductions
    def _all_reduce(self, t: torch.Tensor, op: str, group: str) -> torch.Tensor:
        pg = self.state.group(group)
        dev = _device_for(pg, t.device)
        buf = t.to(dev)
        if op == "min":
            buf = buf.neg()
        dist.all_reduce(buf, op=dist.ReduceOp.SUM if op == "sum" else dist.ReduceOp.MAX, group=pg)
        if op == "min":
            buf = buf.neg()
        return buf.to(t.device)

    def over_replicas(self, t: torch.Tensor, op: str, expert: bool) -> torch.Tensor:
        """``t`` reduced with ``op`` ("sum", "max", "min") over the replicas of a target (an expert's
        when ``expert``); a new tensor, ``t`` is left alone. Every rank of ``data_group`` calls it."""
        assert op in _OPS, op
        if self.size("data") == 1:
            return t.clone()
        slots, index = 1, 0
        if expert:
            for g in ("expert", "expert_tensor"):
                slots, index = slots * self.size(g), index * self.size(g) + self.state.rank(g)
        if slots == 1:
            return self._all_reduce(t.clone(), op, "data")
        flat = t.reshape(-1)
        n = flat.numel()
        fill = 0.0 if op == "sum" else (float("-inf") if op == "max" else float("inf"))
        buf = torch.full((slots * n,), fill, dtype=t.dtype, device=t.device)
        buf[index * n : (index + 1) * n] = flat  # other positions' values land in other slots
        return self._all_reduce(buf, op, "data")[index * n : (index + 1) * n].reshape(t.shape)

    def over_replicas_each(self, values: list[torch.Tensor], experts: list[bool], op: str) -> list[torch.Tensor]:
        """:meth:`over_replicas` of every tensor of ``values`` (1-D), dense and expert ones batched into one
        collective each."""
        out: list[Optional[torch.Tensor]] = [None] * len(values)
        for kind in (False, True):
            idx = [i for i, e in enumerate(experts) if bool(e) == kind]
            if not idx:
                continue
            flat = torch.cat([values[i].reshape(-1).float().to(values[idx[0]].device) for i in idx])
            pieces = self.over_replicas(flat, op, kind).split([values[i].numel() for i in idx])
            for i, piece in zip(idx, pieces):
                out[i] = piece.reshape(values[i].shape).to(values[i].device)
        return out  # type: ignore[return-value]

    def over_shards(self, t: torch.Tensor, op: str, target: Any) -> torch.Tensor:
        """``t`` reduced with ``op`` over the tensor-parallel shards of ``target`` (a copy where it is not
        split). Every shard calls it for the same targets in the same order."""
        assert op in _OPS, op
        group = self.shard_group(target)
        return t.clone() if group is None else self._all_reduce(t.clone(), op, group)

    def over_peers(self, t: torch.Tensor, op: str, target: Any) -> torch.Tensor:
        """``t`` reduced with ``op`` over :meth:`peer_group` (a copy where there is none): one value on
        every rank that sees the same input, so that they all choose alike."""
        assert op in _OPS, op
        group = self.peer_group(target)
        return t.clone() if group is None else self._all_reduce(t.clone(), op, group)

    # ------------------------------------------------------------------ fail fast
    def agree(self, digest: int, failed: bool) -> tuple[bool, Optional[str]]:
        """(whether any rank failed, the first group whose ranks hold other targets, or None), the same
        on every rank: one int64 MAX all-reduce per group of more than one rank, in GROUP_NAMES order
        (the groups form a grid: a flag set anywhere reaches every rank)."""
        differs = None
        if self.state is None:
            return failed, differs
        for g in GROUP_NAMES:
            if self.size(g) == 1:
                continue
            t = self._all_reduce(torch.tensor([digest, -digest, int(failed), 0 if differs is None else 1], dtype=torch.int64), "max",
                                 g).tolist()
            failed = failed or bool(t[2])
            if differs is None and (t[0] != -t[1] or t[3]):
                differs = g
        return failed, differs

    def step(self, what: str, fn: Callable[[], Any], digest: int = 0) -> Any:
        """``fn()``; a CalibrationError on any rank, or ranks whose targets differ (``digest``), raise on
        every rank here, before the collectives that follow, which no rank then enters alone."""
        error, out = None, None
        try:
            out = fn()
        except CalibrationError as exc:
            error = exc
        failed, differs = self.agree(digest, error is not None)
        if error is not None:
            raise error
        if differs is not None:
            raise CalibrationError(f"{what}: the ranks of the {differs} group search different linears (names, shapes or parallel roles "
                                   "differ); every rank must hold a model of the same structure")
        if failed:
            raise CalibrationError(f"{what}: calibration failed on another rank (its error is reported there)")
        return out


def stat_sync(ctx: Any) -> StatSync:
    """The context's :class:`StatSync` (one rank where the context has none)."""
    sync = getattr(ctx, "sync", None)
    return sync if isinstance(sync, StatSync) else StatSync(None)


def targets_digest(method: str, targets: list) -> int:
    """A rank-independent hash of the searched targets: names (an expert's are its local ones), weight
    shapes, parallel roles: ranks whose digests differ would pair collectives of different targets."""
    h = hashlib.blake2b(digest_size=7)
    h.update(method.encode())
    for name, m, w in targets:
        h.update(f"|{name}:{tuple(w.shape)}:{m.parallel_role}:{bool(m.is_expert)}".encode())
    return int.from_bytes(h.digest(), "little")  # < 2**56: its negation fits in int64


__all__ = ["StatSync", "stat_sync", "targets_digest"]
