"""The quantizer state of Megatron-Core layers in dist checkpoints: the layout-independent extra state
(``<layer>._quantizer_extra_state``: every quantizer's config and global amax shapes), its per-expert
pieces, and :func:`restore_quantizer_config`, which configures a fresh model at any TP/EP layout from a
checkpoint saved at any other, before ``dist_checkpointing.load`` fills the amax.

The modules whose state this is live in :mod:`quantlib.plugins.megatron` (their ``sharded_state_dict``
and state-dict hooks call the functions here); this module imports none of them.
"""

from __future__ import annotations

from contextvars import ContextVar
from typing import Any, Iterator, Optional

import torch
from megatron.core import dist_checkpointing
from megatron.core.dist_checkpointing.mapping import ShardedObject
from torch import nn

from ..checkpoint import CheckpointError, _build, _quantizer_state
from ..nn.containers import GroupedQuantizer
from ..nn.quant_module import QuantModule
from ..parallel_state import tp_shard_dim
from ..traversal import iter_leaf_quantizers, leaves_of

#: version of the quantizer state kept in ``_extra_state``
EXTRA_STATE_SCHEMA = 1
#: state-dict key (after the module prefix) of the quantizer config; a ShardedObject in dist checkpoints
EXTRA_STATE_KEY = "_quantizer_extra_state"

# While restore_quantizer_config builds model.sharded_state_dict(): id(ShardedObject) -> (module, piece)
# of every quantizer config object, so each maps back to its layer whatever its dict key says (a wrapper
# such as Float16Module delegates without adding its ``module.``: keys are not submodule paths of the model).
_EMITTED: ContextVar[Optional[dict[int, tuple[nn.Module, int]]]] = ContextVar("quantlib_megatron_emitted", default=None)


def record_extra_state_objects(module: nn.Module, objects: list[Any]) -> None:
    """Note that ``module`` emitted ``objects`` (its config ShardedObjects, piece i at i) while a
    :func:`restore_quantizer_config` collects them; does nothing otherwise."""
    emitted = _EMITTED.get()
    if emitted is not None:
        for index, obj in enumerate(objects):
            emitted[id(obj)] = (module, index)


def _local_shape(global_shape: tuple[int, ...], dim: Optional[int], tp_size: int, where: str) -> tuple[int, ...]:
    if dim is None:
        return tuple(global_shape)
    if global_shape[dim] % tp_size:
        raise CheckpointError(f"{where}: amax of global shape {tuple(global_shape)} cannot be split over TP={tp_size} along dim {dim}")
    return tuple(s // tp_size if d == dim else s for d, s in enumerate(global_shape))


def _global_shape(local_shape: tuple[int, ...], dim: Optional[int], tp_size: int) -> tuple[int, ...]:
    return tuple(s * tp_size if d == dim else s for d, s in enumerate(local_shape))


def _extra_key(key: str) -> tuple[Optional[str], int]:
    """(owner prefix, piece) of a ``<owner prefix>_quantizer_extra_state[<piece>]`` key; (None, 0) for others."""
    head, sep, tail = key.rpartition(EXTRA_STATE_KEY)
    if not sep or (tail and not tail.isdigit()) or (head and not head.endswith(".")):
        return None, 0
    return head, int(tail or 0)


def quantizer_extra_state(module: QuantModule) -> dict:
    """The layout-independent config of ``module``'s quantizers.

    ``{"quantlib_schema": 1, "quantizers": {attr: state}}``, a state being that of
    :func:`quantlib.quantizer_state` with each ``_amax`` replaced by ``amax_shape``: the global shape of
    the amax (None where there is none), and each ``_pre_quant_scale`` by ``pre_quant_scale``: its global
    shape and dtype (absent where there is none); the values of both are sharded tensors of their own.
    """
    tp_size = module._ql_tp_size()
    quantizers = {}
    for qname in module.quantizer_names:
        q = getattr(module, qname, None)
        if q is None:
            continue
        axis, extent = module.tp_split(qname)
        state = _quantizer_state(q)
        for (name, leaf), leaf_state in zip(leaves_of(qname, q), _leaf_states(state)):
            amax = leaf_state.pop("_amax")
            if leaf_state.get("_block_amax") is not None and tp_size > 1:  # ModelOpt refuses it as well
                raise CheckpointError(f"{name}: NVFP4 static block amax at tensor parallel {tp_size}: a dist checkpoint keeps it only "
                                      "without tensor parallelism")
            shape = None
            if amax is not None:
                dim = tp_shard_dim(leaf.spec, leaf.axis, amax.dim(), axis, extent, tp_size, name)
                shape = list(_global_shape(tuple(amax.shape), dim, tp_size))
            leaf_state["amax_shape"] = shape
            pqs = leaf_state.pop("_pre_quant_scale")
            if pqs is not None:  # its values travel as a sharded tensor, like the amax
                dim = pre_quant_scale_shard_dim(module.weight_quantizer_names, qname, axis)
                leaf_state["pre_quant_scale"] = {"shape": list(_global_shape(tuple(pqs.shape), dim, tp_size)),
                                                 "dtype": str(pqs.dtype).removeprefix("torch.")}
        quantizers[qname] = state
    return {"quantlib_schema": EXTRA_STATE_SCHEMA, "quantizers": quantizers}


def pre_quant_scale_shard_dim(weight_quantizer_names: tuple, qname: str, split_axis: Optional[int]) -> Optional[int]:
    """0 where TP shards a ``pre_quant_scale`` (it runs along the last dim of the tensor its quantizer
    sees: a row layer's weight columns and input), None where every TP rank holds all of it."""
    last = 1 if qname in weight_quantizer_names else -1
    return 0 if split_axis == last else None


def _pre_quant_scale_placeholder(spec: Any, local: tuple[int, ...], where: str) -> torch.Tensor:
    dtype = getattr(torch, str(spec.get("dtype")) if isinstance(spec, dict) else "", None)
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise CheckpointError(f"{where}: malformed pre_quant_scale entry {str(spec)[:80]!r} (expected {{'shape': [...], 'dtype': "
                              "'float32'})")
    return torch.full(local, float("nan"), dtype=dtype)


def _leaf_states(state: dict) -> Iterator[dict]:
    if state["type"] == "tensor":
        yield state
        return
    for m in state["members"]:
        yield from _leaf_states(m)


def split_extra_state(state: dict, num: int) -> list[dict]:
    """Per-expert pieces of a grouped module's state: piece i keeps member i of every grouped quantizer."""
    pieces = []
    for i in range(num):
        quantizers = {}
        for qname, qs in state["quantizers"].items():
            if qs["type"] == "grouped":
                if len(qs["members"]) != num:
                    raise CheckpointError(f"{qname}: {len(qs['members'])} members for {num} experts")
                qs = {"type": "grouped", "members": [qs["members"][i]]}
            quantizers[qname] = qs
        pieces.append({"quantlib_schema": state["quantlib_schema"], "quantizers": quantizers})
    return pieces


def merge_extra_states(states: list[Any]) -> Any:
    """Inverse of :func:`split_extra_state` (one state is returned as it is)."""
    if len(states) == 1:
        return states[0]
    if any(not isinstance(s, dict) or not isinstance(s.get("quantizers"), dict) for s in states):
        raise CheckpointError(
            f"per-expert quantizer states of a grouped module are not all quantlib states: {[type(s).__name__ for s in states]}"
        )
    merged = {"quantlib_schema": states[0].get("quantlib_schema"), "quantizers": {}}
    for qname, qs in states[0]["quantizers"].items():
        if qs.get("type") == "grouped":
            qs = {"type": "grouped", "members": [m for s in states for m in s["quantizers"][qname]["members"]]}
        merged["quantizers"][qname] = qs
    return merged


def apply_quantizer_extra_state(module: QuantModule, state: Any) -> None:
    """Rebuild ``module``'s quantizers from a :func:`quantizer_extra_state` (saved at any layout), with
    NaN amax placeholders of this layout's local shapes for the checkpoint's amax to load into (an
    amax that never loads stays NaN, which the sync and the forward refuse)."""
    kind = type(module).__name__
    if not isinstance(state, dict) or not isinstance(state.get("quantizers"), dict):
        raise CheckpointError(f"{kind}: not a quantlib quantizer state: {str(state)[:80]!r}")
    if state.get("quantlib_schema") != EXTRA_STATE_SCHEMA:
        raise CheckpointError(f"{kind}: quantizer state schema {state.get('quantlib_schema')!r}, expected {EXTRA_STATE_SCHEMA}")
    unknown = set(state["quantizers"]) - set(module.quantizer_names)
    if unknown:
        raise CheckpointError(f"{kind}: the checkpoint has quantizers {sorted(unknown)} this module does not have")
    tp_size = module._ql_tp_size()
    weights = dict(module.weight_groups())
    built = {}
    for qname, qstate in state["quantizers"].items():
        q = _build(qstate, qname)
        base = _full_name(getattr(module, qname, None), qname)
        axis, extent = module.tp_split(qname)
        tensors = weights.get(qname)
        if tensors is not None and isinstance(q, GroupedQuantizer) and len(q) != len(tensors):
            raise CheckpointError(f"{kind}.{qname}: the checkpoint has {len(q)} members for {len(tensors)} weights")
        for (name, leaf), leaf_state in zip(leaves_of(qname, q), _leaf_states(qstate)):
            shape = leaf_state.get("amax_shape")
            if shape is not None:
                dim = tp_shard_dim(leaf.spec, leaf.axis, len(shape), axis, extent, tp_size, name)
                local = _local_shape(tuple(shape), dim, tp_size, name)
                if tensors:
                    weight = tensors[int(name.split(".")[1]) if isinstance(q, GroupedQuantizer) else 0]
                    expected = tuple(leaf.amax_shape(tuple(weight.shape)))
                    if local != expected:
                        raise CheckpointError(
                            f"{kind}.{name}: the checkpoint's amax (local shape {local}) does not fit "
                            f"weight {tuple(weight.shape)} (expected {expected})"
                        )
                leaf.amax = torch.full(local, float("nan"))
            pqs = leaf_state.get("pre_quant_scale")
            if pqs is not None:
                shape = pqs.get("shape") if isinstance(pqs, dict) else None
                if not isinstance(shape, list) or len(shape) != 1:
                    raise CheckpointError(f"{kind}.{name}: malformed pre_quant_scale entry {str(pqs)[:80]!r} (expected a 1-D shape)")
                dim = pre_quant_scale_shard_dim(module.weight_quantizer_names, qname, axis)
                local = _local_shape(tuple(shape), dim, tp_size, name)
                # NaN until dist_checkpointing.load fills it (a strict load_state_dict refuses a missing one)
                leaf._set_kept_buffer("_pre_quant_scale", _pre_quant_scale_placeholder(pqs, local, f"{kind}.{name}"))
            leaf._qname = base + name[len(qname) :]
        built[qname] = q
    device = next((t.device for t in list(module.parameters(recurse=False)) + list(module.buffers(recurse=False))), None)
    for qname, q in built.items():
        setattr(module, qname, q.to(device) if device is not None else q)


def _full_name(old: Optional[nn.Module], qname: str) -> str:
    """The full model name of quantizer ``qname`` as the old quantizer knew it (else ``qname``)."""
    if old is None:
        return qname
    first = next(iter(old.leaves())) if hasattr(old, "leaves") else old
    name = getattr(first, "_qname", "")
    cut = name.rfind("." + qname)
    return name[: cut + 1 + len(qname)] if cut >= 0 else qname


def unwrap_megatron(model: nn.Module) -> nn.Module:
    """The model inside Megatron's training wrappers (Float16Module, Megatron's DDP / FSDP, torch's DDP), as
    Megatron-LM unwraps it before ``sharded_state_dict()``: the keys its checkpoints hold are the inner model's."""
    from megatron.core.transformer.module import Float16Module

    wrappers: tuple[type, ...] = (Float16Module, nn.parallel.DistributedDataParallel)
    try:
        from megatron.core.distributed.data_parallel_base import _BaseDataParallel  # Megatron's DDP and FSDP

        wrappers += (_BaseDataParallel,)
    except ImportError:  # releases before their common base
        from megatron.core.distributed import DistributedDataParallel

        wrappers += (DistributedDataParallel,)
    while isinstance(model, wrappers):
        model = model.module
    return model


def restore_quantizer_config(model: nn.Module, checkpoint_dir: str) -> nn.Module:
    """Convert ``model`` (fresh, at any TP/EP layout) and configure its quantizers from a Megatron dist
    checkpoint saved at any layout, with amax placeholders for ``dist_checkpointing.load`` to fill.

    Then ``model.load_state_dict(dist_checkpointing.load(model.sharded_state_dict(), checkpoint_dir))``
    restores the weights and the amax. Collective: every rank calls it. Layers the checkpoint holds no
    quantizer state for keep the quantizers conversion gave them. ``model`` may be wrapped (Float16Module,
    DistributedDataParallel): the checkpoint holds the keys of the model inside (:func:`unwrap_megatron`).
    """
    from ..model_quant import convert  # quantize() -> plugins -> this module: imported when called

    if not callable(getattr(unwrap_megatron(model), "sharded_state_dict", None)):
        raise CheckpointError(f"restore_quantizer_config: {type(model).__name__} has no sharded_state_dict(); pass the Megatron model (or "
                              "its Megatron wrapper)")
    model = convert(model)
    emitted: dict[int, tuple[nn.Module, int]] = {}
    token = _EMITTED.set(emitted)
    try:  # Megatron's DDP prefixes its own module. to the keys (Megatron-LM checkpoints the unwrapped model)
        sharded = unwrap_megatron(model).sharded_state_dict()
    finally:
        _EMITTED.reset(token)
    owners = {k: emitted[id(v)] for k, v in sharded.items() if isinstance(v, ShardedObject) and id(v) in emitted}
    pieces: dict[int, tuple[nn.Module, list[tuple[int, Any]]]] = {}
    for key, state in dist_checkpointing.load({k: sharded[k] for k in owners}, checkpoint_dir).items():
        module, index = owners[key]
        pieces.setdefault(id(module), (module, []))[1].append((index, state))
    for module, found in pieces.values():
        states = [s for _, s in sorted(found, key=lambda t: t[0])]
        if any(s is not None for s in states):
            apply_quantizer_extra_state(module, merge_extra_states(states))
    for name, leaf in iter_leaf_quantizers(model):
        leaf._qname = name
    return model


__all__ = [
    "EXTRA_STATE_KEY",
    "EXTRA_STATE_SCHEMA",
    "apply_quantizer_extra_state",
    "merge_extra_states",
    "quantizer_extra_state",
    "record_extra_state_objects",
    "restore_quantizer_config",
    "split_extra_state",
    "unwrap_megatron",
]
