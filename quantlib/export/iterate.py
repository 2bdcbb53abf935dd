"""``iter_packed``: the streaming iterator under every export path (checkpoints, RL weight sync)."""

from __future__ import annotations

import dataclasses
import os
from typing import Any, Callable, Iterable, Iterator, Literal, Optional, TypeVar, Union

import torch
from torch import nn

from ..formats import Kind
from ..traversal import applied_config
from .expert_stacks import input_stacks, shard_tensors, stacked_items
from .items import Item
from .layouts import ModelLayout, layout_for
from .modules import ModuleWalk
from .plan import Plan, make_plan
from .plan_cache import cached_plan
from .quantize import real_quantize, static_scales
from .sync_scales import Scales, apply_scales, as_scales, weight_free
from .transposed import swap_weight
from .types import ExportError, ExportFormat, PackedWeight
from .writers import Packer, as_format, packer as get_packer

T = TypeVar("T")


def pack_item(it: Item, fmt: Union[ExportFormat, Packer], scale: Optional[torch.Tensor] = None) -> PackedWeight:
    """The packed tensors of one planned checkpoint module (``scale``: its static FP8 scale, if computed),
    queued on the module's device: nothing is read back to the host."""
    p = fmt if isinstance(fmt, Packer) else get_packer(fmt)
    tensors: dict[str, torch.Tensor] = {}
    if it.spec is not None:
        w = it.weight() if it.pre is None else it.pre(it.weight())
        q = real_quantize(w, it.spec, it.amax, backend="auto", scale=scale, block_amax=it.block_amax)
        q = q if it.post is None else it.post(q)
        tensors.update(p.pack_experts(it.leaf, q) if it.role == "experts" else p.pack(q))
        if it.chain is not None:
            tensors.update(p.pack_chain(*it.chain))
        if it.transposed:
            tensors = swap_weight(tensors)
        if it.input_spec is not None:
            tensors.update(p.pack_input(it.input_spec, it.input_amax))
    for k, get in it.extras.items():
        tensors[k] = get()
    return PackedWeight(it.name, tensors, it.role, it.expert, it.shard)


def iter_plan(plan: Plan, fmt: ExportFormat, stacked: bool = False, tp: tuple[int, int] = (0, 1),
              joined: bool = False) -> Iterator[PackedWeight]:
    """Pack the plan's items in order; ``stacked`` gathers each fused-experts module's experts (3-D),
    as TP rank ``tp[0]`` of ``tp[1]`` holds them; ``joined``: a stacked projection's shards may be views of
    one cast (:func:`~quantlib.export.expert_stacks.shard_tensors`)."""
    p = get_packer(fmt)
    with torch.no_grad():
        # FP8 per-tensor scales in one pass per device, not a handful of small ops per weight (FP8 blocks
        # take theirs in the cast kernel)
        fp8 = [it for it in plan.items if it.spec is not None and it.spec.kind == Kind.FP8]
        scales = dict(zip(map(id, fp8), static_scales([(it.spec, it.amax) for it in fp8])))
        pending: list[Item] = []
        for it in plan.items:
            if it.parts:  # a stacked projection planned whole (stacked plans only)
                if pending:
                    yield from _stack(pending, p, tp, scales)
                    pending = []
                yield from _stacked(it, p, tp, joined)
                continue
            if stacked and it.role == "expert":
                if pending and pending[0].fused != it.fused:
                    yield from _stack(pending, p, tp, scales)
                    pending = []
                pending.append(it)
                continue
            if pending:
                yield from _stack(pending, p, tp, scales)
                pending = []
            yield pack_item(it, p, scales.get(id(it)))
        if pending:
            yield from _stack(pending, p, tp, scales)
        for kv in plan.kv:
            yield PackedWeight(kv.name, p.pack_kv(kv.spec, kv.k_amax, kv.v_amax), "kv")


def _stack(items: list[Item], fmt: Packer, tp: tuple[int, int], scales: Optional[dict] = None) -> Iterator[PackedWeight]:
    """One fused-experts module's quantized experts as vLLM's fused-MoE parameters take them whole: per
    shard (w1 gate, w3 up, w2 down) every expert stacked on dim 0, named ``w13_<suffix>`` / ``w2_<suffix>``,
    TP rank ``tp[0]``'s rows of w1 / w3 and columns of w2 (vLLM's 3-D load does not narrow them). Each expert is
    packed into its slot of the shard's tensors and dropped, so a shard is held once, not also as its experts."""
    by_shard: dict = {}
    for it in items:
        by_shard.setdefault(it.shard, []).append(it)
    for shard, group in by_shard.items():
        group = sorted(group, key=lambda i: i.expert)
        out: dict[str, torch.Tensor] = {}
        for j, it in enumerate(group):
            packed = pack_item(it, fmt, (scales or {}).get(id(it))).tensors
            if j and packed.keys() != out.keys():
                raise ExportError(f"{it.where}: packed keys {sorted(packed)} differ from expert {group[0].expert}'s {sorted(out)}")
            for k, t in packed.items():
                if not j:
                    out[k] = t.new_empty((len(group), *t.shape))
                elif (t.shape, t.dtype) != (out[k].shape[1:], out[k].dtype):
                    raise ExportError(f"{it.where}: packed {k} {tuple(t.shape)} {t.dtype} does not stack on expert {group[0].expert}'s "
                                      f"{tuple(out[k].shape[1:])} {out[k].dtype}")
                out[k][j] = t
            del packed
        prefix, dim = ("w2", 2) if shard == "w2" else ("w13", 1)
        tensors = {f"{prefix}_{k}": _tp_part(k, t, dim, tp, group[0].where) for k, t in out.items()}
        del out
        pw = PackedWeight(group[0].fused, tensors, "expert", None, shard)
        del tensors
        yield pw
        del pw


def _stacked(it: Item, fmt: Packer, tp: tuple[int, int], joined: bool) -> Iterator[PackedWeight]:
    """A projection of every expert planned whole: each vLLM shard (w1 / w3 rows of ``gate_up_proj``, w2) cast from its
    rows of the (E, out, in) stack as :func:`_stack` yields it (its tensors with every expert on dim 0); a shard's tensors
    are dropped here before the next is cast."""
    inputs = input_stacks(fmt, it.input_spec, it.input_amax, it.experts)
    for shard, tensors in shard_tensors(it, fmt, joined):
        prefix, dim = ("w2", 2) if shard == "w2" else ("w13", 1)
        tensors.update(inputs)
        pw = PackedWeight(it.fused, {f"{prefix}_{k}": _tp_part(k, t, dim, tp, it.where) for k, t in tensors.items()}, "expert", None, shard)
        del tensors
        yield pw
        del pw


def _tp_part(key: str, t: torch.Tensor, dim: int, tp: tuple[int, int], where: str) -> torch.Tensor:
    """Rank ``tp[0]``'s part of a stacked packed tensor split over ``dim`` (1: rows, 2: columns). Codes and
    block / channel scales scale with the split axis; per-tensor scales (no such axis, or one entry) are
    replicated; CT's ``weight_shape`` [E, 2] holds the weight's shape, so the shard's shape is written."""
    rank, size = tp
    if size == 1:
        return t
    if key == "weight_shape":
        out = t.clone()
        out[:, dim - 1] //= size
        return out
    if t.dim() <= dim or t.shape[dim] == 1:
        return t
    if t.shape[dim] % size:
        raise ExportError(f"{where}: packed {key} {tuple(t.shape)} does not split into {size} tensor-parallel parts on dim {dim}")
    n = t.shape[dim] // size
    return t.narrow(dim, rank * n, n).contiguous()


def check_arguments(**kwargs: Any) -> None:
    """Refuse export arguments of the wrong type or value, naming the argument and the value."""
    for name in ("overwrite", "unify_siblings"):
        if name in kwargs and not isinstance(kwargs[name], bool):
            raise ExportError(f"{name}={kwargs[name]!r}: expected True or False")
    if "progress" in kwargs and kwargs["progress"] is not None and not isinstance(kwargs["progress"], bool):
        raise ExportError(f"progress={kwargs['progress']!r}: expected None (automatic), True or False")
    if "tp" in kwargs:
        tp = kwargs["tp"]
        if not isinstance(tp, int) or isinstance(tp, bool) or tp < 1:
            raise ExportError(f"tp={tp!r}: expected a tensor-parallel degree, an int >= 1")
    if kwargs.get("tp_rank") is not None:
        rank, tp = kwargs["tp_rank"], kwargs.get("tp", 1)
        if not isinstance(rank, int) or isinstance(rank, bool) or not 0 <= rank < tp:
            raise ExportError(f"tp_rank={rank!r}: expected None or a rank of tp={tp}, an int in [0, {tp})")
    if "layout" in kwargs and kwargs["layout"] is not None and not isinstance(kwargs["layout"], ModelLayout):
        raise ExportError(f"layout={kwargs['layout']!r}: expected a quantlib.export.ModelLayout or None")
    if "out_dir" in kwargs and not isinstance(kwargs["out_dir"], (str, os.PathLike)):
        raise ExportError(f"out_dir={kwargs['out_dir']!r}: expected a path")


def iter_packed(
    model: nn.Module,
    format: Union[ExportFormat, str],
    *,
    layout: Optional[ModelLayout] = None,
    experts: Literal["per_expert", "stacked"] = "per_expert",
    chunk_bytes: Optional[int] = None,
    unify_siblings: bool = False,
    tp: int = 1,
    tp_rank: Optional[int] = None,
    scales: Union[Scales, str] = Scales.CALIBRATED,
) -> Iterator[Union[PackedWeight, list[PackedWeight]]]:
    """Yield each checkpoint module's packed tensors, module by module, on the model's device.

    Everything is checked first (:class:`ExportError`). ``experts="stacked"`` yields each fused-experts
    module's experts as 3-D tensors per vLLM shard id (for in-memory weight sync; an unsharded model gives
    the TP1 tensors). With ``chunk_bytes``, yields lists of PackedWeights of at most that many bytes each
    (a single larger weight makes a list of one). ``tp`` checks blocks against that tensor-parallel degree;
    with ``experts="stacked"`` and ``tp > 1``, ``tp_rank`` picks the rank whose shard of the stacked experts
    is yielded (vLLM's fused-MoE loader takes 3-D tensors as that rank's shard). ``scales``: "calibrated"
    (the quantizers' amax, as evaluated: checkpoints), "dynamic" (from the weights being sent: RL weight
    sync after optimizer steps) or "static" (calibrated, refusing by name a weight that outgrew it); see
    :class:`~quantlib.export.sync_scales.Scales`.
    """
    stream = packed_stream(model, format, layout=layout, experts=experts, unify_siblings=unify_siblings, tp=tp, tp_rank=tp_rank,
                           scales=scales)
    if chunk_bytes is None:
        yield from stream
    else:
        yield from chunked(stream, lambda pw: pw.nbytes, chunk_bytes)


def packed_stream(
    model: nn.Module,
    format: Union[ExportFormat, str],
    *,
    layout: Optional[ModelLayout] = None,
    experts: Literal["per_expert", "stacked"] = "per_expert",
    unify_siblings: bool = False,
    tp: int = 1,
    tp_rank: Optional[int] = None,
    scales: Union[Scales, str] = Scales.CALIBRATED,
    joined: bool = False,
) -> Iterator[PackedWeight]:
    """:func:`iter_packed` unchunked; ``joined``: the w1 / w3 shards of a stacked projection may be non-contiguous
    views of one cast of the whole stack, for a consumer that joins them again (vLLM's ``w13``, see
    :func:`~quantlib.export.weight_sync.sync_pairs`)."""
    fmt = as_format(format)
    source = as_scales(scales)
    check_arguments(unify_siblings=unify_siblings, tp=tp, tp_rank=tp_rank, layout=layout)
    if experts not in ("per_expert", "stacked"):
        raise ExportError(f"experts={experts!r}: expected 'per_expert' or 'stacked'")
    if experts == "stacked" and tp > 1 and tp_rank is None:  # (a tp_rank outside [0, tp): check_arguments)
        raise ExportError(f"tp_rank={tp_rank!r}: experts='stacked' at tp={tp} yields one rank's shard (vLLM's 3-D load does not narrow); "
                          f"pass tp_rank in [0, {tp})")
    # dynamic scales replace the calibrated sibling amax, so their differences do not matter
    unify = unify_siblings or source is Scales.DYNAMIC
    config = applied_config(model)
    share = bool(config is not None and config.sync_expert_weight_amax)
    # stacked experts are planned per projection (one cast each) where the scales need no per-expert comparison
    # or sharing (static scales check each expert; a shared expert amax may span one-block experts)
    whole = experts == "stacked" and source is not Scales.STATIC and not share

    def build(mw: ModuleWalk) -> tuple[Plan, bool]:  # mw: one traversal for the layout and the plan
        plan = make_plan(model, get_packer(fmt), layout or layout_for(model, mw), unify_siblings=unify, tp=tp, modules=mw,
                         stacks=stacked_items if whole else None)
        scaled = source is Scales.DYNAMIC and weight_free(plan.items, share)  # the same items for every step's weights
        if scaled:
            plan.items = apply_scales(plan.items, source, share_experts=share)
        return plan, scaled

    # an RL loop syncs every step through the same quantizers: the plan is built and checked once for them
    plan, scaled = cached_plan(model, (fmt, layout, unify, tp, whole, source, share), build)
    if not scaled:
        plan = dataclasses.replace(plan, items=apply_scales(plan.items, source, share_experts=share))
    yield from iter_plan(plan, fmt, stacked=experts == "stacked", tp=(tp_rank or 0, tp), joined=joined)


def chunked(items: Iterable[T], size: Callable[[T], int], limit: int) -> Iterator[list[T]]:
    """Consecutive lists of ``items`` of at most ``limit`` total ``size`` (an item larger than that alone)."""
    if limit <= 0:
        raise ExportError(f"chunk_bytes must be positive, got {limit}")
    chunk: list[T] = []
    total = 0
    for item in items:
        n = size(item)
        if chunk and total + n > limit:
            yield chunk
            chunk, total = [], 0
        chunk.append(item)
        total += n
    if chunk:
        yield chunk
