"""Megatron-Core plugin: quantized tensor-parallel linears, MoE expert containers, and dist checkpoints
whose amax restore at any TP/EP layout.

Imported (and so registered) by :func:`quantlib.plugins.register_available` when ``megatron.core``
imports. What it registers:

- ``ColumnParallelLinear`` (``parallel_role = "column"``) and ``RowParallelLinear`` (``"row"``): the
  input and the weight are fake-quantized in ``_forward_impl``, right before the GEMM, so Megatron's own
  tensor-parallel communication (copy / gather / reduce, sequence parallelism) runs unchanged around it;
  the output quantizer sees the layer's final output. Both keep Megatron's ``(output, bias)`` return.
  Expert linears keep Megatron's ``is_expert`` attribute, which the amax sync reads.
- ``SequentialMLP``: gives every local expert's linears their global expert index
  (``ep_rank * num_local_experts + local index``) and counts the tokens each expert receives while
  calibrating (``tokens_per_expert``, which calibration logs; :func:`expert_token_counts` by global
  index).
- Where Transformer Engine imports: the TE wrappers (``TELinear``, ``TEColumnParallelLinear``,
  ``TERowParallelLinear``, ``TELayerNormColumnParallelLinear``, ``TEColumnParallelGroupedLinear``,
  ``TERowParallelGroupedLinear``) on top of quantlib's TE modules (plugins/transformer_engine.py). The
  experts of ``TEGroupedMLP`` are its two grouped linears: one ``GroupedQuantizer`` of weight quantizers
  each (member i = GEMM i = global expert ``ep_rank * num_gemms + i``), tokens counted from ``m_splits``;
  the container itself needs no quantized class.

Dist checkpointing (docs/design.md §7; the quantizer state itself is :mod:`quantlib.plugins.megatron_state`).
``sharded_state_dict`` saves every amax in a layout-independent global form, as a ``ShardedTensor`` whose key does not depend on TP or EP:

- a per-tensor amax (and the NVFP4 global amax) is replicated (the sync made it equal on all ranks);
- a per-channel or per-block amax over a TP-split axis is sharded over TP along that axis (column-
  parallel weights, the row-parallel input), or replicated where its group spans the whole split axis
  (per-channel amax of row-parallel weights, synced over TP); a block that straddles TP shards has no
  global form and raises :class:`LayoutError`;
- an expert's amax gets the global expert index as a leading axis (Megatron's expert offsets for
  ``SequentialMLP``; for grouped linears member ``i`` of a ``GroupedQuantizer`` is expert
  ``ep_rank * num_gemms + i``), with the same weight-amax keys in both containers (a grouped linear's
  shared input amax is saved once per layer);
- the weight amax of a gated MLP's fc1 is saved in gate and up halves, as Megatron saves the weight;
- an extra-state object, ``<layer>._quantizer_extra_state`` (a ``ShardedObject`` sharded like
  Megatron's ``_extra_state``, and an entry of ``state_dict()``), carries every quantizer's config and
  global amax shapes, so that :func:`restore_quantizer_config` configures a fresh model (any layout)
  before the amax are loaded. It is not Megatron's ``_extra_state`` itself: ``GPTModel`` drops and
  asserts empty the output layer's ``_extra_state``, and TE keeps its FP8 metadata there.

A checkpoint saved at TP=a / EP=b therefore loads at TP=c / EP=d with identical quantization::

    dist_checkpointing.save(model.sharded_state_dict(), ckpt_dir)
    ...
    model = restore_quantizer_config(fresh_model, ckpt_dir)       # quantizers + amax placeholders
    model.load_state_dict(dist_checkpointing.load(model.sharded_state_dict(), ckpt_dir))
"""

from __future__ import annotations

import inspect
import logging
import sys
from typing import Any, Iterator, Optional

import torch
from megatron.core import parallel_state as mpu
from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
from megatron.core.transformer.mlp import apply_swiglu_sharded_factory
from megatron.core.transformer.moe.experts import SequentialMLP
from megatron.core.transformer.utils import make_sharded_object_for_checkpoint
from megatron.core.utils import get_pg_rank, get_pg_size, make_sharded_tensor_for_checkpoint, make_tp_sharded_tensor_for_checkpoint
from torch import nn

from ..checkpoint import CheckpointError
from ..nn.containers import GroupedQuantizer
from ..nn.quant_module import QuantModule, QuantModuleRegistry
from ..nn.tensor_quantizer import TensorQuantizer
from ..parallel_state import LayoutError, tp_shard_dim
from ..traversal import leaves_of
from .expert_tokens import accumulate
from .megatron_experts import grouped_forward, grouped_refusal, structure
from .megatron_state import (
    EXTRA_STATE_KEY,
    EXTRA_STATE_SCHEMA,
    _extra_key,
    apply_quantizer_extra_state,
    merge_extra_states,
    pre_quant_scale_shard_dim,
    quantizer_extra_state,
    record_extra_state_objects,
    restore_quantizer_config,
    split_extra_state,
    unwrap_megatron,
)

try:  # Megatron-Core 0.16 and later
    from megatron.core.transformer.utils import ensure_metadata_has_dp_cp_group
except ImportError:  # releases whose layers read the data-parallel group from parallel_state themselves

    def ensure_metadata_has_dp_cp_group(metadata: Optional[dict]) -> dict:
        metadata = {} if metadata is None else metadata
        metadata.setdefault("dp_cp_group", mpu.get_data_parallel_group(with_context_parallel=True))
        return metadata


#: keyword parameters of Megatron's swiglu factory (they grew from release to release)
_SWIGLU_PARAMS = frozenset(inspect.signature(apply_swiglu_sharded_factory).parameters)

_log = logging.getLogger("quantlib")


# ------------------------------------------------------------------------------------ the shared mixin


class _MegatronQuantMixin(QuantModule):
    """What every quantized Megatron linear shares: its tensor-parallel layout, ``sharded_state_dict``
    with amax in global form, and the quantizer config in the state dict.

    ``parallel_role`` is set by the concrete classes; the split it implies is ``QuantModule.tp_split``.
    """

    def _setup(self) -> None:
        super()._setup()
        self.register_state_dict_post_hook(_add_extra_state)
        self.register_load_state_dict_pre_hook(_pop_extra_state)

    # -------------------------------------------------------------- layout
    def _ql_tp_group(self):
        # Megatron's TE wrappers keep the group that shards their checkpoint in ``_tp_group`` (TE's own
        # ``tp_group`` is None for experts); the local layers in ``tp_group``.
        group = self.__dict__.get("_tp_group")
        return group if group is not None else getattr(self, "tp_group", None)

    def _ql_tp_size(self) -> int:
        return get_pg_size(self._ql_tp_group())

    # -------------------------------------------------------------- dist checkpointing
    def _ql_tensor_leaves(self) -> Iterator[tuple[str, str, str, torch.Tensor, TensorQuantizer, str, Optional[int]]]:
        """(buffer key, state-dict name, checkpoint name, tensor, leaf, quantizer attribute, grouped member or
        None) of every calibrated amax and ``pre_quant_scale``. The members of a GroupedQuantizer share a
        checkpoint name: their global expert index is an axis of the checkpoint tensor."""
        for qname in self.quantizer_names:
            q = getattr(self, qname, None)
            if q is None:
                continue
            grouped = isinstance(q, GroupedQuantizer)
            for name, leaf in leaves_of(qname, q):
                parts = name.split(".")
                ckpt_name, member = (".".join([qname] + parts[2:]), int(parts[1])) if grouped else (name, None)
                for key, value in (("_amax", leaf.amax), ("_pre_quant_scale", leaf.pre_quant_scale)):
                    if value is not None:
                        yield key, name, ckpt_name, value, leaf, qname, member

    def _ql_member_offsets(self, member: int, prefix: str, sharded_offsets: tuple, metadata: dict) -> tuple[tuple, str]:
        """(checkpoint offsets, key prefix) of member ``member`` of a grouped quantizer."""
        raise CheckpointError(f"{type(self).__name__} has no grouped quantizers")

    def _ql_sharded_tensors(self, prefix: str, sharded_offsets: tuple, metadata: dict) -> dict:
        tp_group, dp_group = self._ql_tp_group(), metadata["dp_cp_group"]
        tp_size = get_pg_size(tp_group)
        # Megatron's MLP saves the fc1 weight of a gated MLP as gate and up halves (by the name linear_fc1)
        glu = bool(getattr(getattr(self, "config", None), "gated_linear_unit", False)) and (
            prefix == "linear_fc1." or prefix.endswith(".linear_fc1.")
        )
        out = {}
        for buffer, name, ckpt_name, value, leaf, qname, member in self._ql_tensor_leaves():
            where = f"{prefix}{name}"
            axis, extent = self.tp_split(qname)
            if buffer == "_amax":
                dim = tp_shard_dim(leaf.spec, leaf.axis, value.dim(), axis, extent, tp_size, where)
            else:
                dim = pre_quant_scale_shard_dim(self.weight_quantizer_names, qname, axis)
            offsets, ckpt_prefix = (
                (sharded_offsets, prefix) if member is None else self._ql_member_offsets(member, prefix, sharded_offsets, metadata)
            )
            key = f"{ckpt_prefix}{ckpt_name}.{buffer}"
            if dim is None:
                sh = make_sharded_tensor_for_checkpoint(value, key, prepend_offsets=offsets, tp_group=tp_group, dp_cp_group=dp_group)
            else:
                sh = make_tp_sharded_tensor_for_checkpoint(value, key, dim, prepend_offsets=offsets, tp_group=tp_group,
                                                           dp_cp_group=dp_group)
                if glu:
                    sh = _glu_halves(sh, dim, qname in self.weight_quantizer_names, offsets, metadata, where, tp_group)
            out[f"{prefix}{name}.{buffer}"] = sh
        return out

    def _ql_sharded_config(self, prefix: str, sharded_offsets: tuple, metadata: dict) -> dict:
        """The quantizer config as a ShardedObject, sharded like Megatron's ``_extra_state``."""
        key = f"{prefix}{EXTRA_STATE_KEY}"
        replica_id = (0, get_pg_rank(self._ql_tp_group()), get_pg_rank(metadata["dp_cp_group"]))
        return {key: make_sharded_object_for_checkpoint(quantizer_extra_state(self), key, sharded_offsets, replica_id=replica_id)}

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata: Optional[dict] = None) -> dict:
        metadata = ensure_metadata_has_dp_cp_group(metadata)
        sd = super().sharded_state_dict(prefix, sharded_offsets, metadata)
        mine = set(self.quantizer_names) | {EXTRA_STATE_KEY}
        for key in [k for k in sd if k.startswith(prefix) and k[len(prefix) :].split(".", 1)[0] in mine]:
            del sd[key]  # Megatron wrapped the quantizer buffers as replicated local tensors
        sd.update(self._ql_sharded_tensors(prefix, sharded_offsets, metadata))
        config = self._ql_sharded_config(prefix, sharded_offsets, metadata)
        record_extra_state_objects(self, list(config.values()))  # piece i of a grouped layer at i
        sd.update(config)
        return sd


def _glu_halves(sh, dim: int, is_weight: bool, offsets: tuple, metadata: dict, where: str, tp_group):
    """The fc1 of a gated MLP holds [gate; up] rows on every rank: save the amax rows as two halves, as
    Megatron saves the weight, so that they reshard like the weight."""
    if not is_weight or dim != 0:
        raise LayoutError(
            f"{where}: an amax sharded along dim {dim} of a gated MLP's fc1 has no layout-independent form "
            "(only weight amax kept per output row have one)"
        )
    if sh.data.shape[0] % 2:
        raise LayoutError(f"{where}: amax rows {tuple(sh.data.shape)} do not split into gate and up halves (blocks straddle them)")
    kwargs: dict[str, Any] = {"singleton_local_shards": True} if metadata.get("singleton_local_shards") else {}
    if "tp_group" in _SWIGLU_PARAMS:  # newer releases take the groups instead of reading parallel_state
        kwargs.update(tp_group=tp_group, dp_group=metadata["dp_cp_group"])
    return apply_swiglu_sharded_factory(sh, offsets, **kwargs)


def _add_extra_state(module: nn.Module, state_dict: dict, prefix: str, local_metadata: dict) -> None:
    if isinstance(module, _MegatronQuantMixin):  # (hook dicts are shared with the pre-conversion module)
        state_dict[prefix + EXTRA_STATE_KEY] = quantizer_extra_state(module)


def _pop_extra_state(module: nn.Module, state_dict: dict, prefix: str, *args) -> None:
    if not isinstance(module, _MegatronQuantMixin):
        return
    pieces = sorted((index, k) for k, (owner, index) in ((k, _extra_key(k)) for k in list(state_dict)) if owner == prefix)
    states = [state_dict.pop(k) for _, k in pieces]
    if any(s is not None for s in states):  # absent or None: a checkpoint of the unquantized layer
        apply_quantizer_extra_state(module, merge_extra_states(states))


# ------------------------------------------------------------------------------------ local linears


class _LocalLinearMixin(_MegatronQuantMixin):
    """Megatron's own ColumnParallelLinear / RowParallelLinear: quantize in ``_forward_impl``, the call
    that does the GEMM inside Megatron's forward (after its input communication, before its output
    communication), so every TP mode of Megatron runs unchanged."""

    def _forward_impl(self, input, weight, *args, **kwargs):
        return super()._forward_impl(self.input_quantizer(input), self.quantize_weight(weight), *args, **kwargs)

    def forward(self, *args, **kwargs):
        output, bias = super().forward(*args, **kwargs)
        return self.output_quantizer(output), bias

    def weight_groups(self) -> Iterator[tuple[str, list[torch.Tensor]]]:
        if getattr(self, "weight", None) is not None:  # None with skip_weight_param_allocation
            yield "weight_quantizer", [self.weight]

    def tp_weight_shape(self) -> tuple[int, ...]:
        if getattr(self, "weight", None) is not None:
            return tuple(self.weight.shape)
        if self.parallel_role == "column":  # a column layer given its weight in forward (tied embeddings)
            return (self.output_size_per_partition, self.input_size)
        return (self.output_size, self.input_size_per_partition)


@QuantModuleRegistry.register(ColumnParallelLinear, "megatron.ColumnParallelLinear")
class _QuantColumnParallelLinear(_LocalLinearMixin):
    parallel_role = "column"


@QuantModuleRegistry.register(RowParallelLinear, "megatron.RowParallelLinear")
class _QuantRowParallelLinear(_LocalLinearMixin):
    parallel_role = "row"


# ------------------------------------------------------------------------------------ experts


def _expert_parallel(module: nn.Module) -> tuple[int, int]:
    """(rank, size) of ``module``'s expert-parallel group."""
    group = getattr(module, "ep_group", None)
    pgs = getattr(module, "_pg_collection", None)
    if group is None and pgs is not None:
        group = getattr(pgs, "ep", None)
    if group is not None:
        return get_pg_rank(group), get_pg_size(group)
    return mpu.get_expert_model_parallel_rank(), mpu.get_expert_model_parallel_world_size()


@QuantModuleRegistry.register(SequentialMLP, "megatron.SequentialMLP")
class _QuantSequentialMLP(QuantModule):
    """Quantizes nothing itself: tells its local experts' linears their global expert index, counts
    the tokens each local expert receives while calibrating (``tokens_per_expert``, as quantlib's TE
    GroupedLinear does; :func:`expert_token_counts`), and runs all its quantized experts at once with
    grouped GEMMs and no host read (:mod:`.megatron_experts`; Megatron's loop where that cannot give its bits)."""

    quantizer_names: tuple[str, ...] = ()
    weight_quantizer_names: tuple[str, ...] = ()

    def _setup(self) -> None:
        self.register_buffer("tokens_per_expert", torch.zeros(self.num_local_experts, dtype=torch.int64), persistent=False)
        self._was_calibrating = False
        offset, total = self.expert_offset, self.num_global_experts
        for i, expert in enumerate(self.local_experts):
            for linear in (getattr(expert, "linear_fc1", None), getattr(expert, "linear_fc2", None)):
                if linear is not None:  # an attribute set before the linear's conversion survives it
                    linear.is_expert = True
                    linear.expert_index = offset + i
                    linear.num_global_experts = total

    @property
    def expert_offset(self) -> int:
        """Global index of local expert 0: EP rank * num_local_experts."""
        return _expert_parallel(self)[0] * self.num_local_experts

    @property
    def num_global_experts(self) -> int:
        return _expert_parallel(self)[1] * self.num_local_experts

    def weight_groups(self) -> Iterator[tuple[str, list[torch.Tensor]]]:
        return iter(())

    def _calibrating(self, st=None) -> tuple[bool, bool]:
        """(a calibration forward loop runs, it has collected nothing yet)."""
        leaves = [q for q in (st or structure(self, _local)).leaves if q.is_enabled]
        collecting = [q for q in leaves if q._if_calib]
        calibrating = bool(collecting) or any(not q._if_quant for q in leaves)
        return calibrating, bool(collecting) and all(q.num_calib_batches == 0 for q in collecting)

    def forward(self, permuted_local_hidden_states: torch.Tensor, tokens_per_expert: torch.Tensor, *args, **kwargs):
        st = structure(self, _local)
        calibrating, fresh = self._calibrating(st)
        if calibrating:
            # fresh: judged over all its experts' quantizers, since one expert may see no tokens for batches
            counts = accumulate(self, tokens_per_expert, fresh or not self._was_calibrating)
            if _log.isEnabledFor(logging.DEBUG):  # the counts live on the device: read back only to be logged
                first = self.expert_offset
                _log.debug("quantlib calibration: experts %d..%d received %s tokens", first, first + self.num_local_experts - 1,
                           counts.tolist())
        self._was_calibrating = calibrating
        # Megatron's (hidden, tokens_per_expert, permuted_probs); releases with other arguments take its loop
        probs = args[0] if len(args) == 1 and not kwargs else kwargs.get("permuted_probs") if not args and len(kwargs) == 1 else None
        if probs is not None and not grouped_refusal(self, st, permuted_local_hidden_states, probs):
            return grouped_forward(self, st, permuted_local_hidden_states, tokens_per_expert, probs)
        return super().forward(permuted_local_hidden_states, tokens_per_expert, *args, **kwargs)


def _local(fc1s: list, fc2s: list) -> bool:
    """Whether every expert's linears are quantized local parallel linears (what the grouped forward runs)."""
    return all(isinstance(m, _QuantColumnParallelLinear) for m in fc1s) and all(isinstance(m, _QuantRowParallelLinear) for m in fc2s)


def expert_token_counts(model: nn.Module) -> dict[str, dict[int, int]]:
    """``{module name: {global expert index: tokens}}``: the tokens each expert held on this rank
    received during the last calibration (SequentialMLP containers and grouped expert linears)."""
    out = {}
    for name, m in model.named_modules():
        counts = getattr(m, "tokens_per_expert", None)
        if isinstance(m, QuantModule) and isinstance(counts, torch.Tensor) and hasattr(m, "expert_offset"):
            out[name] = {m.expert_offset + i: int(c) for i, c in enumerate(counts.tolist())}
    return out


# ------------------------------------------------------------------------------------ Transformer Engine


class _TEColumnMixin(_MegatronQuantMixin):
    parallel_role = "column"


class _TERowMixin(_MegatronQuantMixin):
    parallel_role = "row"


class _TELinearMixin(_MegatronQuantMixin):
    """``TELinear``: its role is TE's ``parallel_mode`` ("duplicated" layers have None)."""


class _TEGroupedMixin(_MegatronQuantMixin):
    """``TE{Column,Row}ParallelGroupedLinear``: GEMM i is expert ``ep_rank * num_gemms + i``. Member i of
    each GroupedQuantizer is saved at that index of the expert axis (the keys SequentialMLP uses); the
    shared input / output quantizers are saved once per layer; the config once per expert."""

    is_expert = True

    @property
    def expert_offset(self) -> int:
        return _expert_parallel(self)[0] * self.num_gemms

    def _ql_member_offsets(self, member: int, prefix: str, sharded_offsets: tuple, metadata: dict) -> tuple[tuple, str]:
        index, total = self.expert_offset + member, _expert_parallel(self)[1] * self.num_gemms
        if metadata.get("singleton_local_shards"):
            return sharded_offsets, f"{index}.{prefix}"  # Megatron's key for per-expert shards
        return (*sharded_offsets, (len(sharded_offsets), index, total)), prefix

    def _ql_expert_dp_rank(self) -> int:
        pgs = getattr(self, "_pg_collection", None)
        group = getattr(pgs, "expt_dp", None) if pgs is not None else None
        return get_pg_rank(group) if group is not None else mpu.get_expert_data_parallel_rank()

    def _ql_sharded_config(self, prefix: str, sharded_offsets: tuple, metadata: dict) -> dict:
        replica_id = (0, get_pg_rank(self._ql_tp_group()), self._ql_expert_dp_rank())
        out = {}
        for i, piece in enumerate(split_extra_state(quantizer_extra_state(self), self.num_gemms)):
            offsets, ckpt_prefix = self._ql_member_offsets(i, prefix, sharded_offsets, metadata)
            key = f"{ckpt_prefix}{EXTRA_STATE_KEY}"
            out[f"{prefix}{EXTRA_STATE_KEY}{i or ''}"] = make_sharded_object_for_checkpoint(piece, key, offsets, replica_id=replica_id)
        return out

    def _ql_sharded_tensors(self, prefix: str, sharded_offsets: tuple, metadata: dict) -> dict:
        out = super()._ql_sharded_tensors(prefix, sharded_offsets, metadata)
        edp = self._ql_expert_dp_rank()
        for buffer, name, _, _, _, _, member in self._ql_tensor_leaves():
            if member is not None:  # an expert's tensor: replicated over the expert-data-parallel ranks only
                sh = out[f"{prefix}{name}.{buffer}"]
                sh.replica_id = (*sh.replica_id[:2], edp)
        return out


class _TEColumnGroupedMixin(_TEGroupedMixin):
    parallel_role = "column"


class _TERowGroupedMixin(_TEGroupedMixin):
    parallel_role = "row"


def _register_te() -> list[str]:
    """Register Megatron's TE wrappers on top of quantlib's TE modules, once Transformer Engine has been
    imported (by Megatron's TE extension or the user: never imported here just to look)."""
    mte = sys.modules.get("megatron.core.extensions.transformer_engine")
    if "transformer_engine" not in sys.modules or mte is None or not getattr(mte, "HAVE_TE", False):
        return []  # (Megatron's TE extension mocks TE when it is missing)
    try:
        from . import transformer_engine as qte  # registers te.Linear, te.LayerNormLinear, te.GroupedLinear
    except ImportError as exc:
        _log.info("quantlib: Megatron's TE wrappers are not quantized: quantlib's TE plugin does not import (%s)", exc)
        return []
    te = qte.te
    wrappers = [
        ("TELinear", te.Linear, _TELinearMixin),
        ("TEColumnParallelLinear", te.Linear, _TEColumnMixin),
        ("TERowParallelLinear", te.Linear, _TERowMixin),
        ("TELayerNormColumnParallelLinear", te.LayerNormLinear, _TEColumnMixin),
        ("TEColumnParallelGroupedLinear", te.GroupedLinear, _TEColumnGroupedMixin),
        ("TERowParallelGroupedLinear", te.GroupedLinear, _TERowGroupedMixin),
    ]
    done = []
    for name, te_class, role in wrappers:
        cls = getattr(mte, name, None)
        te_mixin = QuantModuleRegistry._mixins.get(te_class)  # the TE plugin's mixin for te_class
        if not isinstance(cls, type) or te_mixin is None:
            continue
        if not QuantModuleRegistry.is_registered(cls):
            QuantModuleRegistry.register(cls, f"megatron.{name}")(type(f"_Quant{name}", (role, te_mixin), {}))
        done.append(name)
    return done


#: Megatron TE wrappers registered (empty without Transformer Engine)
TE_REGISTERED: list[str] = _register_te()


def refresh() -> None:
    """Called by :func:`quantlib.plugins.register_available` on each conversion: registers the TE
    wrappers once Megatron's TE extension has been imported with a working TE."""
    if not TE_REGISTERED:
        TE_REGISTERED.extend(_register_te())


__all__ = [
    "EXTRA_STATE_KEY",
    "EXTRA_STATE_SCHEMA",
    "TE_REGISTERED",
    "LayoutError",
    "apply_quantizer_extra_state",
    "expert_token_counts",
    "merge_extra_states",
    "refresh",
    "quantizer_extra_state",
    "restore_quantizer_config",
    "split_extra_state",
    "unwrap_megatron",
]
