"""Whole tensors from the tensor-parallel parts of the Megatron sync (:mod:`.megatron_sync`), for a receiver whose
tensor parallelism differs from the trainer's: vLLM's ``load_weights`` takes whole HF tensors and narrows them to its
own TP rank. One all-gather per split tensor over the group that split it; expert-parallel parts stay parts (each
expert-parallel rank sends its own experts). vLLM's 3-D fused-MoE load does not narrow: for such a receiver sync
the experts per expert (``experts="per_expert"``), whose 2-D tensors it narrows."""

from __future__ import annotations

from typing import Iterable, Iterator

import torch

from ..collectives import all_gather
from .megatron_sync import SyncTensor

_TP_GROUPS = ("tensor", "expert_tensor")


def join_tp(name: str, pieces: list[torch.Tensor], axis: int) -> torch.Tensor:
    """The whole tensor ``name`` from its tensor-parallel pieces in rank order: concatenated along ``axis``,
    except stacked ``w13_*``, whose pieces are each vLLM's w13 of a TP rank (its gate piece, then its up piece)."""
    if name.rpartition(".")[2].startswith("w13_"):
        h = pieces[0].shape[axis] // 2
        pieces = [t.narrow(axis, 0, h) for t in pieces] + [t.narrow(axis, h, h) for t in pieces]
    return torch.cat(pieces, axis)


def whole_tensors(parts: Iterable[SyncTensor]) -> Iterator[SyncTensor]:
    """``parts`` (every rank's :func:`~quantlib.export.megatron_sync.megatron_sync_tensors`, in its order) with each
    tensor-parallel split gathered: every TP rank gets the whole tensor, numbered as a replica (``replica * parts +
    part``), as the replicated tensors are. Collective over each split's group: every rank iterates to the end."""
    from ..parallel_state import ParallelState

    state = ParallelState.from_megatron()
    for st in parts:
        tp = [s for s in st.splits if s.group in _TP_GROUPS]
        if not tp:
            yield st
            continue
        split = tp[0]
        group = state.group(split.group)
        pieces = all_gather(st.tensor, group)  # the pieces of one tensor are of one size
        rest = tuple(s for s in st.splits if s is not split)
        yield SyncTensor(st.name, join_tp(st.name, pieces, split.axis), rest, st.replica * split.parts + split.part)
