"""The one amax sync routine (docs/design.md §5).

:func:`sync_amax` is the only routine that communicates: after calibration it makes every rank hold the
amax its layout demands (a :class:`~quantlib.parallel_state.ParallelState`, whose module docstring states
the layout conventions), or makes every rank raise the same :class:`AmaxSyncError`; no rank is left
waiting in a collective.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterator, Optional

import torch
import torch.distributed as dist
from torch import nn

from .collectives import agreement, all_gather_objects, all_reduce, device_for, pack_by_slot, slot, structure_digest
from .errors import ConfigError
from .nn.containers import GroupedQuantizer, QuantizerContainer
from .nn.quant_module import QuantModule
from .nn.tensor_quantizer import CalibrationError, TensorQuantizer
from .parallel_state import (  # noqa: F401  (re-exported)
    GROUP_NAMES,
    PARALLEL_ROLES,
    LayoutError,
    ParallelState,
    ProcessGroup,
    discover_parallel_state,
    tp_shard_dim,
)
from .traversal import applied_config, expert_group_key, iter_quantizers, quant_modules

_CPU = torch.device("cpu")
_ROW_BYTES = 1024  # per-rank room for the error report exchanged when something is wrong


class AmaxSyncError(CalibrationError):
    """Raised by :func:`sync_amax` with the same message on every rank: it names the quantizers and the
    ranks at fault. When it is raised the sync has changed no amax on any rank."""


# ---------------------------------------------------------------------------------- what syncs where


def _kind(module: Optional[nn.Module], attr: str) -> str:
    if isinstance(module, QuantModule) and attr in module.weight_quantizer_names:
        return "weight"
    if attr.endswith("input_quantizer"):
        return "input"
    if attr.endswith("output_quantizer"):
        return "output"
    return "other"


def _tp_reduces(leaf: TensorQuantizer, module: Optional[nn.Module], attr: str, kind: str, tp_size: int, name: str) -> bool:
    """Whether the amax of ``leaf`` (quantizer ``attr`` of ``module``) is MAX-reduced across the
    tensor-parallel ranks: exactly where :func:`tp_shard_dim` finds no sharded dim (the amax does not
    keep the split axis, or one block spans all of it). Raises :class:`LayoutError` where blocks
    straddle the shards."""
    if not isinstance(module, QuantModule):
        return True
    split, extent = module.tp_split(attr)
    if split is None:
        return True
    amax = leaf.amax
    if amax is not None:
        ndim = amax.dim()
    elif kind == "weight":
        ndim = 2
    elif not leaf.spec.per_tensor_amax(leaf.axis):
        return False  # an amax of unknown rank (no tokens here): what the calibrated ranks find decides
    else:
        ndim = 0
    return tp_shard_dim(leaf.spec, leaf.axis, ndim, split, extent, tp_size, name) is None


def _per_tensor(leaf: TensorQuantizer) -> bool:
    return leaf.spec.per_tensor_amax(leaf.axis)


@dataclass
class _Unit:
    """One amax to sync: a quantizer's own, or one shared by the experts of a layer (``layer``)."""

    name: str  # for messages (this rank's names)
    ident: str  # rank-independent identity, for the structure hash
    layer: bool
    kind: str
    is_expert: bool
    attr: str  # the quantizer's attribute on its module (what QuantModule.tp_split is asked about)
    members: list[tuple[str, TensorQuantizer, nn.Module]] = field(default_factory=list)
    groups: dict[str, tuple[str, ...]] = field(default_factory=dict)  # group -> slot groups
    fill: bool = False  # members without an amax take the result (expert_input_policy="max_of_peers")
    have: bool = False  # some member holds an amax on this rank
    shape: Optional[tuple[int, ...]] = None
    value: Optional[torch.Tensor] = None  # flat fp32 working copy; None: unusable on this rank
    device: torch.device = _CPU

    def describe(self, spec_reprs: dict) -> str:
        leaf = self.members[0][1]
        spec = spec_reprs.get(leaf.spec) or spec_reprs.setdefault(leaf.spec, repr(leaf.spec))
        groups = ";".join(f"{g}:{','.join(s)}" for g, s in sorted(self.groups.items()))
        return f"{self.ident}|{self.kind}|{self.layer}|{self.is_expert}|{spec}|{leaf.axis}|{groups}"


def _walk(name: str, q: nn.Module, key: str) -> Iterator[tuple[str, str, TensorQuantizer]]:
    """(leaf name, key suffix, leaf): members of a GroupedQuantizer (one per expert) get ``*`` in the
    key, members of a chain keep their index."""
    if isinstance(q, TensorQuantizer):
        yield name, key, q
    elif isinstance(q, GroupedQuantizer):
        for i, m in enumerate(q):
            yield from _walk(f"{name}.{i}", m, f"{key}.*")
    elif isinstance(q, QuantizerContainer):
        for i, m in enumerate(q.members()):
            yield from _walk(f"{name}.{i}", m, f"{key}.{i}")


def _layer_base(module: QuantModule, module_name: str) -> str:
    """Name shared by the experts of one layer: a module holding grouped weights is all its layer's
    local experts; otherwise the expert index is the last numeric component of the module name."""
    if any(isinstance(getattr(module, n, None), GroupedQuantizer) for n in module.weight_quantizer_names):
        return module_name
    return expert_group_key(module_name) or module_name


def _require_experts(model: nn.Module) -> None:
    """``sync_expert_weight_amax=True`` on a model with no expert module quantlib recognizes would change nothing:
    refused, naming the modules that look like experts (e.g. an ``nn.ModuleList`` of ``nn.Linear`` experts)."""
    modules = list(quant_modules(model))
    if any(m.is_expert for _, m in modules):
        return
    like = [n for n, _ in modules if "expert" in n and expert_group_key(n)]
    hint = f"; {len(like)} module(s) named like experts are plain linears to quantlib: {like[:3]}" if like else ""
    raise ConfigError(f"sync_expert_weight_amax=True: no module of {type(model).__name__} is an expert quantlib recognizes (fused "
                      f"Hugging Face experts, Megatron-Core experts), so no expert weights would share an amax{hint}; set it False")


def _collect(model: nn.Module, sync_expert_weights: bool) -> list[_Unit]:
    """The units to sync, in model order (the same order on every rank of a structure)."""
    units: list[_Unit] = []
    layers: dict[str, _Unit] = {}
    ordinals: dict[str, int] = {}
    bases: dict[int, str] = {}
    for full, parent, attr, q in iter_quantizers(model):
        module_name = full.rsplit(".", 1)[0] if "." in full else ""
        qm = parent if isinstance(parent, QuantModule) else None
        kind = _kind(qm, attr)
        is_expert = bool(qm is not None and qm.is_expert)
        if is_expert and id(qm) not in bases:
            bases[id(qm)] = _layer_base(qm, module_name)
        base = bases[id(qm)] if is_expert else ""
        for leaf_name, suffix, leaf in _walk(full, q, ""):
            if not (leaf.is_enabled and leaf.needs_calibration):
                continue
            key = f"{base}.{attr}{suffix}"
            if is_expert and (kind != "weight" or sync_expert_weights):
                unit = layers.get(key)
                if unit is None:
                    unit = layers[key] = _Unit(key, key, True, kind, True, attr)
                    units.append(unit)
            else:
                ident = leaf_name
                if is_expert:  # per-expert weight: identity by layer and local position, not by name
                    ordinals[key] = ordinals.get(key, -1) + 1
                    ident = f"{key}#{ordinals[key]}"
                unit = _Unit(leaf_name, ident, False, kind, is_expert, attr)
                units.append(unit)
            unit.members.append((leaf_name, leaf, parent))
    return units


def _assign_groups(unit: _Unit, state: ParallelState, problems: list[str]) -> None:
    """The groups ``unit`` is MAX-reduced over (see :func:`sync_amax`), with the slot groups of data."""
    layouts = set()
    tensor = "expert_tensor" if unit.is_expert else "tensor"
    tp_size = state.size(tensor)
    calibrated = [m for m in unit.members if m[1].amax is not None] or unit.members  # amax rank decides
    for name, leaf, parent in calibrated:
        role = getattr(parent, "parallel_role", "replicated") if isinstance(parent, QuantModule) else "replicated"
        reduces = True
        if role not in PARALLEL_ROLES:
            problems.append(f"{name}: parallel_role {role!r} is not one of {PARALLEL_ROLES}")
        else:
            try:
                reduces = _tp_reduces(leaf, parent, unit.attr, unit.kind, tp_size, name)
            except LayoutError as e:
                problems.append(str(e))
        layouts.add((reduces, leaf.spec, leaf.axis))
    if len(layouts) > 1:
        problems.append(f"{unit.name}: the experts of this layer differ in format or parallel role")
    tp = next(iter(layouts))[0]
    slots: tuple[str, ...] = ()
    if unit.is_expert and not unit.layer:
        slots += ("expert",)  # per-expert amax: only the replicas of this expert meet in data
    if unit.is_expert and not tp:
        slots += ("expert_tensor",)  # each expert-tensor rank owns its slice
    unit.groups = {"data": slots}
    if tp:
        unit.groups[tensor] = ()
    if unit.layer:
        unit.groups["expert"] = ()


def _prepare(unit: _Unit, policy: str, problems: list[str]) -> None:
    """Working value of ``unit`` (local MAX of its members) and the local problems it has."""
    present = []
    for name, leaf, _ in unit.members:
        amax = leaf.amax
        if amax is None:
            if not (unit.layer and unit.kind != "weight"):
                problems.append(f"{name}: no amax (calibration never reached it, or it was reset)")
            elif policy == "error":
                problems.append(f"{name}: no tokens reached this expert (expert_input_policy='error')")
            continue
        if amax.device.type == "meta":
            problems.append(f"{name}: amax is on the meta device")
            continue
        if present and amax.shape != present[0].shape:
            problems.append(
                f"{name}: amax shape {tuple(amax.shape)} differs from {tuple(present[0].shape)} of the other experts of its layer"
            )
            continue
        present.append(amax)
    unit.fill = unit.layer and unit.kind != "weight" and policy == "max_of_peers"
    unit.have = bool(present)
    if present:
        unit.device = present[0].device
    else:
        params = [p for _, _, parent in unit.members for p in parent.parameters(recurse=False)][:1]
        unit.device = params[0].device if params else torch.device("cpu")
    if present:
        unit.shape = tuple(present[0].shape)
        value = present[0] if len(present) == 1 else torch.stack(present).amax(dim=0)
        value = value.detach().reshape(-1)
        unit.value = value if value.dtype == torch.float32 else value.float()
    elif unit.layer and unit.kind != "weight" and _per_tensor(unit.members[0][1]):
        unit.shape = ()  # no local expert saw tokens: the layer's amax comes from the other ranks
        unit.value = torch.zeros(1, dtype=torch.float32, device=unit.device)
    elif unit.layer and unit.kind != "weight" and policy != "error":
        problems.append(
            f"{unit.name}: no expert of this layer received tokens on this rank and its amax is not per tensor, "
            "so it cannot be taken from the other ranks"
        )


def _nonfinite(units: list[_Unit], problems: list[str]) -> None:
    """Name the units whose amax hold NaN/Inf (one batched check; the per-unit scan only on failure)."""
    values = [u.value for u in units if u.value is not None]
    if not values or bool(torch.isfinite(torch.cat([v.to(values[0].device) for v in values])).all()):
        return
    for u in units:
        if u.value is not None and not bool(torch.isfinite(u.value).all()):
            bad = "NaN" if bool(torch.isnan(u.value).any()) else "Inf"
            names = [n for n, leaf, _ in u.members if leaf.amax is not None and not bool(torch.isfinite(leaf.amax).all())]
            problems.append(f"{', '.join(names[:3]) or u.name}: amax holds {bad}")
            u.value = None


# ---------------------------------------------------------------------------------- collectives


class _Comm:
    """The active groups (more than one rank) in :data:`GROUP_NAMES` order, and their devices."""

    def __init__(self, state: ParallelState, preferred: torch.device) -> None:
        self.state = state
        self.sizes = {n: state.size(n) for n in GROUP_NAMES}
        self.active = [n for n in GROUP_NAMES if self.sizes[n] > 1]
        self.devices = {n: device_for(state.group(n), preferred) for n in self.active}
        self._slots: dict[tuple[str, ...], tuple[int, int]] = {}

    def all_reduce_max(self, name: str, t: torch.Tensor) -> torch.Tensor:
        return all_reduce(t.to(self.devices[name]), "max", self.state.group(name))

    def slot(self, slot_groups: tuple[str, ...]) -> tuple[int, int]:
        """(number of slots, this rank's slot) for a payload keyed by its position in ``slot_groups``."""
        if slot_groups not in self._slots:
            self._slots[slot_groups] = slot(self.state, slot_groups)
        return self._slots[slot_groups]


def _structure_hash(units: list[_Unit], policy: str, sync_expert_weights: bool) -> int:
    spec_reprs: dict = {}
    head = f"policy={policy}|sync_expert_weight_amax={sync_expert_weights}\n"
    return structure_digest([head] + [u.describe(spec_reprs) + "\n" for u in units])


def _payload_size(comm: _Comm, units: list[_Unit], name: str) -> int:
    total = 0
    for u in units:
        if name in u.groups and u.value is not None:
            total += u.value.numel() * comm.slot(u.groups[name] if name == "data" else ())[0]
    return total


def _check(comm: _Comm, units: list[_Unit], digest: int, err: bool) -> tuple[bool, dict[str, str]]:
    """Pass A: per group, agree on the structure and sizes and spread the error flag.

    Returns the error flag as known after the pass and, per group, "" (agreed), "S" (the quantizers
    differ) or "N" (amax sizes differ)."""
    verdict = {}
    for name in comm.active:
        size = _payload_size(comm, units, name)
        same, (same_size,), (any_err,) = agreement(comm.state.group(name), digest, (size,), (err,), comm.devices[name])
        verdict[name] = "S" if not same else ("N" if not same_size else "")
        err = err or any_err or bool(verdict[name])
    return err, verdict


def _reduce(comm: _Comm, units: list[_Unit], verdict: dict[str, str], err: bool) -> tuple[bool, list[bool]]:
    """Pass B: per group, one flat fp32 all-reduce (MAX) of [error flag, have flags of the layer units,
    every amax reduced over this group]; groups whose ranks disagree on the layout send the flag only.

    A payload with slots (a per-expert amax in the data group) is written at this rank's slot, zeros
    elsewhere (amax are >= 0, so zeros never win a MAX). Updates the working values; returns the error
    flag and, per layer unit, whether any rank has it."""
    layer_units = [u for u in units if u.layer]
    have = [float(u.have) for u in layer_units]
    for name in comm.active:
        dev = comm.devices[name]
        agreed = not verdict[name]
        members = [u for u in units if name in u.groups and u.value is not None] if agreed else []
        head = torch.tensor([float(err)] + (have if agreed else []), dtype=torch.float32, device=dev)
        slots = [comm.slot(u.groups[name] if name == "data" else ()) for u in members]
        lengths = [u.value.numel() for u in members]
        buf, where = pack_by_slot(head, [u.value for u in members], slots, 0.0)
        buf = comm.all_reduce_max(name, buf)
        err = err or bool(buf[0] > 0)
        if agreed:
            have = buf[1 : head.numel()].tolist()
        for u, piece in zip(members, buf[where].split(lengths), strict=True):
            u.value = piece
    return err, [h > 0 for h in have]


_FIELDS = ("identity", "kind", "layer grouping", "expert", "format", "axis", "groups")  # of _Unit.describe


def _first_difference(comm: _Comm, name: str, units: list[_Unit], settings: tuple) -> str:
    """Error path only (the ranks of group ``name`` hold quantizers that differ): where this rank's list
    first departs from that of the lowest group rank whose list differs, naming both quantizers."""
    spec_reprs: dict = {}
    mine = (settings, [(u.name, u.describe(spec_reprs).split("|")) for u in units])
    everyone = all_gather_objects(mine, comm.state.group(name))
    ranks = comm.state.global_ranks(name)
    other = next((r for r, theirs in zip(ranks, everyone) if theirs != mine), None)
    if other is None:
        return "this rank's quantizers match every other rank's that differ from each other"
    theirs = everyone[ranks.index(other)]
    if theirs[0] != settings:
        return f"expert_input_policy / sync_expert_weight_amax {settings} here, {theirs[0]} on rank {other}"
    for i, ((n_mine, d_mine), (n_theirs, d_theirs)) in enumerate(zip(mine[1], theirs[1])):
        if d_mine != d_theirs:
            field_ = next((f for f, a, b in zip(_FIELDS, d_mine, d_theirs) if a != b), "description")
            return f"first differing quantizer (#{i}, its {field_}): {n_mine} here, {n_theirs} on rank {other}"
    i = min(len(mine[1]), len(theirs[1]))
    extra, where = (mine[1][i][0], "here only") if len(mine[1]) > i else (theirs[1][i][0], f"on rank {other} only")
    return f"first differing quantizer (#{i}): {extra} {where}"


def _encode(code: str, lines: list[str]) -> bytes:
    data = (code + "; ".join(lines)).encode()[:_ROW_BYTES]
    return data.decode(errors="ignore").encode()


def _exchange_reports(comm: _Comm, row: bytes) -> dict[int, tuple[str, str]]:
    """Error path only: every rank's report, as {global rank: (code, text)}, the same on every rank."""
    world, me = dist.get_world_size(), dist.get_rank()
    device = next(iter(comm.devices.values()))
    table = torch.zeros(world, _ROW_BYTES, dtype=torch.uint8, device=device)
    if row:
        table[me, : len(row)] = torch.tensor(list(row), dtype=torch.uint8, device=device)
    for name in comm.active:
        table = comm.all_reduce_max(name, table)
    reports = {}
    for r, bytes_ in enumerate(table.cpu().tolist()):
        text = bytes(b for b in bytes_ if b).decode(errors="ignore")
        if text:
            reports[r] = (text[0], text[1:])
    return reports


def _message(reports: dict[int, tuple[str, str]]) -> str:
    """The error every rank raises: local problems and structure differences; size differences only
    when nothing else explains them (a missing amax also changes the sizes)."""
    local = any(code == "L" for code, _ in reports.values())
    lines = [f"  rank {r}: {text}" for r, (code, text) in sorted(reports.items()) if code in "LS" or not local]
    return "quantlib.sync_amax: calibration is not consistent across ranks; the sync changed no amax on any rank:\n" + "\n".join(lines)


def _commit(units: list[_Unit]) -> None:
    """Write the results into the amax tensors (in place, so the weight cache sees the new version); a
    quantizer whose amax already equals its result is not touched (one batched comparison finds them)."""
    held, fills = [], []
    for u in units:
        if u.value is None or u.shape is None:
            continue
        for _, leaf, _ in u.members:
            current = leaf.amax
            if current is not None:
                held.append((u, leaf, current))
            elif u.fill:
                fills.append((u, leaf))
    if held:
        dev = held[0][0].value.device
        old = torch.cat([c.reshape(-1).to(dev) for _, _, c in held])
        new = torch.cat([u.value.to(dev) for u, _, _ in held])
        sizes = torch.tensor([c.numel() for _, _, c in held], device=dev)
        owner = torch.repeat_interleave(torch.arange(len(held), device=dev), sizes)
        changed = torch.zeros(len(held), device=dev).index_add_(0, owner, (old != new).float()).tolist()
        with torch.no_grad():
            for (u, leaf, current), c in zip(held, changed, strict=True):
                if not c:
                    continue
                if current.dtype == torch.float32 and tuple(current.shape) == u.shape:
                    current.copy_(u.value.reshape(u.shape))  # in place: bumps the version the weight cache keys on
                else:
                    leaf.amax = u.value.reshape(u.shape).to(current.device)
    for u, leaf in fills:
        leaf.amax = u.value.reshape(u.shape).to(u.device)


# ---------------------------------------------------------------------------------- the routine


def sync_amax(
    model: nn.Module,
    parallel_state: ParallelState,
    *,
    local_error: Optional[BaseException] = None,
    expert_input_policy: Optional[str] = None,
    sync_expert_weight_amax: Optional[bool] = None,
) -> None:
    """Make the amax of ``model`` what the parallel layout demands, on every rank, or raise on all.

    Call it on every rank of every group of ``parallel_state``, after calibration
    (:func:`quantlib.calibrate` does when given a ``parallel_state``). ``local_error`` is an error this
    rank met while calibrating (calibrate passes any exception of its forward loop): instead of raising
    alone, which would leave the other ranks waiting in a collective, the rank reports it here and every
    rank raises at once: the others an :class:`AmaxSyncError` naming the rank and its error, this rank
    the same AmaxSyncError for a CalibrationError, else its own exception (a bad batch, out of memory).

    Every enabled quantizer with a calibrated (static) amax takes part; disabled and dynamic ones (MX,
    dynamic blocks, per token) do not. It reduces with MAX (never an average):

    - ``data_group``: every amax. A per-expert amax is reduced only with the replicas of its expert
      (the data ranks at the same expert / expert-tensor position, via a payload with one slot per
      position).
    - ``tensor_group`` (``expert_tensor_group`` for expert linears, ``QuantModule.is_expert``), by
      ``QuantModule.parallel_role``: for "column" and "row" the amax that do not keep the split dim --
      per-tensor amax of weights, inputs and outputs, the NVFP4 global amax, the per-channel (axis=0)
      amax of row-parallel weights ([out, in/tp]: each rank covers a slice of each row, the MAX covers
      the row), block amax where one block spans the whole split axis (a row-parallel weight of
      in_features <= block size); never the per-channel amax of column-parallel weights nor block amax
      whose blocks lie within one shard (each rank owns those); blocks that straddle the shards are an
      error (:func:`tp_shard_dim`). "replicated" modules are identical on every tensor rank: all their amax.
    - ``expert_group``: the activation (input and output) quantizers of expert linears hold one amax
      per layer, the MAX over the layer's local and remote experts (experts of a layer are grouped by
      :func:`quantlib.model_quant.expert_group_key` of the module name; a module with GroupedQuantizer
      weights holds all local experts of its layer). Expert weight amax stay per expert unless the
      config sets ``sync_expert_weight_amax`` (then one per layer, the same way).

    ``expert_input_policy`` and ``sync_expert_weight_amax`` (None: those of the config last applied to
    the model, else the defaults) are the config's settings; calibrate passes its own.

    Missing amax follow the config's ``expert_input_policy``: an expert activation quantizer with no
    amax (no tokens) takes its layer's amax under "max_of_peers" (from local experts or, when none on
    this rank has one, from the other ranks; if no rank has one, every rank raises), stays dynamic
    under "skip", and is an error under "error". Any other missing amax, any NaN/Inf, and ranks whose
    quantizers differ (names, formats, roles, amax sizes) make every rank raise the same
    :class:`AmaxSyncError` naming the quantizers and ranks (for quantizers that differ, the first
    differing one of each rank), with no amax changed anywhere.

    Collectives, all MAX all-reduces, the same sequence on every rank; for each group of more than one
    rank, in :data:`GROUP_NAMES` order: one int64 all-reduce of 5 numbers (structure hash, payload
    size, error flag) over every group, then one flat fp32 all-reduce carrying every amax of the
    group. On the error path, one more uint8 all-reduce per group carries the reports (and, where the
    quantizers differ, an ``all_gather_object`` of their descriptions finds the first difference). Tensors live on
    the amax's device (CUDA for NCCL). With no group of more than one rank it only checks and unifies
    the experts' amax locally.
    """
    cfg = applied_config(model)
    policy = expert_input_policy or (cfg.expert_input_policy if cfg is not None else "max_of_peers")
    sync_w = sync_expert_weight_amax if sync_expert_weight_amax is not None else bool(cfg is not None and cfg.sync_expert_weight_amax)
    if sync_w:
        _require_experts(model)
    problems: list[str] = []
    units = _collect(model, sync_w)
    for u in units:
        _assign_groups(u, parallel_state, problems)
        _prepare(u, policy, problems)
    _nonfinite(units, problems)
    # an error other than CalibrationError (a bad batch, out of memory) is re-raised on its own rank, after
    # the others have learnt of it; a CalibrationError becomes the AmaxSyncError every rank raises
    own = None if local_error is None or isinstance(local_error, CalibrationError) else local_error
    if local_error is not None:  # the other problems of this rank follow from it
        problems = [str(local_error) if own is None else f"{type(own).__name__} while calibrating: {own}"]
    preferred = next((u.value.device for u in units if u.value is not None), torch.device("cpu"))
    comm = _Comm(parallel_state, preferred)
    if not comm.active:
        if own is not None:
            raise own
        if problems:
            raise AmaxSyncError(_message({dist.get_rank() if dist.is_initialized() else 0: ("L", "; ".join(problems))})) from local_error
        everywhere = [u.have for u in units if u.layer]
    else:
        digest = _structure_hash(units, policy, sync_w)
        err, verdict = _check(comm, units, digest, bool(problems))
        err, everywhere = _reduce(comm, units, verdict, err)
        if err:
            lines = problems[:]
            code = "L" if problems else ""
            for name, v in verdict.items():
                if v == "S" or (v == "N" and not problems):
                    what = "the quantizers differ (names, formats or parallel roles)" if v == "S" else "amax sizes differ"
                    lines.append(f"{what} between the ranks of its {name} group {parallel_state.global_ranks(name)}")
                    if v == "S":
                        lines.append(_first_difference(comm, name, units, (policy, sync_w)))
                    code = code or ("S" if v == "S" else "N")
            row = _encode(code, lines) if lines else b""
            reports = _exchange_reports(comm, row)
            if own is not None:
                raise own
            raise AmaxSyncError(_message(reports)) from local_error
    missing = [u.name for u, anywhere in zip((u for u in units if u.layer), everywhere, strict=True) if u.fill and not anywhere]
    if missing:
        raise AmaxSyncError(
            f"quantlib.sync_amax: no expert on any rank received tokens for {len(missing)} layer quantizer(s): {missing[:5]} "
            "(expert_input_policy='max_of_peers'); feed calibration data that reaches these layers, or use expert_input_policy='skip'"
        )
    _commit(units)


__all__ = ["GROUP_NAMES", "AmaxSyncError", "LayoutError", "ParallelState", "discover_parallel_state", "sync_amax", "tp_shard_dim"]
