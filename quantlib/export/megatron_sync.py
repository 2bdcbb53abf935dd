"""In-memory weight sync of a sharded Megatron-Core ``GPTModel`` (TP x EP x DP; local or TE linears, SequentialMLP
or TEGroupedMLP experts, shared experts, biases, output layer) under the Hugging Face / vLLM names, packed per rank.

The contract (:func:`megatron_sync_tensors`): every rank yields, as :class:`SyncTensor`, the part of each
tensor it holds, packed where quantized, named as the HF checkpoint (``model.layers.0.self_attn.q_proj.weight``)
or, for stacked experts, as vLLM's fused-MoE parameters (``model.layers.0.mlp.experts.w13_weight``).
Nothing is gathered and nothing is written: a rank's part is cut from its own shards (q / k / v from the
query groups of its ``linear_qkv`` rows, gate / up from the halves of its ``linear_fc1``), and is exactly the
part that vLLM's tensor-parallel loader narrows for that TP rank from the whole tensor. ``splits`` say where:
``Split(axis, part, parts)`` means the whole tensor cut into ``parts`` equal pieces along ``axis`` gives this
one at index ``part``; no splits: the whole tensor. For stacked ``w13_*`` the TP piece on the row axis is vLLM's
``w13`` of that TP rank: the gate piece then the up piece (vLLM narrows gate and up apart); the expert axis 0
splits over expert parallelism. Several ranks hold the same part (data-parallel replicas, and every TP rank
its replicated tensors: norms, router, biases of row-parallel linears, per-tensor and activation scales):
``replica`` numbers them, and the parts with ``replica == 0`` tile the model exactly once (what a gatherer
keeps; a sender to a vLLM TP rank takes its TP part and the replicated tensors from any one replica). A receiver
of another TP degree takes whole tensors: :func:`~quantlib.export.megatron_whole.whole_tensors` gathers each TP
part over its group, one tensor at a time.

Packed parts equal the same pieces of the packed TP1 tensors bit for bit: block scales never straddle shards
(checked), and with dynamic scales every amax that a cast needs before it runs (NVFP4 global, FP8 per tensor /
per row of a column-split weight, INT) is MAX-reduced over the tensor-parallel group (experts: the
expert-tensor group; with ``sync_expert_weight_amax``, the expert group too), one all-reduce per group, and
q / k / v and gate / up share one. With one all-reduce first that agrees on refusals, these are the only
collectives: every rank of the model calls this, and a refusal on any rank raises on every rank before anything
is yielded. Static and calibrated scales use the stored amax, which calibration already MAX-reduced.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Iterator, Optional, Union

import torch
import torch.distributed as dist
from torch import nn

from ..collectives import all_reduce, first_failure
from ..formats import Kind
from ..nn.containers import GroupedQuantizer
from ..nn.tensor_quantizer import TensorQuantizer
from ..traversal import applied_config
from .items import Item, active_input, refuse_pre_quant_scale
from .iterate import _stack, pack_item
from .megatron_names import COLUMN, LAYER_NAMES, MEGATRON_GPT, TOP_NAMES, hf_layer_name, hf_linear, select_rows, split_rows
from .plan import check_items
from .sync_scales import Scales, as_scales, current_amax, dynamic_items, refuse_clipped
from .types import ExportError, ExportFormat, PackedWeight
from .vllm_names import ExpertNames, named_pairs
from .writers import Packer, as_format, packer as get_packer


@dataclass(frozen=True)
class Split:
    """This part is piece ``part`` of ``parts`` equal pieces of the whole tensor along ``axis``, one per rank of
    Megatron's ``group`` ("tensor", "expert_tensor" or "expert", as :class:`~quantlib.parallel_state.ParallelState`
    names them)."""

    axis: int
    part: int
    parts: int
    group: str = "tensor"


@dataclass(frozen=True)
class SyncTensor:
    """One rank's part of one tensor to send: its HF / vLLM ``name``, where it sits in the whole tensor
    (``splits``, none: the whole), and which copy of that part it is (``replica``, 0 for one rank)."""

    name: str
    tensor: torch.Tensor
    splits: tuple[Split, ...] = ()
    replica: int = 0


@dataclass
class _Place:
    """How a planned item lies on this rank: the weight axis its tensor-parallel group splits (None: whole),
    that group's name in :class:`~quantlib.parallel_state.ParallelState`, rank and size; the expert axis
    (stacked experts) and the replica index."""

    axis: Optional[int]
    group: str
    part: int
    parts: int
    replica: int


_CODES = ("weight", "weight_packed")
_SCALES = ("weight_scale", "weight_scale_inv")
_GROUPED_WEIGHT = re.compile(r"weight\d+$")


def _ranks() -> dict[str, tuple[int, int]]:
    """(rank, size) of this rank in Megatron's tensor, expert-tensor, expert, data and expert-data groups."""
    from megatron.core import parallel_state as mpu

    return {
        "tensor": (mpu.get_tensor_model_parallel_rank(), mpu.get_tensor_model_parallel_world_size()),
        "expert_tensor": (mpu.get_expert_tensor_parallel_rank(), mpu.get_expert_tensor_parallel_world_size()),
        "expert": (mpu.get_expert_model_parallel_rank(), mpu.get_expert_model_parallel_world_size()),
        "data": (mpu.get_data_parallel_rank(), 0),
        "expert_data": (mpu.get_expert_data_parallel_rank(), 0),
    }


def _generic(name: str) -> tuple[str, Optional[int]]:
    """(Megatron module after ``decoder.layers.{i}.`` in SequentialMLP's generic form, local expert or None)."""
    m = re.match(r"mlp\.experts\.local_experts\.(\d+)\.(.*)$", name)
    return (f"mlp.experts.experts.{m.group(2)}", int(m.group(1))) if m else (name, None)


class _Walk:
    """This rank's items (HF names, local pieces) and their places, in checkpoint order."""

    def __init__(self, model: nn.Module, shared_expert: str) -> None:
        self.model, self.config, self.shared = model, model.config, shared_expert
        self.ranks = _ranks()
        self.items: list[Item] = []
        self.places: dict[int, _Place] = {}

    def place(self, expert: bool, axis: Optional[int]) -> _Place:
        group = "expert_tensor" if expert else "tensor"
        part, parts = self.ranks[group]
        return _Place(axis if parts > 1 else None, group, part, parts, self.ranks["expert_data" if expert else "data"][0])

    def add(self, it: Item, place: _Place) -> None:
        self.items.append(it)
        self.places[id(it)] = place

    def passthrough(self, name: str, t: torch.Tensor, place: _Place) -> None:
        module, _, local = name.rpartition(".")
        self.add(
            Item(
                module,
                "unquantized",
                module,
                extras={local: (lambda t=t: t.detach())},
                parent=module.rpartition(".")[0],
                leaf=module.rpartition(".")[2],
            ),
            place,
        )

    def run(self) -> "_Walk":
        model = self.model
        emb = getattr(model, "embedding", None)
        for key, p in [] if emb is None else emb.named_parameters():
            if key != "word_embeddings.weight":
                raise ExportError(
                    f"embedding.{key}: no Hugging Face name in the Megatron sync (rotary position embeddings have no weights)"
                )
            self.passthrough(TOP_NAMES["embedding.word_embeddings.weight"], p, self.place(False, 0))
        for layer in model.decoder.layers:
            self.layer(layer, int(layer.layer_number) - 1)  # Megatron's layer_number: global (pipeline stages), from 1
        final = getattr(model.decoder, "final_layernorm", None)
        for key, p in [] if final is None else final._parameters.items():
            if p is not None:
                self.passthrough(TOP_NAMES[f"decoder.final_layernorm.{key}"], p, self.place(False, None))
        out = getattr(model, "output_layer", None)
        # tied embeddings: the last pipeline stage's output_layer.weight is a copy of the embedding (HF ties them)
        tied = bool(getattr(model, "share_embeddings_and_output_weights", False))
        q = None if out is None else out._modules.get("weight_quantizer")
        if tied and q is not None and q.is_enabled:
            raise ExportError("output_layer.weight_quantizer: enabled on an output layer tied to the embedding; the HF model's "
                              "lm_head is the embedding, unquantized: disable it ('*output_layer*': {'enable': False}) or untie "
                              "the output layer")  # fmt: skip
        if out is not None and getattr(out, "weight", None) is not None and getattr(model, "post_process", True) and not tied:
            self.linear(out, "output_layer", "output_layer", None, None)
        return self

    def layer(self, layer: nn.Module, i: int) -> None:
        experts = getattr(getattr(layer, "mlp", None), "experts", None)
        router = getattr(getattr(layer, "mlp", None), "router", None)
        if getattr(router, "expert_bias", None) is not None:  # a buffer: routing would differ without it
            raise ExportError(f"decoder.layers.{i}.mlp.router.expert_bias: the Megatron sync names the Qwen-MoE families, which route "
                              "without an expert bias (moe_router_enable_expert_bias=True has no Hugging Face name here)")  # fmt: skip
        for name, module in layer.named_modules():
            if isinstance(module, TensorQuantizer) or not module._parameters:
                continue
            generic, local = _generic(name)
            if any(_GROUPED_WEIGHT.match(k) for k in module._parameters):
                self.grouped(module, name, i, experts)
                continue
            left = dict(module._parameters)
            if (
                generic.rpartition(".")[2] in ("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2")
                and module._parameters.get("weight") is not None
            ):
                e = None
                if local is not None:
                    e = _expert_offset(experts, self.ranks["expert"]) + local
                self.linear(module, f"decoder.layers.{i}.{name}", generic, i, e)
                left.pop("weight"), left.pop("bias", None)
            for key, p in left.items():
                if p is None:
                    continue
                full = f"{generic}.{key}"
                if full not in LAYER_NAMES:
                    raise ExportError(f"decoder.layers.{i}.{name}.{key}: no Hugging Face name for this tensor in the Megatron sync")
                self.passthrough(f"model.layers.{i}.{hf_layer_name(full, self.shared)}", p, self.place(False, None))

    def grouped(self, module: nn.Module, name: str, i: int, experts: Optional[nn.Module]) -> None:
        """TEGroupedMLP's ``linear_fc1`` / ``linear_fc2`` (TE GroupedLinear: ``weight{j}`` / ``bias{j}``, weight quantizer
        member j): GEMM j is local expert j, sent as SequentialMLP's expert of the same global number."""
        where = f"decoder.layers.{i}.{name}"
        leaf = name.rpartition(".")[2]
        if name != f"mlp.experts.{leaf}" or leaf not in ("linear_fc1", "linear_fc2"):
            raise ExportError(f"{where}: {type(module).__name__} (grouped GEMMs) outside TEGroupedMLP's linear_fc1 / linear_fc2 has no "
                              "Hugging Face name in the Megatron sync")  # fmt: skip
        n = int(module.num_gemms)
        q = module._modules.get("weight_quantizer")
        members = list(q) if isinstance(q, GroupedQuantizer) else None
        if q is not None and members is None:
            raise ExportError(f"{where}.weight_quantizer = {type(q).__name__}: expected one member per GEMM (GroupedQuantizer)")
        left = {k for k, p in module._parameters.items() if p is not None and not re.fullmatch(r"(weight|bias)\d+", k)}
        if left:
            raise ExportError(f"{where}.{sorted(left)[0]}: no Hugging Face name for this tensor in the Megatron sync")
        offset = _expert_offset(experts, self.ranks["expert"])
        for j in range(n):
            self.linear(module, where, f"mlp.experts.experts.{leaf}", i, offset + j, weight=f"weight{j}", bias=f"bias{j}",
                        quantizer=None if members is None else members[j], quantizer_name=f"weight_quantizer.{j}")  # fmt: skip

    def linear(
        self, module: nn.Module, where: str, generic: str, i: Optional[int], e: Optional[int], weight: str = "weight",
        bias: str = "bias", quantizer: Optional[nn.Module] = None, quantizer_name: str = "weight_quantizer",
    ) -> None:  # fmt: skip
        """One linear's items: ``module``'s parameters ``weight`` / ``bias`` and its ``quantizer`` (default: the
        module's ``weight_quantizer``) under the HF names of Megatron's ``generic`` module of layer ``i`` (expert ``e``)."""
        expert = e is not None
        axis = 0 if generic.rpartition(".")[2] in COLUMN else 1
        place = self.place(expert, axis)
        w, bias = module._parameters[weight], module._parameters.get(bias)
        bias = bias if bias is not None and bias.numel() else None  # TE keeps an empty tensor where there is none
        rows = w.shape[0]
        groups = None
        if generic == "self_attention.linear_qkv":
            groups = (self.config.num_query_groups or self.config.num_attention_heads) // self.ranks["tensor"][1]
        hf = hf_linear(generic, e, self.shared)
        hf = hf if i is None else f"model.layers.{i}.{hf}"
        q = module._modules.get("weight_quantizer") if quantizer is None else quantizer
        wq = f"{where}.{quantizer_name}"
        quantized = isinstance(q, TensorQuantizer) and q.is_enabled
        if quantized:
            refuse_pre_quant_scale([(wq, q), (f"{where}.input_quantizer", module._modules.get("input_quantizer"))])
        elif q is not None and not isinstance(q, TensorQuantizer) and q.is_enabled:
            raise ExportError(f"{wq} = {type(q).__name__}: the Megatron sync takes one TensorQuantizer per linear")
        ispec, iamax = active_input(module._modules.get("input_quantizer")) if quantized else (None, None)
        for leaf, idx, shard in split_rows(generic, rows, self.config, groups):
            name = f"{hf}.{leaf}" if leaf else hf
            get = lambda w=w, idx=idx: w.detach()[idx] if len(idx) < w.shape[0] else w.detach()  # noqa: E731
            extras = {}
            if bias is not None:
                extras["bias"] = (lambda b=bias, idx=idx: b.detach()[idx]) if axis == 0 else (lambda b=bias: b.detach())
            common = dict(expert=e, shard=shard, parent=name.rpartition(".")[0], leaf=name.rpartition(".")[2])
            if not quantized:
                self.add(Item(name, "unquantized", name, extras={"weight": get, **extras}, **common), place)
                continue
            amax = select_rows(q.amax, q.spec, rows, idx, wq)
            fused = f"model.layers.{i}.mlp.experts" if expert else ""
            self.add(Item(name, "expert" if expert else "linear", wq, get, q.spec, amax, ispec, iamax, extras, tp_axis=axis,
                          shape=(len(idx), w.shape[1]), fused=fused, input_where=f"{where}.input_quantizer", **common), place)  # fmt: skip


def _expert_offset(experts: Optional[nn.Module], ep: tuple[int, int]) -> int:
    offset = getattr(experts, "expert_offset", None)  # quantlib's SequentialMLP knows it
    if offset is not None:
        return int(offset)
    local = getattr(experts, "num_local_experts", None)  # TEGroupedMLP has no local_experts list
    return ep[0] * (int(local) if local is not None else len(experts.local_experts))


def _agree(error: Optional[BaseException], group: Optional[dist.ProcessGroup]) -> None:
    """Raise on every rank of ``group`` if any rank failed (no rank left waiting in a collective of the sync)."""
    if not (dist.is_available() and dist.is_initialized()):
        if error is not None:
            raise error
        return
    failed = first_failure(group, error)
    if failed is None:
        return
    if error is not None:
        raise error
    rank, first = failed
    raise ExportError(f"the Megatron sync was refused on rank {rank} of its group: {first}")


def _needs_amax(it: Item) -> bool:
    """Whether the cast of ``it`` needs an amax before it runs (FP8 blocks and MX take theirs in the cast)."""
    return it.spec is not None and it.amax is not None and it.spec.kind not in (Kind.MX, Kind.FP8_BLOCK)


def _dynamic(items: list[Item], places: dict[int, _Place], share_experts: bool) -> list[Item]:
    """Items with amax from their weights: every amax a cast needs first, MAX-reduced over the group that
    splits the weight (one all-reduce per group) and shared by siblings (and experts, with ``share_experts``)."""
    from ..parallel_state import ParallelState

    state = ParallelState.from_megatron()
    keyed: dict[object, list] = {}  # key -> [amax, group, items]
    for it in items:
        if not _needs_amax(it):
            continue
        place = places[id(it)]
        one = it.amax.numel() == 1
        if not one and (place.axis != 1 or it.spec.block is not None):
            continue  # per row of a whole-row shard, or per block: the shard's own amax are the whole tensor's
        cur = current_amax(it.weight(), it.spec, tuple(it.amax.shape))
        key: object = id(it)
        if one and share_experts and it.fused:
            key = ("experts", it.fused, it.group or it.leaf)
        elif one and it.group is not None:
            key = (it.parent, it.group)
        entry = keyed.setdefault(key, [cur, place.group, []])
        entry[0] = torch.maximum(entry[0], cur)
        entry[2].append(it)
    for group in ("tensor", "expert_tensor"):
        _reduce_max([e for e in keyed.values() if e[1] == group], state.group(group))
    _reduce_max([e for k, e in keyed.items() if isinstance(k, tuple) and k[0] == "experts"], state.group("expert"))
    given = {id(it): amax for amax, _, members in keyed.values() for it in members}
    return dynamic_items(items, given)


def _reduce_max(entries: list, group: Optional[dist.ProcessGroup]) -> None:
    """MAX-reduce the amax of ``entries`` ([amax, group name, items]) in place, in one all-reduce."""
    if not entries or group is None or dist.get_world_size(group) == 1:
        return
    flat = all_reduce(torch.cat([e[0].float().reshape(-1) for e in entries]), "max", group)
    at = 0
    for e in entries:
        n = e[0].numel()
        e[0] = flat[at : at + n].reshape(e[0].shape)
        at += n


def _axis(key: str, t: torch.Tensor, axis: Optional[int], it: Item, shift: int) -> Optional[int]:
    """The axis of packed tensor ``key`` that the weight's split ``axis`` splits (``shift``: a leading expert axis)."""
    if axis is None:
        return None
    if key in _CODES:
        return axis + shift
    if key == "bias":
        return axis + shift if axis == 0 else None
    if key in _SCALES and it.spec is not None:
        if it.spec.block is None:
            per_tensor = it.amax is None or it.amax.numel() == 1
            return None if per_tensor or axis == 1 else shift
        return (2 if t.dim() - shift == 4 and axis == 1 else axis) + shift  # ModelOpt FP8_PB's 4-D [out/128, 1, in/128, 1]
    return None


def _parts(key: str, t: torch.Tensor, it: Item, place: _Place, shift: int, expert_split: Optional[Split]) -> SyncTensor:
    local = key.rpartition(".")[2]
    if shift:
        local = local.split("_", 1)[1]  # w13_weight -> weight
    axis = _axis(local, t, place.axis, it, shift)
    splits = [] if expert_split is None else [expert_split]
    if local == "weight_shape" and place.axis is not None:  # CT's shape of the whole weight, not of this shard
        t = t.clone()
        t[..., place.axis] *= place.parts
    if axis is not None:
        splits.append(Split(axis, place.part, place.parts, place.group))
        return SyncTensor(key, t, tuple(splits), place.replica)
    # every rank of the tensor-parallel group holds this whole: one copy per data-parallel replica and TP rank
    return SyncTensor(key, t, tuple(splits), place.replica * place.parts + place.part)


def megatron_sync_tensors(
    model: nn.Module,
    format: Union[ExportFormat, str],
    *,
    scales: Union[Scales, str] = Scales.DYNAMIC,
    experts: str = "stacked",
    expert_names: Union[ExpertNames, str] = ExpertNames.FLAT,
    shared_expert: str = "shared_expert",
    group: Optional[dist.ProcessGroup] = None,
) -> Iterator[SyncTensor]:
    """This rank's parts of every tensor of Megatron ``model`` to send, packed in ``format`` (see the module
    docstring for the contract). Collective over ``group`` (default: the world; every rank of the model
    calls it). ``scales``: "dynamic" (from the weights being sent), "static" (calibrated, refusing a weight
    that outgrew it) or "calibrated". ``experts``: "stacked" (vLLM's ``w13_*`` / ``w2_*`` in
    ``expert_names`` style) or "per_expert" (``mlp.experts.{e}.gate_proj.*``). ``shared_expert``: the HF
    module name of MoE shared experts (Qwen2-MoE's ``shared_expert``; DeepSeek's ``shared_experts``)."""
    from quantlib import __version__

    from ..plugins.megatron_state import unwrap_megatron

    fmt, source = as_format(format), as_scales(scales)
    if experts not in ("per_expert", "stacked"):
        raise ExportError(f"experts={experts!r}: expected 'per_expert' or 'stacked'")
    model = unwrap_megatron(model)
    packer = get_packer(fmt)
    error, walk, items = None, None, []
    try:
        walk = _Walk(model, shared_expert).run()
        plan = check_items(
            walk.items, packer, MEGATRON_GPT, unify_siblings=source is Scales.DYNAMIC, version=__version__, what=type(model).__name__
        )
        items = plan.items
        if source is Scales.STATIC:
            refuse_clipped(items)
    except ExportError as exc:
        error = exc
    _agree(error, group)
    if source is Scales.DYNAMIC:
        config = applied_config(model)
        shared = _dynamic(items, walk.places, bool(config is not None and config.sync_expert_weight_amax))
        walk.places.update({id(new): walk.places[id(old)] for old, new in zip(items, shared)})
        items = shared
    yield from _stream(items, walk.places, packer, experts == "stacked", expert_names, walk.ranks["expert"])
    yield from _kv(model, packer, walk.place(False, None))


def _stream(
    items: list[Item], places: dict[int, _Place], packer: Packer, stacked: bool, style, ep: tuple[int, int]
) -> Iterator[SyncTensor]:
    pending: list[Item] = []
    with torch.no_grad():
        for it in items:
            if stacked and it.role == "expert":
                if pending and pending[0].fused != it.fused:
                    yield from _stacked(pending, places, packer, style, ep)
                    pending = []
                pending.append(it)
                continue
            if pending:
                yield from _stacked(pending, places, packer, style, ep)
                pending = []
            place = places[id(it)]
            for key, t in pack_item(it, packer).items():
                yield _parts(key, t, it, place, 0, None)
        if pending:
            yield from _stacked(pending, places, packer, style, ep)


def _stacked(items: list[Item], places: dict[int, _Place], packer: Packer, style, ep: tuple[int, int]) -> Iterator[SyncTensor]:
    """A layer's local experts as vLLM's stacked parameters: the expert axis split over expert parallelism,
    each expert's rows or columns over the expert-tensor group."""
    by_shard = {it.shard: it for it in items}
    expert_split = Split(0, ep[0], ep[1], "expert") if ep[1] > 1 else None
    for key, t in named_pairs(_stack(items, packer, (0, 1)), style):
        shard = "w2" if key.rpartition(".")[2].startswith("w2_") else "w1" if "w1" in by_shard else "w3"
        it = by_shard[shard]
        yield _parts(key, t, it, places[id(it)], 1, expert_split)


def _kv(model: nn.Module, packer: Packer, place: _Place) -> Iterator[SyncTensor]:
    """KV-cache scales (MAX-reduced over TP by calibration: every TP rank holds the whole)."""
    from .megatron_export import _kv_items

    replica = place.replica * place.parts + place.part
    kv, _ = _kv_items(model, packer)
    for layer in sorted(kv):
        for key, t in PackedWeight(kv[layer].name, packer.pack_kv(kv[layer].spec, kv[layer].k_amax, kv[layer].v_amax), "kv").items():
            yield SyncTensor(key, t, (), replica)


def megatron_sync_pairs(model: nn.Module, format: Union[ExportFormat, str], **kwargs) -> Iterator[tuple[str, torch.Tensor]]:
    """``(name, tensor)`` of :func:`megatron_sync_tensors` (same arguments), for a sender that knows the parts' places."""
    for st in megatron_sync_tensors(model, format, **kwargs):
        yield st.name, st.tensor
