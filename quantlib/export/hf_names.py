"""Checkpoint names as transformers' own ``save_pretrained`` writes them, read from transformers itself.

transformers 5 loads checkpoints through a per-family conversion mapping (Mixtral's
``block_sparse_moe.experts.{e}.w1`` / ``w3`` merged into ``mlp.experts.gate_up_proj``, Qwen's
``mlp.experts.{e}.gate_proj`` ...) and ``save_pretrained`` reverts it. quantlib runs that very revert
on a probe: every tensor replaced by a small float64 tensor of unique ids (a fused-experts parameter's
ids count expert and group of rows along its output axis). The probe's output keys are the
checkpoint's names, and its ids say which module, expert and rows each one holds: no table of names is
kept here. Ids start at 1, so a value transformers adds on save (padding, zeros) is told from every tensor.
"""

from __future__ import annotations

import bisect
import math
import weakref
from typing import Optional

import torch
from torch import nn

from .modules import ModuleWalk
from .types import ExportError

_CACHE: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model -> (probe signature, names)
#: the value of :attr:`~quantlib.export.layouts.ModelLayout.experts` for a projection that the checkpoint
#: keeps fused (3-D)
STORED_FUSED = "stored_fused"


def _expert_axis(module: nn.Module, t: torch.Tensor) -> Optional[int]:
    """The output-row axis of a fused-experts parameter of ``module`` (None: not one)."""
    if t.dim() != 3 or getattr(module, "num_experts", None) != t.shape[0]:
        return None
    # transformers' use_experts_implementation flag: slices stored (in, out)
    return 2 if getattr(module, "is_transposed", False) else 1


def _coarse(rows: int) -> int:
    """Rows per probe id: the largest power of two leaving at least 8 ids (transformers' expert
    conversions cut rows into a few equal parts, which the coarse ids still show)."""
    g = 1
    while rows % (2 * g) == 0 and rows // (2 * g) >= 8:
        g *= 2
    return g


def _sources(owners: list[tuple[str, nn.Module, dict[str, torch.Tensor]]]) -> list[tuple[int, str, str, str, tuple, tuple[int, ...]]]:
    """What the probe holds, without its tensors: (start id, key, module, tensor name, (experts, ids per
    expert, rows per id) or (), probe shape) per tensor of ``owners`` (:attr:`ModuleWalk.owners`): a
    fused-experts parameter gets ids per expert and row group, any other tensor ids in the shape :data:`_PLAIN` gives."""
    sources, start = [], 1  # 0 stands for no tensor of the model (a save step's padding)
    for mname, module, direct in owners:
        for pname, t in direct.items():
            key = f"{mname}.{pname}" if mname else pname
            shape = _probe_shape(module, t)
            if type(shape) is tuple:
                axis = _expert_axis(module, t)
                info = (t.shape[0], shape[axis], _coarse(t.shape[axis]))
            else:
                info, shape = (), _PLAIN[shape]
            sources.append((start, key, mname, pname, info, shape))
            start += math.prod(shape)
    return sources


#: the probe shape of a tensor of d axes that is no fused-experts parameter: a size per axis, so a transpose or reshape
#: on save shows, and 60 rows, so a save that chunks it in 2, 3, 4, 5 or 6 (q / k / v, gate / up) gives every part
_PLAIN = {d: (60, 2, 3, 4, 5)[:d] for d in range(6)}


def _probe_shape(module: nn.Module, t: torch.Tensor) -> "int | tuple[int, int, int]":
    """The probe shape of a fused-experts parameter ``t`` of ``module`` ([experts, ids, 1] or [experts, 1, ids]
    along its output rows), or the number of dims of any other tensor."""
    d = t.dim()
    if d != 3:
        return d
    axis = _expert_axis(module, t)
    if axis is None:
        return d
    shape = [t.shape[0], 1, 1]
    shape[axis] = t.shape[axis] // _coarse(t.shape[axis])
    return tuple(shape)


def _signature(owners: list[tuple[str, nn.Module, dict[str, torch.Tensor]]]) -> list:
    """What the names depend on: every module, tensor name and probe shape (module names followed by
    their tensors' (name, shape) pairs; a module name is the string followed by a string)."""
    sig: list = []
    append = sig.append
    for mname, module, direct in owners:
        append(mname)
        for pname, t in direct.items():
            append(pname)
            d = t.ndim
            # only 3-D tensors may be fused experts; a save may cut one in a key per row (_as_saved): its size counts
            append(d if d != 3 else (_probe_shape(module, t), tuple(t.shape)))
    return sig


def _probe(sources: list) -> dict[str, torch.Tensor]:
    """The probe state dict of :func:`_sources`: each tensor's ids, in float64 (exact up to 2^53)."""
    f64 = torch.float64
    return {key: torch.arange(start, start + math.prod(shape), dtype=f64).reshape(shape) for start, key, _, _, _, shape in sources}


Names = tuple[dict[str, str], dict[str, dict[str, object]], dict[str, str], dict[str, tuple[tuple[str, ...], str]]]


def transformers_names(model: nn.Module, walk: Optional[ModuleWalk] = None) -> Names:
    """(module renames, fused-experts parts, tensor renames, keys built on save) of a transformers model, as its
    ``save_pretrained`` writes it: see :attr:`~quantlib.export.layouts.ModelLayout.renames` / ``experts`` / ``tensors`` /
    ``built``. ``walk``: the model's :class:`ModuleWalk`, when the caller has one."""
    if walk is not None and walk.names is not None:  # layout_for and make_plan of one export share a walk
        return walk.names
    walk = ModuleWalk(model) if walk is None else walk
    walk.names = names = _names(model, walk.owners)
    return names


def _names(model: nn.Module, owners: list[tuple[str, nn.Module, dict[str, torch.Tensor]]]) -> Names:
    try:
        from transformers.core_model_loading import revert_weight_conversion
    except ImportError:  # transformers < 5 keeps module names as checkpoint names
        return {}, {}, {}, {}
    if not owners:
        return {}, {}, {}, {}
    signature = _signature(owners)  # cheaper than the sources: no keys built, no ids counted
    hit = _CACHE.get(model)
    if hit is not None and hit[0] == signature:  # weight sync exports the same model every step: no probe
        return hit[1]
    sources = _sources(owners)
    probe = _probe(sources)
    what = type(model).__name__
    try:
        with torch.no_grad():
            saved = revert_weight_conversion(model, dict(probe))
    except Exception as exc:  # transformers' own failure on the probe: say so rather than guess names
        raise ExportError(f"{what}: transformers' checkpoint conversion (revert_weight_conversion) failed on quantlib's name probe: "
                          f"{exc!r}") from exc
    starts = [s[0] for s in sources]
    flat = torch.cat([t.reshape(-1) for t in saved.values()]).tolist() if saved else []  # one read of the (host) probe
    renames: dict[str, str] = {}
    experts: dict[str, dict[str, object]] = {}
    tensors: dict[str, str] = {}
    built: dict[str, tuple[tuple[str, ...], str]] = {}
    plain: set[str] = set()
    placed: dict[str, dict[str, str]] = {}  # module -> tensor -> its key, for tensors saved whole
    at = 0
    for key, ids in saved.items():
        values = flat[at : at + ids.numel()]
        at += ids.numel()
        first, n = int(values[0]), len(values)
        # ids run in order within one source, so in-order ids whose ends share a source come from it alone
        ordered = values == list(range(first, first + n))
        which = sorted({bisect.bisect_right(starts, v) - 1 for v in (values if not ordered else (values[0], values[-1]))})
        if which[0] < 0 or len(which) != 1:
            which = sorted({bisect.bisect_right(starts, v) - 1 for v in values})  # every source, not the ends' alone
            held = [sources[i][1] for i in which if i >= 0]
            why = (f"transformers saves {key} from {held or 'no tensor of the model'} and values it adds on save (padding)" if which[0] < 0
                   else f"transformers saves {key} from several tensors ({held})")
            if not held or any(sources[i][4] for i in which if i >= 0):  # experts: their parts are planned per expert
                raise ExportError(f"{what}: {why}; quantlib cannot write that key")
            built[key] = (tuple(held), why)
            continue
        start, src, mname, pname, info, shape = sources[which[0]]
        local = range(first - start, first - start + n) if ordered else [int(v) - start for v in values]
        module, _, suffix = key.rpartition(".")
        if info and ids.dim() == 3:
            experts.setdefault(mname, {})[pname] = STORED_FUSED
            if not ordered or local[0] != 0 or tuple(ids.shape) != shape:  # GraniteMoE's input_linear: written unquantized only
                built[key] = ((src,), f"transformers saves {src} as {key} rearranged (3-D experts, in another order on save)")
                continue
            placed.setdefault(mname, {})[pname] = key
            plain.add(src)
        elif info:
            n, per, g = info
            e = {local[0] // per, local[-1] // per} if ordered else {v // per for v in local}
            if len(e) != 1 or suffix != "weight" or not ordered:
                raise ExportError(f"{what}: transformers saves rows of experts {sorted(e)} of {src} as {key} out of order; quantlib writes "
                                  "an expert's contiguous rows as a 2-D weight")
            r0 = local[0] % per
            parts = experts.setdefault(mname, {}).setdefault(pname, [[] for _ in range(n)])
            parts[e.pop()].append((module, r0 * g, (r0 + len(local)) * g))
        else:
            if tuple(ids.shape) != shape or not ordered:  # e.g. a router weight saved transposed: written as is, it would load wrong
                how = "split" if ids.numel() < math.prod(shape) else "transposed or reshaped"
                built[key] = ((src,), f"transformers saves {src} as {key} rearranged ({how} on save)")
                continue
            placed.setdefault(mname, {})[pname] = key
            plain.add(src)
    _place(placed, renames, tensors)
    built = _as_saved(model, owners, built)
    twice = plain.intersection(x for srcs, _ in built.values() for x in srcs)
    if twice:  # the walk writes a tensor once, under one key
        raise ExportError(f"{what}: transformers saves {sorted(twice)[0]} under its own key and within another; quantlib cannot write both")
    for projs in experts.values():
        for parts in projs.values():
            if isinstance(parts, list):
                for e_parts in parts:
                    e_parts.sort(key=lambda p: p[1])
    _CACHE[model] = (signature, (renames, experts, tensors, built))
    return renames, experts, tensors, built


def _as_saved(model: nn.Module, owners: list, built: dict[str, tuple[tuple[str, ...], str]]) -> dict[str, tuple[tuple[str, ...], str]]:
    """``built`` with the keys the save makes of the model's own shapes: the probe's sizes are not the model's, and a save
    that cuts a tensor in a key per row (LongCat's experts on transformers 5.19, not taken for experts: its zero experts
    count in ``num_experts``) makes as many keys as the probe has rows. The conversion runs again on meta tensors of the
    real shapes, one group of sources at a time."""
    if not built:
        return built
    from transformers.core_model_loading import revert_weight_conversion

    real = {f"{m}.{k}" if m else k: t for m, _, direct in owners for k, t in direct.items()}
    groups: dict[tuple[str, ...], list[tuple[str, str]]] = {}
    for key, (srcs, why) in built.items():
        groups.setdefault(srcs, []).append((key, why))
    out = {}
    for srcs, keys in groups.items():
        try:
            with torch.no_grad():
                made = revert_weight_conversion(model, {s: torch.empty(real[s].shape, dtype=real[s].dtype, device="meta") for s in srcs})
        except Exception:  # noqa: BLE001 - a conversion that reads values: the probe's keys stand, and the builder checks them
            made = None
        if made is None or set(made) == {k for k, _ in keys}:
            out.update((k, (srcs, why)) for k, why in keys)
            continue
        key0, why0 = keys[0]
        out.update((k, (srcs, why0.replace(key0, k))) for k in made)
    return out


def _place(placed: dict[str, dict[str, str]], renames: dict[str, str], tensors: dict[str, str]) -> None:
    """Splits the keys of tensors saved whole into module renames and tensor renames: a module's home is where its weight
    goes (else where most of its tensors keep their own name, its own name first); a tensor saved anywhere else, or under
    another name, is a tensor rename (Laguna saves its router's bias under the experts module, its weight in place)."""
    for mname, keys in placed.items():
        split = {p: k.rpartition(".") for p, k in keys.items()}
        kept = [m for p, (m, _, suffix) in split.items() if suffix == p]
        if "weight" in split and split["weight"][2] == "weight":
            home = split["weight"][0]
        elif mname in kept or not kept:
            home = mname
        else:
            home = max(kept, key=kept.count)
        if home != mname:
            renames[mname] = home
        for p, (m, _, suffix) in split.items():
            if m != home or suffix != p:
                tensors[f"{mname}.{p}" if mname else p] = keys[p]
