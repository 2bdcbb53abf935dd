"""Quantizer state: capture, atomic save, validated restore into a fresh model, schema migrations.

State (schema 6)::

    {"schema": 6, "config": <QuantizeConfig.to_dict() or None>,
     "quantizers": {full name: {"type": "tensor", "attrs": {...}, "_amax": Tensor | None,
                                "_pre_quant_scale": Tensor | None, "_bias_value": Tensor | None,
                                "_block_amax": Tensor (NVFP4 static blocks only)}
                              | {"type": "sequential" | "grouped", "members": [<member state>, ...]}}}

Everything is plain containers and tensors, so ``torch.load(weights_only=True)`` reads it. The file is
``torch.save``'s zip archive, whose records carry CRC-32 checksums that torch.load does not check:
:func:`load_state` checks them (see :func:`verify_checksums`).

Schema history: 1 allowed a grouped linear's weight quantizer (one member per GEMM / expert) to be a
single shared ``"tensor"`` entry (the anchor implementation's layout); 2 always stores it as
``"grouped"`` with one member per GEMM (:func:`migrate_v1_to_v2`); 3 adds each tensor quantizer's
``_pre_quant_scale`` (SmoothQuant / AWQ, :func:`migrate_v2_to_v3`); 4 adds ``_bias_value`` (the
calibrated bias of affine quantization, ``attrs["bias"]``, :func:`migrate_v3_to_v4`); 5 adds the
attention modules' ``p_bmm_quantizer`` (the softmax output, :func:`migrate_v4_to_v5`); 6 adds the attribute
``pass_through_bwd``, False in every older config (they clipped the straight-through gradient,
:func:`migrate_v5_to_v6`).

``_block_amax`` (the block amax of NVFP4 with static blocks, ``block_sizes`` ``"type": "static"``) is
written only for those quantizers, which no earlier schema could express, so it needs no migration:
an entry without it has none.
"""

from __future__ import annotations

import copy
import os
import zipfile
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Optional, Union

import torch
from torch import nn

from ._atomic_io import atomic_torch_save
from .config import ConfigError, QuantizeConfig, QuantizerAttributeConfig
from .formats import blocked_shape
from .kv.presets import PROBS_QUANTIZER_NAME, QKV_QUANTIZER_NAMES
from .nn.containers import GroupedQuantizer, SequentialQuantizer
from .nn.quant_module import QuantModule, QuantModuleRegistry
from .nn.tensor_quantizer import TensorQuantizer

SCHEMA_VERSION = 6


class CheckpointError(ValueError):
    """A quantizer checkpoint that cannot be restored into this model; the model is left untouched."""


@dataclass(frozen=True)
class QuantizerGroups:
    """What a migration may need to know about the model a state is restored into (old schemas did not
    record it): ``grouped`` maps the name of each grouped weight quantizer to its number of members
    (GEMMs / experts). :func:`restore_state` builds it from the model."""

    grouped: Mapping[str, int] = field(default_factory=dict)


def migrate_v1_to_v2(state: dict, layout: Optional[QuantizerGroups] = None) -> dict:
    """Schema 1 -> 2: a grouped weight quantizer saved as one shared entry (``"tensor"`` with one
    ``_amax``, or ``"sequential"``) becomes ``"grouped"`` with one copy per member, so member i of
    ``weight_quantizer`` restores ``weight_quantizer.{i}._amax`` (``restore(...,
    recalibrate_experts=True)`` recalibrates them from each expert's own weight instead).

    Schema 1 did not record which quantizers are grouped nor how many GEMMs they have: ``layout`` says
    so (``restore`` passes the model's). Without it shared entries cannot be told from plain ones and
    are left as they are; restoring such a state into a grouped module then raises CheckpointError.
    ``state`` is not modified.
    """
    grouped = dict(layout.grouped) if layout is not None else {}
    quantizers = {}
    for name, qstate in state["quantizers"].items():
        num = grouped.get(name)
        if num is not None and isinstance(qstate, dict) and qstate.get("type") in ("tensor", "sequential"):
            qstate = {"type": "grouped", "members": [copy.deepcopy(qstate) for _ in range(num)]}
        quantizers[name] = qstate
    return {**state, "schema": 2, "quantizers": quantizers}


def _each_tensor_entry(qstate: Any, fn: Callable[[dict], dict]) -> Any:
    """``qstate`` with ``fn`` applied to every tensor quantizer entry, members of containers included."""
    if not isinstance(qstate, dict):
        return qstate  # malformed: left for restore to refuse by name
    if qstate.get("type") == "tensor":
        return fn(qstate)
    if isinstance(qstate.get("members"), list):
        return {**qstate, "members": [_each_tensor_entry(m, fn) for m in qstate["members"]]}
    return qstate


def _with_entry(qstate: Any, key: str) -> Any:
    """``qstate`` with ``key`` (None where absent) in every tensor quantizer entry, members included."""
    return _each_tensor_entry(qstate, lambda entry: {**entry, key: entry.get(key)})


def migrate_v2_to_v3(state: dict, layout: Optional[QuantizerGroups] = None) -> dict:
    """Schema 2 -> 3: every tensor quantizer entry (members of containers included) gets
    ``"_pre_quant_scale": None``: schema 2 had no pre_quant_scale, so none was in use. ``layout`` is
    not needed; ``state`` is not modified."""
    return {**state, "schema": 3, "quantizers": {name: _with_entry(q, "_pre_quant_scale") for name, q in state["quantizers"].items()}}


def migrate_v3_to_v4(state: dict, layout: Optional[QuantizerGroups] = None) -> dict:
    """Schema 3 -> 4: every tensor quantizer entry gets ``"_bias_value": None``: schema 3 had no affine
    quantization (its configs could not hold a ``bias``), so no bias was in use. ``layout`` is not
    needed; ``state`` is not modified."""
    return {**state, "schema": 4, "quantizers": {name: _with_entry(q, "_bias_value") for name, q in state["quantizers"].items()}}


def migrate_v4_to_v5(state: dict, layout: Optional[QuantizerGroups] = None) -> dict:
    """Schema 4 -> 5: every attention module (one holding ``q_bmm_quantizer``, ``k_bmm_quantizer`` and
    ``v_bmm_quantizer``) gets a disabled ``p_bmm_quantizer``: schema 4 had none, so P was never
    quantized. ``layout`` is not needed; ``state`` is not modified."""
    quantizers = dict(state["quantizers"])
    for name in state["quantizers"]:
        if not name.endswith(QKV_QUANTIZER_NAMES[0]):
            continue
        prefix = name[: -len(QKV_QUANTIZER_NAMES[0])]
        if all(prefix + q in quantizers for q in QKV_QUANTIZER_NAMES) and prefix + PROBS_QUANTIZER_NAME not in quantizers:
            quantizers[prefix + PROBS_QUANTIZER_NAME] = _quantizer_state(TensorQuantizer(QuantizerAttributeConfig(enable=False)))
    return {**state, "schema": 5, "quantizers": quantizers}


def _clipped(attrs: Any) -> Any:
    """An attribute config dict (or a list of them) with ``pass_through_bwd`` False. Set, not defaulted:
    no schema-5 config could hold the field, but the entries :func:`migrate_v4_to_v5` builds with
    today's code carry today's default."""
    if isinstance(attrs, list):
        return [_clipped(a) for a in attrs]
    return {**attrs, "pass_through_bwd": False} if isinstance(attrs, dict) else attrs


def migrate_v5_to_v6(state: dict, layout: Optional[QuantizerGroups] = None) -> dict:
    """Schema 5 -> 6: every attribute config (each tensor quantizer's ``attrs`` and the saved config's
    ``quant_cfg`` entries) gets ``"pass_through_bwd": False``: schema 5 had no such field and always
    zeroed the straight-through gradient where ``|x| > amax``, which the field's default (True, as in
    ModelOpt) would no longer do. ``layout`` is not needed; ``state`` is not modified."""

    def entry(e: dict) -> dict:
        return {**e, "attrs": _clipped(e["attrs"])} if "attrs" in e else e

    config = state.get("config")
    if isinstance(config, dict) and isinstance(config.get("quant_cfg"), list):
        items = [{**item, "cfg": _clipped(item.get("cfg"))} if isinstance(item, dict) and "cfg" in item else item
                 for item in config["quant_cfg"]]
        config = {**config, "quant_cfg": items}
    return {**state, "schema": 6, "config": config, "quantizers": {name: _each_tensor_entry(q, entry)
                                                                   for name, q in state["quantizers"].items()}}


#: MIGRATIONS[v](state, layout) turns a schema-v state into a schema-(v+1) one.
MIGRATIONS: dict[int, Callable[[dict, Optional[QuantizerGroups]], dict]] = {
    1: migrate_v1_to_v2,
    2: migrate_v2_to_v3,
    3: migrate_v3_to_v4,
    4: migrate_v4_to_v5,
    5: migrate_v5_to_v6,
}


# ------------------------------------------------------------------------------------ capture


def _quantizer_state(q: nn.Module, name: Optional[str] = None) -> dict:
    """State of one quantizer (``name``: its full name for errors; None: the name it was configured with)."""
    if isinstance(q, TensorQuantizer):
        amax = q.amax_values  # on the meta device: the values a restore gave it, if any
        if amax is None and q.amax is not None:
            raise CheckpointError(
                f"{name or q._qname}: _amax is on the meta device and holds no values (calibrated on meta weights); "
                "materialise the model (to_empty + load_state_dict of its weights) and calibrate it before saving"
            )
        pqs = q.pre_quant_scale_values
        if pqs is None and q.pre_quant_scale is not None:
            raise CheckpointError(f"{name or q._qname}: _pre_quant_scale is on the meta device and holds no values; materialise and "
                                  "calibrate the model before saving")
        bias = q.bias_values
        if bias is None and q.bias_value is not None:
            raise CheckpointError(f"{name or q._qname}: _bias_value is on the meta device and holds no values; materialise and calibrate "
                                  "the model before saving")
        blocks = q.block_amax_values
        if blocks is None and q.block_amax is not None:
            raise CheckpointError(f"{name or q._qname}: _block_amax is on the meta device and holds no values; materialise and calibrate "
                                  "the model before saving")
        entry = {
            "type": "tensor",
            "attrs": q.attrs.to_dict() | {"enable": q.is_enabled},
            "_amax": None if amax is None else amax.detach().cpu().clone(),
            "_pre_quant_scale": None if pqs is None else pqs.detach().cpu().clone(),
            "_bias_value": None if bias is None else bias.detach().cpu().clone(),
        }
        if blocks is not None:
            entry["_block_amax"] = blocks.detach().cpu().clone()
        return entry
    kind = "grouped" if isinstance(q, GroupedQuantizer) else "sequential"
    return {"type": kind, "members": [_quantizer_state(m, None if name is None else f"{name}.{i}") for i, m in enumerate(q)]}


def quantizer_state(model: nn.Module) -> dict:
    """Plain dict of every quantizer's config and amax (``torch.save``-able, weights-only loadable)."""
    from .model_quant import applied_config, iter_quantizers

    cfg = applied_config(model)
    return {
        "schema": SCHEMA_VERSION,
        "config": cfg.to_dict() if isinstance(cfg, QuantizeConfig) else None,
        "quantizers": {name: _quantizer_state(q, name) for name, _, _, q in iter_quantizers(model)},
    }


def save(model: nn.Module, path: Union[str, os.PathLike]) -> None:
    """Write :func:`quantizer_state` atomically (temp file in the same folder, fsync, rename), with the
    archive's CRC-32 checksums; a symlink at ``path`` stays a link and its target gets the file."""
    state = quantizer_state(model)  # before any file exists: a model that cannot be saved leaves none
    atomic_torch_save(state, path)


# ------------------------------------------------------------------------------------ restore


def verify_checksums(path: Union[str, os.PathLike]) -> None:
    """Raise CheckpointError where a record of the file (the pickled configs, a tensor's bytes) does
    not match its CRC-32. torch.save writes one per record of its zip archive, but torch.load never
    checks them (a flipped bit restores amax 3.33 as 13.3). Files without checksums still load: the
    legacy non-zip format, and archives written with torch's ``compute_crc32`` off (every CRC zero)."""
    path = os.fspath(path)
    if not zipfile.is_zipfile(path):
        return
    try:
        with zipfile.ZipFile(path) as archive:
            records = archive.infolist()
            if all(r.CRC == 0 for r in records):
                return
            bad = archive.testzip()  # reads every record, comparing its CRC-32 to the directory's
    except (zipfile.BadZipFile, zipfile.LargeZipFile, NotImplementedError, ValueError, EOFError, OSError) as exc:
        raise CheckpointError(f"{path}: not a readable quantlib checkpoint (truncated or corrupt?): {exc}") from None
    if bad is not None:
        raise CheckpointError(f"{path}: record {bad!r} does not match its CRC-32 checksum: the file is corrupt (a changed byte or bit)")


def load_state(path: Union[str, os.PathLike]) -> dict:
    """Read a checkpoint file (weights only) after checking its checksums, or raise CheckpointError if
    it is truncated or corrupt."""
    verify_checksums(path)  # a missing file is no zip: torch.load raises FileNotFoundError below
    try:
        state = torch.load(os.fspath(path), map_location="cpu", weights_only=True)
    except FileNotFoundError:
        raise
    except Exception as exc:  # torch raises several types for truncated zip archives
        raise CheckpointError(f"{path}: not a readable quantlib checkpoint (truncated or corrupt?): {exc}") from None
    return state


def migrate(state: dict, layout: Optional[QuantizerGroups] = None) -> dict:
    """Bring ``state`` to :data:`SCHEMA_VERSION` through the named migrations, one version at a time
    (``layout``: the target model's, see :class:`QuantizerGroups`)."""
    if not isinstance(state, dict) or "schema" not in state or "quantizers" not in state:
        raise CheckpointError("not a quantlib quantizer state: expected a dict with 'schema' and 'quantizers'")
    version = state["schema"]
    if not isinstance(version, int) or version < 1:
        raise CheckpointError(f"invalid schema version {version!r}")
    if version > SCHEMA_VERSION:
        raise CheckpointError(f"checkpoint schema {version} is newer than this quantlib ({SCHEMA_VERSION}): upgrade quantlib")
    while version < SCHEMA_VERSION:
        state = MIGRATIONS[version](state, layout)
        version = state["schema"]
    return state


def _planned_quantizers(model: nn.Module) -> dict[str, tuple[nn.Module, str]]:
    """Quantizer names a conversion of ``model`` has (or would have): name -> (module, attribute)."""
    QuantModuleRegistry.find()
    plan = {}
    for mname, module in model.named_modules():
        if isinstance(module, (TensorQuantizer, SequentialQuantizer, GroupedQuantizer)):
            continue
        if isinstance(module, QuantModule) or QuantModuleRegistry.is_registered(type(module)):
            qcls = type(module) if isinstance(module, QuantModule) else QuantModuleRegistry.quantized_class(type(module))
            for qn in qcls.quantizer_names:
                plan[f"{mname}.{qn}" if mname else qn] = (module, qn)
    return plan


def _quantized_class(module: nn.Module) -> type:
    return type(module) if isinstance(module, QuantModule) else QuantModuleRegistry.quantized_class(type(module))


def _is_grouped(module: nn.Module, attr: str) -> Optional[bool]:
    """Whether quantizer ``attr`` of ``module`` is (or, once converted, will be) a GroupedQuantizer;
    None where an unconverted module's quantized class does not say (no ``grouped_quantizer_names``)."""
    if isinstance(module, QuantModule):
        return isinstance(getattr(module, attr, None), GroupedQuantizer)
    names = getattr(_quantized_class(module), "grouped_quantizer_names", None)
    return None if names is None else attr in names


def _layout(plan: dict[str, tuple[nn.Module, str]]) -> QuantizerGroups:
    grouped = {}
    for name, (module, attr) in plan.items():
        if _is_grouped(module, attr) is True:
            tensors = dict(_quantized_class(module).weight_groups(module)).get(attr)
            grouped[name] = len(tensors) if tensors is not None else len(getattr(module, attr))
    return QuantizerGroups(grouped)


def quantizer_groups(model: nn.Module) -> QuantizerGroups:
    """The :class:`QuantizerGroups` of ``model`` (fresh or converted), for :func:`migrate`."""
    return _layout(_planned_quantizers(model))


def _restore_tensor(q: TensorQuantizer, value: Any, key: str, attr: str, where: str) -> None:
    """Set ``q.<attr>`` from the checkpoint's ``key`` (absent: left alone); its setter's checks become
    CheckpointErrors naming the quantizer and the key."""
    if value is None:
        return
    if not isinstance(value, torch.Tensor):
        raise CheckpointError(f"{where}: {key} must be a tensor, got {type(value).__name__}")
    try:
        setattr(q, attr, value)
    except ValueError as exc:
        raise CheckpointError(f"{where}: invalid {key}: {exc}") from None


def _build(qstate: Any, where: str) -> nn.Module:
    """A quantizer module from its state (validating everything before the model is touched)."""
    if not isinstance(qstate, dict) or qstate.get("type") not in ("tensor", "sequential", "grouped"):
        raise CheckpointError(f"{where}: malformed quantizer state {str(qstate)[:80]!r}")
    if qstate["type"] == "tensor":
        try:
            attrs = QuantizerAttributeConfig.from_dict(qstate["attrs"])
        except (ConfigError, KeyError, TypeError) as exc:
            raise CheckpointError(f"{where}: invalid attribute config: {exc}") from None
        q = TensorQuantizer(attrs)
        q._qname = where
        amax = qstate.get("_amax")
        if amax is not None:
            _check_amax_values(amax, where)
            per_tensor = q.spec.per_tensor_amax(q.axis)
            if per_tensor and q.needs_calibration and amax.dim() != 0:
                raise CheckpointError(f"{where}: amax of shape {tuple(amax.shape)} for a per-tensor quantizer (expected ())")
            q.amax = amax
        for key, attr in (("_pre_quant_scale", "pre_quant_scale"), ("_bias_value", "bias_value"), ("_block_amax", "block_amax")):
            _restore_tensor(q, qstate.get(key), key, attr, where)
        return q
    members = [_build(m, f"{where}.{i}") for i, m in enumerate(qstate.get("members") or [])]
    if not members:
        raise CheckpointError(f"{where}: a {qstate['type']} quantizer with no members")
    try:
        return SequentialQuantizer(*members) if qstate["type"] == "sequential" else GroupedQuantizer(members)
    except TypeError as exc:
        raise CheckpointError(f"{where}: {exc}") from None


def _check_amax_values(amax: Any, where: str) -> None:
    """An amax is the max |x| of real data: a finite float >= 0. NaN and Inf would give NaN outputs,
    and a negative amax NaN or garbage, and no calibration produces them (it refuses NaN/Inf).

    Zero is accepted, for every format: calibration gives it wherever the data was all zeros (a
    pruned channel, a zero-initialised weight, a dead activation), and docs/design.md §3 defines it
    (INT groups with amax <= 2^-24 quantize to 0, which is the data; FP8 uses amax 1; NVFP4 uses
    s2 = 1): never NaN. Refusing it would refuse real checkpoints."""
    if not isinstance(amax, torch.Tensor):
        raise CheckpointError(f"{where}: _amax must be a tensor, got {type(amax).__name__}")
    if not amax.is_floating_point() or amax.is_meta:
        raise CheckpointError(f"{where}: _amax must be a floating-point tensor with values, got {amax.dtype} on {amax.device}")
    values = amax.detach().float().flatten()  # as the quantizer will hold it (a float64 1e300 is Inf)
    bad = (~torch.isfinite(values) | (values < 0)).nonzero()
    if bad.numel():
        i = int(bad[0])
        at = "" if amax.dim() == 0 else str([int(j) for j in torch.unravel_index(torch.tensor(i), amax.shape)])
        raise CheckpointError(
            f"{where}: _amax{at} = {values[i].item()} ({bad.numel()} of {values.numel()} value(s) NaN, infinite or negative): "
            "an amax is a finite max |x| >= 0"
        )


def _check_structure(name: str, q: nn.Module, module: nn.Module, attr: str) -> None:
    """A grouped quantizer restores into a grouped one and a single one into a single one."""
    expected, saved = _is_grouped(module, attr), isinstance(q, GroupedQuantizer)
    if expected is None:
        return
    if expected and not saved:
        raise CheckpointError(
            f"{name}: saved as a single quantizer, but the model's is grouped (one member per GEMM); "
            "a schema-1 shared amax migrates only with the model's layout: restore the original file with quantlib.restore"
        )
    if saved and not expected:
        raise CheckpointError(f"{name}: saved as a grouped quantizer of {len(q)} members, but the model's is a single quantizer")


def _check_weight_shapes(name: str, q: nn.Module, module: nn.Module, attr: str) -> None:
    """A weight quantizer's static amax must fit the weight it will quantize (each member its own)."""
    qcls = _quantized_class(module)
    if attr not in qcls.weight_quantizer_names:
        return
    groups = dict(qcls.weight_groups(module))
    tensors = groups.get(attr, [])
    members = list(q) if isinstance(q, GroupedQuantizer) else [q]
    if len(members) != len(tensors):
        raise CheckpointError(f"{name}: checkpoint has {len(members)} weight quantizer member(s), the module has {len(tensors)} weight(s)")
    for m, w in zip(members, tensors):
        leaves = [m] if isinstance(m, TensorQuantizer) else list(m.leaves())  # a chain keeps the weight's shape
        for leaf in leaves:
            if leaf.is_enabled:  # a disabled one never quantizes this weight: any axis is harmless
                try:
                    leaf.check_fits(tuple(w.shape))
                except ValueError as exc:
                    raise CheckpointError(str(exc)) from None
            if leaf.amax is not None:
                expected = leaf.amax_shape(tuple(w.shape))
                if tuple(leaf.amax.shape) != expected:
                    raise CheckpointError(f"{leaf._qname}: amax of shape {tuple(leaf.amax.shape)} does not fit weight {tuple(w.shape)} "
                                          f"(expected {expected})")
            if leaf.block_amax is not None and tuple(leaf.block_amax.shape) != blocked_shape(tuple(w.shape), leaf.spec.block):
                raise CheckpointError(f"{leaf._qname}: _block_amax of shape {tuple(leaf.block_amax.shape)} does not fit weight "
                                      f"{tuple(w.shape)} (expected {blocked_shape(tuple(w.shape), leaf.spec.block)})")


def _check_expert_scales(name: str, q: nn.Module, module: nn.Module, attr: str) -> None:
    """A 2-D ``_pre_quant_scale`` (one row per expert) belongs to a fused-experts module's input
    quantizer and has one row per expert, one column per input channel of that projection."""
    leaves = [q] if isinstance(q, TensorQuantizer) else list(q.leaves())
    table = next((leaf.pre_quant_scale for leaf in leaves if leaf.pre_quant_scale is not None and leaf.pre_quant_scale.dim() == 2), None)
    if table is None:
        return
    qcls = _quantized_class(module)
    projections = getattr(qcls, "projections", ()) if callable(getattr(qcls, "expert_gemm", None)) else ()
    proj = next((p for p in projections if attr == f"{p}_input_quantizer"), None)
    if proj is None or not isinstance(q, TensorQuantizer):
        raise CheckpointError(f"{name}: a per-expert (2-D) _pre_quant_scale of shape {tuple(table.shape)} belongs only to a fused-experts "
                              "module's input quantizer")
    expected = (module.num_experts, qcls.expert_gemm(module, proj, 0)[0].shape[1])
    if tuple(table.shape) != expected:
        raise CheckpointError(f"{name}: _pre_quant_scale of shape {tuple(table.shape)} does not fit {proj} (expected (experts, in) = "
                              f"{expected})")


def _wrapper_hint(missing: list[str], unexpected: list[str]) -> str:
    """Say so where the two sides' names differ by one leading prefix: a wrapper module on one side only."""
    for longer, shorter, whose in ((unexpected, missing, "checkpoint"), (missing, unexpected, "model")):
        if longer and len(longer) == len(shorter) and longer[0].endswith("." + shorter[0]):
            extra = longer[0][: -len(shorter[0])]
            if all(a == extra + b for a, b in zip(longer, shorter)):  # (a common prefix keeps the sorted order)
                return (
                    f"; the {whose}'s names all carry the extra prefix {extra!r}: one side is wrapped in another module "
                    "(Megatron's Float16Module, a DistributedDataParallel) and the other is not: restore into a model wrapped the same way"
                )
    return ""


def restore_state(model: nn.Module, state: dict, strict: bool = True, recalibrate_experts: bool = False) -> nn.Module:
    """Restore quantizers from ``state`` into ``model`` (fresh or already quantized). Everything is
    validated first: on any mismatch CheckpointError is raised and the model is unchanged.

    Each member of a grouped weight quantizer restores its own amax; ``recalibrate_experts=True``
    recalibrates every member from its own weight instead (e.g. after migrating a schema-1 shared amax).
    """
    from .model_quant import convert, iter_quantizers, leaves_of, set_applied_config

    plan = _planned_quantizers(model)
    state = migrate(state, _layout(plan))
    saved = state["quantizers"]
    if not isinstance(saved, dict):
        raise CheckpointError("'quantizers' must be a dict")
    missing, unexpected = sorted(set(plan) - set(saved)), sorted(set(saved) - set(plan))
    if unexpected or (strict and missing):
        raise CheckpointError(
            f"checkpoint does not match the model: {len(missing)} quantizer(s) missing from it {missing[:3]}, "
            f"{len(unexpected)} unknown to the model {unexpected[:3]}{_wrapper_hint(missing, unexpected)}"
        )
    built = {name: _build(qs, name) for name, qs in saved.items()}
    for name, q in built.items():
        _check_structure(name, q, *plan[name])
        _check_weight_shapes(name, q, *plan[name])
        _check_expert_scales(name, q, *plan[name])
    try:
        config = QuantizeConfig.from_any(state["config"]) if state.get("config") else None
    except ConfigError as exc:
        raise CheckpointError(f"invalid config in the checkpoint: {exc}") from None

    model = convert(model)
    by_name = {n: (parent, attr) for n, parent, attr, _ in iter_quantizers(model)}
    for name, q in built.items():
        parent, attr = by_name[name]
        device = next((t.device for t in list(parent.parameters(recurse=False)) + list(parent.buffers(recurse=False))), None)
        setattr(parent, attr, q.to(device) if device is not None else q)
        for leaf_name, leaf in leaves_of(name, q):
            leaf._qname = leaf_name
    if config is not None:
        set_applied_config(model, config)
    if recalibrate_experts:
        _recalibrate_grouped_weights(model, set(built))
    return model


def _recalibrate_grouped_weights(model: nn.Module, names: set[str]) -> None:
    """Member i of each restored grouped weight quantizer calibrates on its own tensor i, and only
    member i is touched (never a broadcast reset over the group inside the per-member loop)."""
    from .model_quant import quant_modules

    for mname, module in quant_modules(model):
        for attr, tensors in module.weight_groups():
            q = getattr(module, attr)
            if not isinstance(q, GroupedQuantizer) or (f"{mname}.{attr}" if mname else attr) not in names:
                continue
            for member, tensor in zip(q, tensors):
                if member.is_enabled and member.needs_calibration:
                    member.calibrate(tensor)


def restore(model: nn.Module, path: Union[str, os.PathLike], strict: bool = True, recalibrate_experts: bool = False) -> nn.Module:
    """Restore a checkpoint written by :func:`save` into ``model`` (usually fresh and unquantized)."""
    return restore_state(model, load_state(path), strict=strict, recalibrate_experts=recalibrate_experts)
