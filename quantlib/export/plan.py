"""The export plan: every checkpoint module of a model, what it holds, and every check, done before
anything is packed or written (docs/design.md §8)."""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass, field
from typing import Callable, Optional

import torch
from torch import nn
from torch._utils import _flatten_dense_tensors

from ..formats import FormatSpec, QuantizedTensor, blocked_shape
from ..formats.spec import describe
from ..kv.export_plan import KVItem, plan_kv
from ..nn.containers import SequentialQuantizer
from ..nn.quant_module import QuantModule
from ..nn.tensor_quantizer import TensorQuantizer
from .built_rows import refuse_unread_rows
from .checks import check_structure, refuse_permuted_blocks, refuse_unwritten, stored_fused, whole_experts_off
from .fold import plan_folds
from .fold_experts import fused_experts_class, part_name
from .items import Item, active_input, child, live, refuse_pre_quant_scale, row_part
from .layouts import ModelLayout, with_checkpoint_names, with_structure
from .modules import ModuleWalk, named_modules  # noqa: F401 - named_modules: the plan's traversal, imported from here
from .moved import Moved, moved_sources
from .transposed import stored_transposed
from .types import ExportError
from .writers import ConfigInfo, Packer
from .writers.base import Scheme


@dataclass
class Plan:
    """The checked items of a model, the ``quantization_config`` inputs, and the siblings unified."""

    items: list[Item]
    info: ConfigInfo
    unified: dict[tuple[str, ...], float]
    kv: list[KVItem] = field(default_factory=list)  # attention modules whose KV-cache scales are written

    @property
    def quantized(self) -> list[str]:
        """Checkpoint names of the quantized items, each once (a stored-fused experts module has one item per projection)."""
        return list(dict.fromkeys(i.name for i in self.items if i.spec is not None))


#: builds the stacked items of one fused-experts module (module, name, layout, packer), or None: per expert
StackItems = Callable[[nn.Module, str, ModelLayout, Packer], Optional[list["Item"]]]


def walk(
    model: nn.Module, layout: ModelLayout, modules: Optional[ModuleWalk] = None, stored_experts: bool = False,
    stacks: Optional[tuple[StackItems, Packer]] = None, out_folds: Optional[dict[str, torch.Tensor]] = None
) -> list[Item]:
    """Every checkpoint module of ``model`` in module order (nothing checked yet; pre_quant_scales are
    :func:`~quantlib.export.fold.plan_folds`'s); ``modules``: its :class:`ModuleWalk`, when the caller has one.
    ``stored_experts``: quantized fused experts that the checkpoint keeps 3-D become one item per projection.
    ``stacks``: (builder, packer) of an RL sync of stacked experts, whose projections are planned whole where they can be.
    ``out_folds``: the plan's folds into output channels, which tensors the checkpoint moves (:mod:`.moved`) take at their source."""
    fused_cls = fused_experts_class()
    mw = ModuleWalk(model) if modules is None else modules
    items: list[Item] = []
    base_groups = QuantModule.weight_groups
    renamed, shards, tp_axis = layout.renames.get, layout.shards.get, layout.tp_axis
    moved = Moved(model, layout, out_folds) if layout.tensors or layout.built else None
    for name, module, direct, quant in mw.entries:  # containers hold nothing of their own to write or check
        parent, _, leaf = name.rpartition(".")
        if quant and isinstance(module, fused_cls):
            if not stored_fused(module, name, layout, carried=stored_experts):
                whole = None if stacks is None else stacks[0](module, name, layout, stacks[1])
                items += _fused_items(module, name, layout, direct) if whole is None else whole
                direct = {k: t for k, t in direct.items() if k not in module.projections and not k.endswith("_bias")}
            elif stored_experts:
                if moved is not None:  # the format writes each projection under the module's name
                    moved.refuse(name, module.projections, f"{name}'s experts quantizer")
                items += _stored_items(module, name, layout)
                direct = {k: t for k, t in direct.items() if k not in module.projections}
        elif quant and "weight" in direct:
            swap = False
            if type(module).weight_groups is not base_groups:  # the base yields this module's weight alone
                swap = _swapped(model, name, module, direct["weight"])
            q = child(module, "weight_quantizer")
            chain = _chain(q, f"{name}.weight_quantizer") if isinstance(q, SequentialQuantizer) and q.is_enabled else None
            if chain is not None:
                q = q[0]  # the item is the first member's; its second packs beside it (Packer.chain_ok)
            if isinstance(q, TensorQuantizer) and q.is_enabled:
                rows_key = None if moved is None else moved.rows_of(name, direct)
                w = direct["weight"]  # the walk's dict is shared: read, not popped
                ispec, iamax = active_input(child(module, "input_quantizer"))
                extras = {k: live(module, k) for k in direct if k != "weight"} if len(direct) > 1 else {}  # most linears: no bias
                spec = q.spec
                block_amax = q.block_amax if spec.two_level else None  # only NVFP4 keeps one: skip the lookup
                get = live(module, "weight")
                item = Item(renamed(name, name), "linear", f"{name}.weight_quantizer", (lambda g=get: g().t()) if swap else get, spec,
                            q.amax, ispec, iamax, extras, shard=shards(leaf), parent=parent, leaf=leaf, tp_axis=tp_axis(leaf),
                            shape=tuple(w.shape[::-1] if swap else w.shape), input_where=f"{name}.input_quantizer",
                            block_amax=block_amax, chain=chain, transposed=swap)
                if rows_key is not None:  # saved as rows of one key with other quantized modules: one item, once all are met
                    item = moved.add_rows(rows_key, item, name)
                if item is not None:
                    items.append(item)
                continue
        if quant and not isinstance(module, fused_cls):
            refuse_unwritten(module, name)  # an enabled weight quantizer that no item above carries
        if direct and moved is not None:
            direct = moved.split(items, module, name, direct)
        if direct:
            items.append(Item(renamed(name, name), "unquantized", name, extras={k: live(module, k) for k in direct},
                              parent=parent, leaf=leaf))
    if moved is not None:
        moved.unfinished()
    return items


def _swapped(model: nn.Module, name: str, module: nn.Module, weight: torch.Tensor) -> bool:
    """True where ``module`` shows its weight to its quantizer transposed and checkpoints of ``model``'s family store
    that module's weight (in, out) (GPT-2's ``Conv1D``: :mod:`.transposed`); False where it shows the weight itself;
    any other layout is refused by name."""
    groups = list(module.weight_groups())
    keys = [g for g, _ in groups]
    if keys != ["weight_quantizer"]:
        raise ExportError(f"{name}: no export layout for {type(module).__name__} (weights {keys})")
    shown = groups[0][1][0]
    if shown is weight:
        return False
    if not (shown.dim() == 2 and shown._base is weight and shown.shape == weight.shape[::-1]):  # else not the transpose
        raise ExportError(f"{name}: no export layout for {type(module).__name__} (its weight quantizer sees another tensor than .weight)")
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    if not stored_transposed(model_type, name):
        raise ExportError(f"{name}: a quantized {type(module).__name__} stores its weight (in, out), and no consumer is known to read that "
                          f"quantized for config.model_type {model_type!r} (vLLM transposes the weights of GPT-2's c_attn / c_proj / c_fc "
                          "only); disable its quantizer")
    return True


def _chain(q: SequentialQuantizer, where: str) -> tuple[FormatSpec, Optional[torch.Tensor]]:
    """The second member (spec, amax) of a two-member weight chain whose members are all enabled (W4A8: INT4 blocks
    then FP8 per tensor); any other chain is refused by name: no format carries it."""
    members = list(q)
    if len(members) != 2 or not all(isinstance(m, TensorQuantizer) and m.is_enabled for m in members):
        states = ", ".join(describe(m.spec) if m.is_enabled else "disabled" for m in members)
        raise ExportError(f"{where} = SequentialQuantizer [{states}]: export formats carry a chain of two enabled members only (W4A8_AWQ: "
                          "INT4 blocks, then FP8)")
    return members[1].spec, members[1].amax


def _fused_items(module: nn.Module, name: str, layout: ModelLayout, direct: dict) -> list[Item]:
    from ..plugins.huggingface import expert_weight

    items = []
    # what every expert of a projection shares, read once per projection (a layer has 128 experts and more)
    shared = {}
    for proj in module.projections:
        rows, cols = expert_weight(module, proj, 0).shape
        bias = getattr(module, f"{proj}_bias", None) if getattr(module, "has_bias", False) else None
        shared[proj] = (list(getattr(module, f"{proj}_weight_quantizer")), rows, cols, bias is not None,
                        active_input(getattr(module, f"{proj}_input_quantizer", None)), f"{name}.{proj}_input_quantizer")
    for e in range(module.num_experts):
        for proj in module.projections:
            members, rows, cols, has_bias, (ispec, iamax), input_where = shared[proj]
            q = members[e]
            where = f"{name}.{proj}_weight_quantizer[{e}]"
            chain = _chain(q, where) if isinstance(q, SequentialQuantizer) and q.is_enabled else None
            if chain is not None:  # W4A8: the item is the INT4 member's, the FP8 member (one per expert) packs beside it
                q = q[0]
            quantized = isinstance(q, TensorQuantizer) and q.is_enabled
            spec, amax, block_amax = (q.spec, q.amax, q.block_amax) if quantized else (None, None, None)
            for full, leaf, shard, r0, r1 in layout.expert_parts(name, proj, e, rows):
                extras = {} if not has_bias else {
                    "bias": (lambda b=f"{proj}_bias", e=e, r0=r0, r1=r1: getattr(module, b).detach()[e, r0:r1])}
                get = (lambda proj=proj, e=e, r0=r0, r1=r1: expert_weight(module, proj, e).detach()[r0:r1])  # noqa: E731
                parent = full.rpartition(".")[0]
                if quantized:
                    items.append(Item(full, "expert", where, get, spec, row_part(amax, spec, rows, r0, r1), ispec, iamax, extras, expert=e,
                                      shard=shard, parent=parent, leaf=leaf, tp_axis=layout.tp_axis(leaf), shape=(r1 - r0, cols),
                                      rows=(r0, r1, rows), fused=fused_name(full, e, name, layout), input_where=input_where,
                                      block_amax=row_part(block_amax, spec, rows, r0, r1), chain=chain, part=part_name(name, proj, e, r0)))
                else:
                    items.append(Item(full, "unquantized", full, extras={"weight": get, **extras}, expert=e, parent=parent,
                                      leaf=leaf, part=part_name(name, proj, e, r0)))
    return items


def fused_name(full: str, e: int, name: str, layout: ModelLayout) -> str:
    """The stacked (weight-sync) name of expert ``e``'s checkpoint module ``full`` of the fused experts ``name``: the
    checkpoint's experts module, "<fused>.{e}.<leaf>"."""
    head, _, idx = full.rpartition(".")[0].rpartition(".")
    return head if idx == str(e) else layout.checkpoint_name(name)


def _stored_items(module: nn.Module, name: str, layout: ModelLayout) -> list[Item]:
    """One item per projection of a fused-experts module the checkpoint keeps 3-D: every expert's (out, in)
    slice stacked into one (E * out, in) matrix, packed back into (E, out, ...) (per-row blocks never cross
    experts). Every expert of every projection must be quantized alike: consumers read the module whole."""
    from ..plugins.hf_experts import expert_weight, flag

    items = []
    for proj in module.projections:
        qname = f"{proj}_weight_quantizer"
        group = getattr(module, qname)
        members = [group[e] for e in range(module.num_experts)]
        first = describe(members[0].spec if members[0].is_enabled else None)
        for e, q in enumerate(members):
            if not (isinstance(q, TensorQuantizer) and q.is_enabled and q.spec == members[0].spec):
                what = "a chained quantizer" if isinstance(q, SequentialQuantizer) else describe(q.spec if q.is_enabled else None)
                raise ExportError(f"{name}.{qname}[{e}] = {what}, but {name}.{qname}[0] = {first}: the checkpoint keeps {name}.{proj} "
                                  "as one tensor of every expert, so every expert of every projection is quantized alike")
        inp = getattr(module, f"{proj}_input_quantizer", None)
        refuse_pre_quant_scale([(f"{name}.{qname}", group), (f"{name}.{proj}_input_quantizer", inp)])
        w = expert_weight(module, proj, 0)
        shape = (module.num_experts, *w.shape)
        # the 3-D parameter as (E, out, in), a view (no copy until packed: plan_bytes reads the getters)
        swap = flag(module, "is_transposed")
        get = (lambda proj=proj, swap=swap: getattr(module, proj).detach().transpose(1, 2) if swap else getattr(module, proj).detach())  # noqa: E731
        post = functools.partial(_as_experts, shape=shape)
        amax = None if any(q.amax is None for q in members) else torch.stack([q.amax for q in members])
        ispec, iamax = active_input(inp)
        items.append(Item(layout.checkpoint_name(name), "experts", f"{name}.{qname}", get, members[0].spec, amax, ispec, iamax, parent=name,
                          leaf=proj, shape=(shape[0] * shape[1], shape[2]), input_where=f"{name}.{proj}_input_quantizer",
                          pre=lambda w: w.reshape(-1, w.shape[-1]), post=post))
    return items


def _as_experts(q: QuantizedTensor, shape: tuple[int, int, int]) -> QuantizedTensor:
    """A stacked (E * out, in) weight's codes and scales as (E, out, ...)."""
    e, out = shape[:2]
    return dataclasses.replace(q, codes=q.codes.reshape(e, out, -1), scale=q.scale.reshape(e, out, -1), shape=shape)


def read_amax(items: list[Item], scalars: list[Item] = ()) -> tuple[bool, dict[int, float]]:
    """Whether every amax of ``items`` is finite, and the value of each one-element amax of ``scalars``
    (keyed by ``id(item)``): one reduction and one device-to-host read per device, whatever the number
    of items (a read per item would stall a GPU export once per module)."""
    by_device: dict[torch.device, tuple[list[torch.Tensor], list[Item]]] = {}
    for it in items:
        if it.amax is not None and not it.amax.is_meta:
            by_device.setdefault(it.amax.device, ([], []))[0].append(it.amax)
    for it in scalars:
        if _shared(it) is not None and not _shared(it).is_meta:
            by_device.setdefault(_shared(it).device, ([], []))[1].append(it)
    finite, values = True, {}
    for device, (amaxes, members) in by_device.items():
        # flattened and concatenated in one call: a reshape per amax is a Python call each
        if not members:  # the finiteness alone: one read of the flag, without a cast and a cat
            finite = bool(torch.isfinite(_flatten_dense_tensors(amaxes)).all()) and finite
            continue
        ok = torch.isfinite(_flatten_dense_tensors(amaxes)).all().reshape(1) if amaxes else torch.ones(1, dtype=torch.bool, device=device)
        row = torch.cat([ok.float()] + [_shared(m).reshape(1).float() for m in members]).tolist()
        finite = finite and row[0] == 1.0
        values.update(zip(map(id, members), row[1:]))
    return finite, values


def _check_item(it: Item, packer: Packer, tp: int, finite_known: bool = False, passed: Optional[set] = None) -> None:
    """Refuse what ``it`` cannot be exported as; ``passed``: the keys of the format and block checks that
    earlier items of the same call passed (a model's linears share a handful of them)."""
    spec, where = it.spec, it.where
    if it.amax is None and spec.calibrated_amax:
        what = f"expert {it.expert} " if it.expert is not None else ""
        raise ExportError(f"{where}: {what}weight quantizer has no amax; calibrate first (quantlib.calibrate / quantize)")
    if not finite_known and it.amax is not None and not it.amax.is_meta and not bool(torch.isfinite(it.amax).all()):
        bad = "NaN" if bool(torch.isnan(it.amax).any()) else "Inf"
        raise ExportError(f"{where}: amax holds {bad} ({it.amax.flatten()[:4].tolist()}...); recalibrate")
    member = packer.member_for(spec) if it.role == "expert" else None
    if member is not None and member.experts_why is not None:
        via = "" if member is packer else f"its member {member.fmt.value}: "
        raise ExportError(f"{where}: expert {it.expert}: format {packer.fmt.value} cannot carry MoE experts ({via}{member.experts_why})")
    if packer.roles is not None and it.role not in packer.roles:
        raise ExportError(f"{where}: format {packer.fmt.value} quantizes no {it.role} weight ({packer.roles_why}); disable this quantizer")
    if it.transposed:
        why = packer.transposed_ok(spec)
        if why is not None:
            raise ExportError(f"{where}: {it.name} stores its weight (in, out) (GPT-2's Conv1D), and format {packer.fmt.value} reaches no "
                              f"consumer that reads it ({why}); export GPT-2 in another format, or disable this quantizer")
    if len(it.shape) != 2:
        raise ExportError(f"{where}: a {len(it.shape)}-D weight {it.shape}; export formats carry 2-D linear weights (disable this "
                          "quantizer)")
    # the format and block checks depend on these alone (the names only make their messages); the specs by
    # identity (they outlive ``passed``): hashing a spec's fields per item costs more than an equal spec's recheck
    key = (id(spec), tuple(it.amax.shape) if it.amax is not None else (), id(it.input_spec), it.shape, it.rows, it.tp_axis, tp, None
           if it.chain is None else it.chain[0])
    done = passed is not None and key in passed
    if not done:
        why = packer.chain_ok(None if it.chain is None else it.chain[0], () if it.chain is None or it.chain[1] is None
                              else tuple(it.chain[1].shape))
        if why is not None:  # the weight's chain first: it decides the format more than its input does
            second = "none" if it.chain is None else describe(it.chain[0])
            raise ExportError(f"{where}: chained member 1 = {second}: format {packer.fmt.value} cannot carry it ({why})")
        packer.check(spec, key[1], it.input_spec, it.where, it.input_where or f"{it.name}.input_quantizer")
    if it.chain is not None and it.chain[1] is None and not it.chain[0].dynamic:
        raise ExportError(f"{where}[1]: the chain's {describe(it.chain[0])} member has no amax; calibrate first (quantlib.calibrate / "
                          "quantize)")
    if it.chain is not None and it.chain[1] is not None and not it.chain[1].is_meta and not bool(torch.isfinite(it.chain[1]).all()):
        raise ExportError(f"{where}[1]: amax holds {it.chain[1].flatten()[:4].tolist()}; recalibrate")
    if it.input_spec is not None and it.input_amax is None and it.input_spec.calibrated_amax:
        # dynamic NVFP4 blocks still scale by a calibrated global amax: the export's input_scale
        what = "static" if not it.input_spec.dynamic else "NVFP4 (its global scale is calibrated)"
        raise ExportError(f"{it.input_where}: {what} {describe(it.input_spec)} input without an amax; calibrate with a forward_loop")
    if not done:
        _check_blocks(it, spec, tp)
        if passed is not None:
            passed.add(key)


def _check_blocks(it: Item, spec: FormatSpec, tp: int) -> None:
    block = spec.block or ()
    rows, cols = it.shape
    bm, bk = (block[0], block[1]) if len(block) == 2 else (1, block[0] if block else 1)
    where = it.where
    _check_amax_fits(it, spec)
    if rows % bm or cols % bk:
        raise ExportError(f"{where}: weight {rows}x{cols} is not a whole number of {bm}x{bk} blocks; consumers derive the block from the "
                          "scale grid and load it wrong")
    r = it.rows
    if r is not None and bm > 1 and (r[0] % bm or r[1] % bm):
        raise ExportError(f"{where}: rows {r[0]}:{r[1]} of the fused {r[2]}-row expert weight straddle {bm}-row blocks; the split halves "
                          "cannot keep their scales")
    if tp > 1 and it.tp_axis is not None:
        n, b = (rows, bm) if it.tp_axis == 0 else (cols, bk)
        if n % tp or (n // tp) % b:
            raise ExportError(f"{where}: at tensor parallel {tp} the {'rows' if it.tp_axis == 0 else 'columns'} ({n}) split into shards of "
                              f"{n / tp:g}, not a whole number of blocks of {b}")


def _check_amax_fits(it: Item, spec: FormatSpec) -> None:
    """Refuse a weight whose shape is not the one its quantizer's amax was calibrated on (a tensor of other rows
    passed to serialize_weight, a weight resized after calibration): its scales would belong to other rows."""
    got = [("amax", it.amax)] if it.amax is not None and it.amax.numel() > 1 else []
    got += [("block amax", it.block_amax)] if it.block_amax is not None else []
    for what, amax in got:
        have = tuple(amax.shape)
        if what == "block amax" or spec.per_block_amax:
            fits = have == blocked_shape(it.shape, spec.block)
        else:  # per channel: each dimension the weight's or 1
            fits = len(have) == len(it.shape) and all(a in (1, s) for a, s in zip(have, it.shape))
        if not fits:
            raise ExportError(f"{it.where}: weight {it.name} of shape {tuple(it.shape)} does not match its quantizer's {what} of shape "
                              f"{have} (calibrated on another shape); recalibrate it, or pass the weight it was calibrated on")


def _part_views(it: Item, layout: ModelLayout) -> list[Item]:
    """Expert 0's item of each shard of a stacked projection, as the per-expert plan checks it (the checks read
    the shape, rows, block grid and tensor-parallel axis, which every expert shares)."""
    rows, cols = it.shape
    amax = None if it.amax is None else it.amax[0]
    return [dataclasses.replace(it, shape=(r1 - r0, cols), rows=(r0, r1, rows), leaf=leaf, shard=shard, tp_axis=layout.tp_axis(leaf),
                                amax=row_part(amax, it.spec, rows, r0, r1), expert=0, parts=(), experts=0)
            for leaf, shard, r0, r1 in it.parts]


def _module(it: Item) -> str:
    """The module name of a linear item (an expert item's checkpoint name, which names no module)."""
    return f"{it.parent}.{it.leaf}" if it.parent else it.leaf


def _shared(it: Item) -> Optional[torch.Tensor]:
    """The amax a sibling group shares when it has one element: a chain's second member's (W4A8's FP8), else the weight's."""
    return it.chain[1] if it.chain is not None else it.amax


def _grouped(items: list[Item]) -> list[Item]:
    """The items whose one-element amax a sibling group shares."""
    return [it for it in items if it.spec is not None and _shared(it) is not None and _shared(it).numel() == 1 and it.group is not None]


def _unify(items: list[Item], unify: bool, read: dict[int, float]) -> dict[tuple[str, ...], float]:
    """Siblings fused by consumers must share their per-tensor / global amax (``read``: the amax values
    of :func:`read_amax`; an amax without values, on the meta device, is not compared)."""
    groups: dict[tuple[str, tuple], list[Item]] = {}
    for it in _grouped(items):
        if id(it) in read:
            groups.setdefault((it.parent, it.group), []).append(it)
    unified = {}
    for members in groups.values():
        values = [read[id(m)] for m in members]
        if len(set(values)) <= 1:
            continue
        names = tuple(m.name for m in members)
        static = [m.where for m in members if m.block_amax is not None]
        if static:  # their block scales were chosen against their own global amax: another one changes them all
            raise ExportError(f"siblings {names} are fused by consumers and need one global amax, but differ ({values}); {static[0]} has "
                              "static NVFP4 block scales "
                              "chosen against its own global amax, so they cannot be unified: calibrate with one global amax per sibling "
                              "group")
        if not unify:
            detail = ", ".join(f"{m.where}{'' if m.chain is None else '[1]'} = {v!r}" for m, v in zip(members, values))
            raise ExportError(f"siblings {names} are fused by consumers and need one global amax, but differ: {detail}; pass "
                              "unify_siblings=True to use their max (the export then differs from the evaluated model)")
        top = max(values)
        for m in members:
            if m.chain is not None:
                m.chain = (m.chain[0], torch.full_like(m.chain[1], top))
            else:
                m.amax = torch.full_like(m.amax, top)
        unified[names] = top
    return unified


def make_plan(model: nn.Module, packer: Packer, layout: ModelLayout, *, unify_siblings: bool = False, tp: int = 1, version: str = "",
              modules: Optional[ModuleWalk] = None, stacks: Optional[StackItems] = None) -> Plan:
    """Walk ``model`` and check everything; raises :class:`ExportError` naming the module and quantizer.
    ``modules``: the model's :class:`ModuleWalk` as it is now, when the caller has one (it gave the layout).
    ``stacks``: plans fused-experts projections whole where it can (:func:`~quantlib.export.expert_stacks.stacked_items`: the RL
    sync of stacked experts)."""
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    if packer.model_types is not None and model_type not in packer.model_types:
        raise ExportError(f"{type(model).__name__} (config.model_type {model_type!r}): format {packer.fmt.value} is read by its consumers "
                          f"for model_type {sorted(packer.model_types)} only")
    mw = ModuleWalk(model) if modules is None else modules  # one traversal shared by every pass below
    layout = with_checkpoint_names(model, layout, mw)  # a layout passed by hand still gets transformers' names (cached)
    layout = with_structure(model, layout, mw)  # and is checked against the probe forward (cached)
    check_structure(mw, layout, type(model).__name__, packer.shares_global)
    folds = plan_folds(model, mw.modules, packer.carries_pre_quant_scale, packer.fmt.value, [(n, m) for n, m, q in mw.linears if q])
    kv, kv_spec = plan_kv(model, packer, layout, mw.attention)
    items = walk(model, layout, mw, packer.stores_fused_experts, None if stacks is None else (stacks, packer), folds.out)
    _refuse_misread_keys(items, packer, model_type)
    refuse_unread_rows(items, packer)
    refuse_permuted_blocks(items, packer, model)
    moved = moved_sources(layout)
    folds.apply(items, [k.rpartition(".")[0] for k in moved])  # the moved tensors took their folds at the source
    refused = None
    try:
        plan = check_items(items, packer, layout, unify_siblings=unify_siblings, tp=tp, version=version, what=type(model).__name__)
    except ExportError as exc:
        if not any(it.parts for it in items):
            raise
        refused = exc
    if refused is not None:  # the per-expert plan refuses it naming the expert (a stacked item stands for all of them)
        make_plan(model, packer, layout, unify_siblings=unify_siblings, tp=tp, version=version, modules=mw)
        raise refused
    plan.info.ignore += [layout.renames.get(n, n) for n in _tied_linears(mw)]
    # unquantized modules under the checkpoint's names (vLLM matches its modules, named as the checkpoint) and the model's
    # where they differ (transformers matches its own: a module it does not find listed gets quantized and misses its
    # scales), modules whose weight the checkpoint holds under another key (:mod:`.moved`) included
    listed = set(plan.info.ignore)
    plan.info.ignore += [m for m, ck in layout.renames.items() if ck in listed and m not in listed]
    within = {m for it in plan.items for m in it.members}  # quantized, saved as rows of one key (:mod:`.built_rows`)
    plan.info.ignore += [k[: -len(".weight")] for k in moved if k.endswith(".weight") and k[: -len(".weight")] not in within]
    plan.info.experts_off = whole_experts_off(mw, layout)
    listed = set(plan.info.ignore)  # with the names added above
    plan.info.ignore += [n for n in plan.info.experts_off if n not in listed]
    _refuse_split_inputs(plan.items, layout)
    if packer.mixed:
        _refuse_mixed_siblings(plan.items, layout)
    plan.kv, plan.info.kv_spec, plan.info.pre_quant_scale = kv, kv_spec, bool(folds.carried)
    why = packer.pre_quant_scale_ok(plan.info) if folds.carried else None
    if why is not None:
        raise ExportError(f"{next(iter(folds.carried))}.input_quantizer: pre_quant_scale folds nowhere and format {packer.fmt.value} "
                          f"cannot carry it ({why})")
    return plan


def _refuse_misread_keys(items: list[Item], packer: Packer, model_type: Optional[str]) -> None:
    """Refuses a checkpoint key that the format's consumer loads under another name (:meth:`Packer.key_ok`)."""
    for it in items:
        for k in ("weight", *it.extras) if it.spec is not None else it.extras:
            key = f"{it.name}.{k}" if it.name else k
            why = packer.key_ok(key, model_type, it.spec is not None and k == "weight")
            if why is not None:
                raise ExportError(f"{it.where}: written as {key}, but {why}; export in another format (ct_*, modelopt_*)")


def _tied_linears(mw: ModuleWalk) -> list[str]:
    """Linears whose weight the checkpoint holds under another module's name (a tied ``lm_head``): left unquantized
    (check_structure refuses a quantized one), so they are listed as such; else vLLM's ModelOpt loaders quantize a tied
    head and run it on the embedding's weight with scales nothing loaded."""
    if not mw.tied:
        return []
    owned = {n for n, _, direct in mw.owners if "weight" in direct}
    return [n for n, m, _ in mw.linears if n not in owned and isinstance(m._parameters.get("weight"), torch.Tensor)]


def _sibling_groups(items: list[Item], layout: ModelLayout) -> list[list[Item]]:
    """The quantized items of each fused sibling group (q/k/v, gate/up, ...), whatever their format shares."""
    groups: dict[tuple, list[Item]] = {}
    for it in items:
        group = it.group or layout.group_of(_module(it), it.leaf)  # INT4 / W4A16 siblings share no global scale: it.group is None
        if it.spec is not None and group is not None:
            groups.setdefault((it.parent, group), []).append(it)
    return list(groups.values())


def _refuse_mixed_siblings(items: list[Item], layout: ModelLayout) -> None:
    """A mixed-precision export gives each module its own scheme, but a consumer runs a fused group as one GEMM of
    one scheme (vLLM: "Mixed quant_algo within fused layer", "different quantization schemes for the shards")."""
    for first, *rest in _sibling_groups(items, layout):
        scheme = (_key(first.spec), _key(first.input_spec), _key(first.chain and first.chain[0]))
        for m in rest:
            if (_key(m.spec), _key(m.input_spec), _key(m.chain and m.chain[0])) != scheme:
                raise ExportError(f"{m.where} and {first.where}: siblings fused by consumers into one GEMM need one scheme, but "
                                  f"{m.name} is weight {describe(m.spec)} / input {describe(m.input_spec)} and {first.name} weight "
                                  f"{describe(first.spec)} / input {describe(first.input_spec)}; quantize the group alike")


def _refuse_split_inputs(items: list[Item], layout: ModelLayout) -> None:
    """A fused sibling group is one GEMM for its consumer, as ModelOpt's exporter makes it (resmoothed, one input amax):
    where a member carries a ``pre_quant_scale`` (ModelOpt's AWQ formats) or a chain (W4A8), they must all carry one
    ``pre_quant_scale`` and one input amax."""
    for first, *rest in _sibling_groups(items, layout):
        if not any(m.chain is not None or "pre_quant_scale" in m.extras for m in (first, *rest)):
            continue
        for m in rest:
            p0, p1 = first.extras.get("pre_quant_scale"), m.extras.get("pre_quant_scale")
            if (p0 is None) != (p1 is None) or (p0 is not None and not torch.equal(p0(), p1())):
                what = "pre_quant_scale"
            elif (first.input_amax is None) != (m.input_amax is None) or (m.input_amax is not None
                                                                          and not torch.equal(first.input_amax, m.input_amax)):
                what = "input amax"
            else:
                continue
            raise ExportError(f"{m.input_where} and {first.input_where}: siblings fused by consumers into one GEMM need one {what}, but "
                              "differ; "
                              "call quantlib.export.share_pre_quant_scale(model, forward_loop) after calibration (one scale per group, "
                              "input amax recalibrated)")


def check_items(items: list[Item], packer: Packer, layout: ModelLayout, *, unify_siblings: bool = False, tp: int = 1, version: str = "",
                what: str = "the model") -> Plan:
    """Check the items of a walk (the plan of :func:`make_plan`, or a Megatron model's gathered items)."""
    quantized = [it for it in items if it.spec is not None]
    if not quantized:
        raise ExportError(f"no enabled weight quantizer in {what}: nothing to export in {packer.fmt.value}")
    first = quantized[0]
    # specs are frozen and a model's quantizers share a few spec objects: what depends on the specs alone
    # is asked again only where they are other objects than the previous item's
    spec = inp = shares = None
    for it in quantized:
        if it.spec is not spec or it.input_spec is not inp:
            spec, inp = it.spec, it.input_spec
            shares = packer.shares_global(spec, inp)
        it.group = layout.group_of(_module(it), it.leaf) if shares else None
    # every amax value the checks need in one read; the per-item check (one read each) only runs to name a bad one
    finite, read = read_amax(quantized, _grouped(quantized))
    if not finite and any(it.parts for it in quantized):  # a stacked item checks expert 0's amax: make_plan names the expert
        raise ExportError(f"{what}: an expert's weight amax is not finite; recalibrate")
    passed: set = set()
    first_chain = first.chain and first.chain[0]
    scheme = _key(first.spec), _key(first.input_spec), _key(first_chain)
    mixed = packer.mixed
    for it in quantized:
        for one in _part_views(it, layout) if it.parts else (it,):
            _check_item(one, packer, tp, finite_known=finite, passed=passed)
        # the same spec objects: the same scheme (a model's quantizers share one spec object)
        chain = it.chain and it.chain[0]
        other = it.spec is not first.spec or it.input_spec is not first.input_spec or chain is not first_chain
        if not mixed and other and (_key(it.spec), _key(it.input_spec), _key(chain)) != scheme:
            raise ExportError(f"{it.where}: weight {describe(it.spec)} / input {describe(it.input_spec)} differs from {first.where}: "
                              f"weight {describe(first.spec)} / input {describe(first.input_spec)}; one export of this format carries one "
                              "scheme (format ct_mixed carries several)")
    unified = _unify(quantized, unify_siblings, read)
    ignore = [it.name for it in items if it.spec is None and ("weight" in it.extras)]
    per_tensor = first.amax is not None and first.spec.block is None and first.amax.numel() == 1
    info = ConfigInfo(first.spec, first.input_spec, per_tensor, ignore, version, schemes=_schemes(quantized))
    return Plan(items, info, unified)


def _schemes(quantized: list[Item]) -> tuple[Scheme, ...]:
    """The export's schemes (weight and input spec, one amax per tensor or not) and their modules, in order."""
    by: dict[tuple, list[Item]] = {}
    spec = inp = keys = last = None
    for it in quantized:
        per_tensor = it.amax is not None and it.spec.block is None and it.amax.numel() == 1
        if it.spec is not spec or it.input_spec is not inp or per_tensor != keys[2]:  # else the previous item's scheme
            spec, inp = it.spec, it.input_spec
            keys = (_key(spec), _key(inp), per_tensor)
            last = by.setdefault(keys, [])
        last.append(it)
    return tuple(Scheme(m[0].spec, m[0].input_spec, k[2], tuple(dict.fromkeys(i.name for i in m)),
                        tuple(i.name for i in m if i.role == "expert")) for k, m in by.items())


@functools.lru_cache(maxsize=256)  # specs are frozen and few: a model's linears share a handful
def _key(spec: Optional[FormatSpec]) -> Optional[tuple]:
    return None if spec is None else (spec.kind, spec.num_bits, spec.element, spec.unsigned, spec.block, spec.dynamic, spec.pow2)

