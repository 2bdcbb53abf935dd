"""The one collective layer (docs/design.md §5 and §9): every collective quantlib issues goes through here,
for the amax sync (:func:`quantlib.distributed.sync_amax`), the calibration searches (:class:`StatSync`) and the
Megatron export and weight sync (:mod:`quantlib.export.megatron_export`, :mod:`quantlib.export.megatron_sync`), so
all keep the same fail-fast rules.

Primitives: :func:`device_for` (NCCL wants CUDA tensors), :func:`all_reduce` ("sum", "max", "min"),
:func:`all_gather` (tensors, as bytes), :func:`all_gather_objects` / :func:`gather_objects` (metadata and
error messages), :func:`first_failure` (any rank's error known on every rank),
:func:`slot` and :func:`pack_by_slot` (a payload with one slot per position in some groups, so that
only the ranks at the same position meet), :func:`structure_digest` (a rank-independent blake2b hash)
and :func:`agreement` (one int64 MAX all-reduce of ``[d, -d, n, -n, ..., flags]``: the ranks agree on a
digest and on counts exactly where the MAX of a value equals minus the MAX of its negation, and a flag
set on any rank reaches all). Timeouts are the process groups' own (``init_process_group(timeout=...)``):
quantlib sets none, it makes every rank call the same collectives in the same order instead.

:class:`StatSync` is the searches' view of a layout. A searched linear (a *target*) has replicas and,
under tensor parallelism, shards:

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
of every group agree on the targets (a structure digest) and spreads any rank's CalibrationError, so
either every rank raises or none does, and no rank waits in a collective another never reaches. Every
later collective is called by every rank of its group in the same order: the algorithms call
:meth:`StatSync.over_replicas` for every target (zeros where a rank's expert got no tokens) and
:meth:`StatSync.over_shards` only where the shards agree (they hold the same target and see the same tokens).
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterable, Sequence
from typing import Any, Optional

import torch
import torch.distributed as dist

from .nn.tensor_quantizer import CalibrationError
from .parallel_state import GROUP_NAMES, ParallelState, ProcessGroup

OPS = ("sum", "max", "min")
_CPU = torch.device("cpu")


# ---------------------------------------------------------------------------------- primitives


def device_for(group: ProcessGroup, preferred: torch.device) -> torch.device:
    """Where a payload for ``group`` lives: NCCL needs CUDA tensors; gloo and mixed backends take ``preferred``."""
    backend = str(dist.get_backend(group)).lower()
    if "nccl" in backend and "gloo" not in backend and preferred.type != "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    return preferred


def all_reduce(t: torch.Tensor, op: str, group: ProcessGroup) -> torch.Tensor:
    """``t`` reduced with ``op`` ("sum", "max", "min": a MAX of the negation) over ``group``, on the group's
    device (:func:`device_for`); ``t`` itself may be reduced in place."""
    assert op in OPS, op
    buf = t.to(device_for(group, t.device))
    if op == "min":
        buf = buf.neg()
    dist.all_reduce(buf, op=dist.ReduceOp.SUM if op == "sum" else dist.ReduceOp.MAX, group=group)
    return buf.neg() if op == "min" else buf


def all_gather(t: torch.Tensor, group: ProcessGroup) -> list[torch.Tensor]:
    """Every rank's ``t`` (of one shape and dtype on all ranks) in group rank order, gathered as bytes: gloo
    has no float8 all-gather."""
    flat = t.contiguous().reshape(-1).view(torch.uint8)
    got = [torch.empty_like(flat) for _ in range(dist.get_world_size(group))]
    dist.all_gather(got, flat, group=group)
    return [g.view(t.dtype).reshape(t.shape) for g in got]


def all_gather_objects(obj: Any, group: ProcessGroup) -> list:
    """Every rank's picklable ``obj`` in group rank order (error paths and small metadata only)."""
    out: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, obj, group=group)
    return out


def gather_objects(obj: Any, group: ProcessGroup) -> Optional[list]:
    """Every rank's picklable ``obj`` in group rank order on the group's first rank; None on the others."""
    first = dist.get_rank(group) == 0
    out: Optional[list] = [None] * dist.get_world_size(group) if first else None
    dist.gather_object(obj, out, dst=dist.get_global_rank(group, 0) if group is not None else 0, group=group)
    return out


def first_failure(group: ProcessGroup, error: Optional[BaseException]) -> Optional[tuple[int, str]]:
    """None where no rank of ``group`` failed, else (group rank, message) of the first that did, the same on every
    rank: one :func:`agreement` flag, then one object all-gather only where some rank failed."""
    _, _, (failed,) = agreement(group, 0, flags=(error is not None,))
    if not failed:
        return None
    messages = all_gather_objects(None if error is None else str(error), group)
    return next((r, m) for r, m in enumerate(messages) if m is not None)


def slot(state: ParallelState, slot_groups: Sequence[str]) -> tuple[int, int]:
    """(number of slots, this rank's slot) of a payload keyed by this rank's position in ``slot_groups``."""
    count, index = 1, 0
    for g in slot_groups:
        count, index = count * state.size(g), index * state.size(g) + state.rank(g)
    return count, index


def pack_by_slot(head: torch.Tensor, values: list[torch.Tensor], slots: list[tuple[int, int]], fill: float) -> tuple[torch.Tensor, Any]:
    """(buffer, where): ``head`` then, for each flat value, ``count`` spans of its length filled with
    ``fill`` except the span at its slot, which holds it; ``buf[where]`` reads the values back in order.
    ``fill`` must never win the reduction (0 for a MAX of amax, -inf for MAX, +inf for MIN)."""
    dev, lengths = head.device, [v.numel() for v in values]
    packed = torch.cat([v.reshape(-1).to(dev, head.dtype) for v in values]) if values else head.new_zeros(0)
    if all(count == 1 for count, _ in slots):
        return torch.cat([head, packed]), slice(head.numel(), head.numel() + packed.numel())
    starts, total = [], head.numel()
    for (count, index), n in zip(slots, lengths, strict=True):
        starts.append(total + index * n)
        total += count * n
    buf = torch.full((total,), fill, dtype=head.dtype, device=dev)
    buf[: head.numel()] = head
    n = torch.tensor(lengths, dtype=torch.int64, device=dev)
    before = torch.cumsum(n, 0) - n  # where each span begins in the packed values
    shift = torch.tensor(starts, dtype=torch.int64, device=dev) - before
    where = torch.arange(int(n.sum()), device=dev) + torch.repeat_interleave(shift, n)
    buf[where] = packed
    return buf, where


def structure_digest(pieces: Iterable[str]) -> int:
    """A rank-independent hash of ``pieces`` (names, shapes, formats, settings), below 2**56 so that its
    negation fits an int64 for :func:`agreement`."""
    h = hashlib.blake2b(digest_size=7)
    for piece in pieces:
        h.update(piece.encode())
    return int.from_bytes(h.digest(), "little")


def agreement(
    group: ProcessGroup, digest: int, counts: Sequence[int] = (), flags: Sequence[bool] = (), device: torch.device = _CPU
) -> tuple[bool, list[bool], list[bool]]:
    """(every rank of ``group`` holds ``digest``, per count whether every rank holds the same, per flag
    whether any rank set it), the same on every rank, from one int64 MAX all-reduce."""
    row = [digest, -digest] + [v for c in counts for v in (c, -c)] + [int(bool(f)) for f in flags]
    t = all_reduce(torch.tensor(row, dtype=torch.int64, device=device), "max", group).tolist()
    same = [t[2 + 2 * i] == -t[3 + 2 * i] for i in range(len(counts))]
    return t[0] == -t[1], same, [bool(v) for v in t[2 + 2 * len(counts) :]]


# ---------------------------------------------------------------------------------- the searches' view


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
        return all_reduce(t, op, self.state.group(group)).to(t.device)

    def over_replicas(self, t: torch.Tensor, op: str, expert: bool) -> torch.Tensor:
        """``t`` reduced with ``op`` ("sum", "max", "min") over the replicas of a target (an expert's
        when ``expert``); a new tensor, ``t`` is left alone. Every rank of ``data_group`` calls it."""
        assert op in OPS, op
        if self.size("data") == 1:
            return t.clone()
        count, index = slot(self.state, ("expert", "expert_tensor") if expert else ())
        if count == 1:
            return self._all_reduce(t.clone(), op, "data")
        fill = 0.0 if op == "sum" else (float("-inf") if op == "max" else float("inf"))
        buf, where = pack_by_slot(t.new_zeros(0), [t], [(count, index)], fill)  # other positions' values land in other slots
        return self._all_reduce(buf, op, "data")[where].reshape(t.shape)

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
        assert op in OPS, op
        group = self.shard_group(target)
        return t.clone() if group is None else self._all_reduce(t.clone(), op, group)

    def over_peers(self, t: torch.Tensor, op: str, target: Any) -> torch.Tensor:
        """``t`` reduced with ``op`` over :meth:`peer_group` (a copy where there is none): one value on
        every rank that sees the same input, so that they all choose alike."""
        assert op in OPS, op
        group = self.peer_group(target)
        return t.clone() if group is None else self._all_reduce(t.clone(), op, group)

    # ------------------------------------------------------------------ fail fast
    def agree(self, digest: int, failed: bool) -> tuple[bool, Optional[str]]:
        """(whether any rank failed, the first group whose ranks hold other targets, or None), the same
        on every rank: one :func:`agreement` per group of more than one rank, in GROUP_NAMES order
        (the groups form a grid: a flag set anywhere reaches every rank)."""
        differs = None
        if self.state is None:
            return failed, differs
        for g in GROUP_NAMES:
            if self.size(g) == 1:
                continue
            same, _, (any_failed, any_differs) = agreement(self.state.group(g), digest, flags=(failed, differs is not None))
            failed = failed or any_failed
            if differs is None and (not same or any_differs):
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
    return structure_digest([method] + [f"|{name}:{tuple(w.shape)}:{m.parallel_role}:{bool(m.is_expert)}" for name, m, w in targets])


__all__ = [
    "OPS", "StatSync", "agreement", "all_gather", "all_gather_objects", "all_reduce", "device_for", "first_failure", "gather_objects",
    "pack_by_slot", "slot", "stat_sync", "structure_digest", "targets_digest",
]
