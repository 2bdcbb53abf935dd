"""The parallel layout: :class:`ParallelState` (the process groups that matter to amax: data, tensor,
expert and expert-tensor parallel; pipeline stages never share a quantizer), its discovery, and the
tensor-parallel layout rule :func:`tp_shard_dim` shared by the amax sync and the checkpoints.

Layout conventions (Megatron-Core's; :meth:`ParallelState.from_megatron` builds exactly these):

- ``data_group``: the ranks that hold the same dense (non-expert) parameters and calibrate on
  different data -- Megatron's data-parallel group with context parallel. When expert parallelism
  carves experts out of it (Megatron does), it contains ranks that hold *different* experts; the
  replicas of an expert are the ranks of ``data_group`` at the same position of ``expert_group`` and
  ``expert_tensor_group``.
- ``tensor_group`` / ``expert_tensor_group``: the tensor-parallel shards of dense / expert linears.
- ``expert_group``: the ranks that hold different experts of the same MoE layers.
- The groups together form a grid (every rank of a pipeline stage is reached from every other by a
  data step followed by a tensor step, as in Megatron); every rank of every group calls
  :func:`sync_amax`, with a model of the same structure (same quantizer names up to the experts' local
  indices, formats and amax sizes), and ranks of ``data_group`` hold the same tensor-parallel shard.
"""

from __future__ import annotations

import sys
from typing import Any, Optional

import torch.distributed as dist

from .formats import FormatSpec

ProcessGroup = Any  # torch.distributed.ProcessGroup; None means a group of one rank

#: The order in which :func:`quantlib.distributed.sync_amax` visits the groups (the same on every rank).
GROUP_NAMES: tuple[str, ...] = ("data", "tensor", "expert", "expert_tensor")
PARALLEL_ROLES: tuple[str, ...] = ("replicated", "column", "row")


class LayoutError(ValueError):
    """An amax that has no layout-independent global form (a block straddles tensor-parallel shards)."""


def tp_shard_dim(
    spec: FormatSpec, axis: tuple[int, ...] | None, ndim: int, split_axis: int | None, extent: int, tp_size: int, where: str
) -> int | None:
    """The dim of the ``ndim``-D amax of a quantizer of format ``spec`` keeping ``axis`` (its config's axis)
    that is sharded over TP, or None where the amax is the same on every TP rank (per tensor, or grouped
    over the whole split axis): the one rule of both the amax sync (which MAX-reduces over TP exactly the
    amax this gives None for) and the checkpoints' global form.

    ``split_axis`` is the axis of the quantized tensor that TP splits (None: not split) and ``extent``
    its local size. The rule depends only on the config and the layout, never on the amax values, so
    the same call maps a global amax shape back to the local one when loading.
    """
    if split_axis is None or ndim == 0 or spec.two_level:
        return None
    dim = split_axis % ndim
    block = spec.block
    if block is not None:
        blocked = {ndim - 1: block[-1]} if len(block) == 1 else {ndim - 2: block[0], ndim - 1: block[1]}
        if dim not in blocked:
            return dim
        size = blocked[dim]
        if tp_size == 1:
            return dim
        if extent <= 0:
            raise LayoutError(
                f"{where}: blocks of {size} along an axis split over TP={tp_size} whose local size is unknown "
                "(no weight to read it from), so whether a block spans the shards cannot be told"
            )
        if extent % size == 0:
            return dim  # every local block is a global block
        if extent * tp_size <= size:
            return None  # one block spans the whole axis: the synced amax is the global one
        raise LayoutError(
            f"{where}: blocks of {size} along an axis split over TP={tp_size} into {extent} per rank straddle the shards, "
            f"so its amax has no layout-independent form; use a block size that divides {extent} or >= {extent * tp_size}"
        )
    kept = {a % ndim for a in (axis or ())}
    return dim if dim in kept else None


class ParallelState:
    """The process groups of a parallel layout; ``None`` stands for a group of one rank (this one).

    ``ParallelState(data_group=None, tensor_group=None, expert_group=None, expert_tensor_group=None)``
    takes ``torch.distributed`` process groups (gloo or NCCL); see the module docstring for what each
    group means. :meth:`from_megatron` reads them from Megatron-Core's ``parallel_state``. The calling
    rank must belong to every group it passes.
    """

    def __init__(
        self,
        data_group: Optional[ProcessGroup] = None,
        tensor_group: Optional[ProcessGroup] = None,
        expert_group: Optional[ProcessGroup] = None,
        expert_tensor_group: Optional[ProcessGroup] = None,
    ) -> None:
        self._groups: dict[str, Optional[ProcessGroup]] = {
            "data": data_group,
            "tensor": tensor_group,
            "expert": expert_group,
            "expert_tensor": expert_tensor_group,
        }
        for name, group in self._groups.items():
            if group is None:
                continue
            if not (dist.is_available() and dist.is_initialized()):
                raise RuntimeError(f"ParallelState: a {name}_group was given but torch.distributed is not initialized")
            if dist.get_rank(group) < 0:
                raise ValueError(f"ParallelState: rank {dist.get_rank()} is not a member of the {name}_group it was given")

    @classmethod
    def from_megatron(cls) -> "ParallelState":
        """The groups of Megatron-Core's initialized ``parallel_state``: data parallel with context
        parallel, tensor model parallel, expert model parallel and expert tensor parallel.

        Raises ImportError without megatron-core and RuntimeError when
        ``megatron.core.parallel_state.initialize_model_parallel`` has not run.
        """
        try:
            from megatron.core import parallel_state as mpu
        except ImportError as exc:
            raise ImportError(
                "ParallelState.from_megatron() needs megatron-core (pip install megatron-core); "
                "or pass the process groups to ParallelState(...)"
            ) from exc
        if not mpu.model_parallel_is_initialized():
            raise RuntimeError(
                "ParallelState.from_megatron(): Megatron-Core's parallel_state is not initialized; call "
                "megatron.core.parallel_state.initialize_model_parallel(...) first, or pass the process groups to ParallelState(...)"
            )
        return cls(
            data_group=mpu.get_data_parallel_group(with_context_parallel=True),
            tensor_group=mpu.get_tensor_model_parallel_group(),
            expert_group=mpu.get_expert_model_parallel_group(check_initialized=False),
            expert_tensor_group=mpu.get_expert_tensor_parallel_group(check_initialized=False),
        )

    # ------------------------------------------------------------------ groups, sizes, ranks
    def group(self, name: str) -> Optional[ProcessGroup]:
        """The process group called ``name`` (one of :data:`GROUP_NAMES`), or None."""
        return self._groups[name]

    def size(self, name: str) -> int:
        group = self._groups[name]
        return 1 if group is None else dist.get_world_size(group)

    def rank(self, name: str) -> int:
        """This rank's index inside group ``name`` (0 for a group of one)."""
        group = self._groups[name]
        return 0 if group is None else dist.get_rank(group)

    def global_ranks(self, name: str) -> list[int]:
        """Global ranks of the members of group ``name``, in group order."""
        group = self._groups[name]
        if group is None:
            return [dist.get_rank()] if dist.is_available() and dist.is_initialized() else [0]
        return list(dist.get_process_group_ranks(group))

    @property
    def data_group(self) -> Optional[ProcessGroup]:
        return self._groups["data"]

    @property
    def tensor_group(self) -> Optional[ProcessGroup]:
        return self._groups["tensor"]

    @property
    def expert_group(self) -> Optional[ProcessGroup]:
        return self._groups["expert"]

    @property
    def expert_tensor_group(self) -> Optional[ProcessGroup]:
        return self._groups["expert_tensor"]

    @property
    def data_size(self) -> int:
        return self.size("data")

    @property
    def data_rank(self) -> int:
        return self.rank("data")

    @property
    def tensor_size(self) -> int:
        return self.size("tensor")

    @property
    def tensor_rank(self) -> int:
        return self.rank("tensor")

    @property
    def expert_size(self) -> int:
        return self.size("expert")

    @property
    def expert_rank(self) -> int:
        return self.rank("expert")

    @property
    def expert_tensor_size(self) -> int:
        return self.size("expert_tensor")

    @property
    def expert_tensor_rank(self) -> int:
        return self.rank("expert_tensor")

    def __repr__(self) -> str:
        parts = ", ".join(f"{n}={self.rank(n)}/{self.size(n)}" for n in GROUP_NAMES)
        return f"ParallelState({parts})"


# ---------------------------------------------------------------------------------- discovery


def discover_parallel_state() -> Optional[ParallelState]:
    """The layout calibration syncs over when none is passed: Megatron-Core's groups if its parallel
    state is initialized, else the default group as data parallel if torch.distributed runs several
    ranks, else None. Pass ``ParallelState()`` explicitly to calibrate each rank on its own."""
    if not (dist.is_available() and dist.is_initialized()):
        return None
    mpu = sys.modules.get("megatron.core.parallel_state")  # imported only by a Megatron user
    if mpu is not None and mpu.model_parallel_is_initialized():
        return ParallelState.from_megatron()
    if dist.get_world_size() > 1:
        return ParallelState(data_group=dist.group.WORLD)
    return None


__all__ = ["GROUP_NAMES", "PARALLEL_ROLES", "LayoutError", "ParallelState", "discover_parallel_state", "tp_shard_dim"]
