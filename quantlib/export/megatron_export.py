"""Export of a Megatron-Core ``GPTModel`` (local or TE spec; SequentialMLP or TEGroupedMLP experts) sharded over TP / EP /
DP, under the names of the Hugging Face family it matches (:mod:`.megatron_names`: q / k / v and gate / up split,
biases with their weights, shared experts, a quantized output layer as a quantized ``lm_head``) with that family's
config.json (:mod:`.megatron_config`). Gathered, not written per rank: every rank sends its
shards of ``model.sharded_state_dict()`` (global keys, shapes and offsets; quantlib's plugin stores amax
there in their global form, per global expert) to rank 0, which assembles each global tensor and packs
it with its global amax exactly as at TP1, so the files cannot depend on the layout the model ran at
(TEGroupedMLP experts included). Rank 0 holds one copy of the model's weights while it writes. The
in-memory sync, packed on each rank without a gather, is :mod:`.megatron_sync`.
KV-cache scales (``core_attention.k_bmm_quantizer`` / ``v_bmm_quantizer``) are written as the
transformers export writes them, under ``model.layers.{i}.self_attn``; their amax are MAX-reduced over
TP by calibration, so rank 0's are every rank's.
"""

from __future__ import annotations

from typing import Any, Callable, Optional, Union

import torch
import torch.distributed as dist
from torch import nn

from ..collectives import gather_objects
from ..formats import FormatSpec
from ..kv.export_plan import KVItem, plan_kv
from ..nn.containers import GroupedQuantizer
from ..nn.quant_module import QuantModule
from ..nn.tensor_quantizer import TensorQuantizer
from .export_checkpoint import check_arguments, parse_size, write_plan
from .items import Item, module_quantizers, refuse_pre_quant_scale
from .megatron_config import megatron_hf_config
from .megatron_names import LINEARS, MEGATRON_GPT, TOP_NAMES, hf_layer_name, hf_linear, select_rows, split_rows
from .plan import check_items
from .types import ExportError, ExportFormat, ExportManifest
from .writers import Packer, as_format, packer as get_packer


def _sharded_tensors(model: nn.Module) -> list:
    from megatron.core.dist_checkpointing.mapping import ShardedTensor, ShardedTensorFactory

    out, todo = [], list(model.sharded_state_dict().values())
    while todo:
        x = todo.pop(0)
        if isinstance(x, ShardedTensorFactory):  # e.g. the gate / up halves of a gated fc1
            built = x.build()
            todo[:0] = list(built.values()) if isinstance(built, dict) else list(built) if isinstance(built, (list, tuple)) else [built]
        elif isinstance(x, ShardedTensor):
            out.append(x)
    return out


def _pieces(model: nn.Module) -> list[tuple]:
    out = []
    for sh in _sharded_tensors(model):
        pre = sh.prepend_axis_num
        slices = tuple(slice(o, o + (1 if i < pre else sh.local_shape[i - pre])) for i, o in enumerate(sh.global_offset))
        out.append((sh.key, tuple(sh.global_shape), slices, sh.data.detach().cpu().clone().reshape(sh.local_shape), pre))
    return out


def _specs(model: nn.Module) -> dict[tuple, tuple]:
    """(layer, Megatron module after ``decoder.layers.``, global expert or None) -> (weight spec, input spec,
    module name, weight quantizer name) of each enabled quantized linear (or grouped GEMM) of this rank; the
    output layer under (None, "output_layer", None)."""
    out = {}
    for name, module in model.named_modules():
        if not isinstance(module, QuantModule) or not (name.startswith("decoder.layers.") or name == "output_layer"):
            continue
        refuse_pre_quant_scale(module_quantizers(module, name))
        q = getattr(module, "weight_quantizer", None)
        if q is None or not q.is_enabled:  # a grouped quantizer: any member
            continue
        parts = name.split(".")
        layer, rest = (None, parts) if name == "output_layer" else (int(parts[2]), parts[3:])
        inp = getattr(module, "input_quantizer", None)
        ispec = inp.spec if isinstance(inp, TensorQuantizer) and inp.is_enabled else None
        if isinstance(q, GroupedQuantizer) and rest[:2] == ["mlp", "experts"] and len(rest) == 3:
            # TEGroupedMLP: member i of the grouped linear is global expert expert_offset + i, saved
            # under SequentialMLP's keys (Megatron makes the two checkpoints interchangeable)
            generic = ".".join(["mlp", "experts", "experts", rest[2]])
            for i, member in enumerate(q):
                if not member.is_enabled:
                    continue
                if not isinstance(member, TensorQuantizer):
                    raise ExportError(f"{name}.weight_quantizer[{i}] = {type(member).__name__}: the Megatron export takes one "
                                      "TensorQuantizer per expert GEMM")
                out[(layer, generic, module.expert_offset + i)] = (member.spec, ispec, name, f"{name}.weight_quantizer[{i}]")
            continue
        if not isinstance(q, TensorQuantizer):
            raise ExportError(f"{name}.weight_quantizer = {type(q).__name__}: the Megatron export takes one TensorQuantizer per linear")
        expert = None
        if rest[:3] == ["mlp", "experts", "local_experts"]:
            experts = model.get_submodule(".".join(parts[:5]))
            expert, rest = experts.expert_offset + int(rest[3]), ["mlp", "experts", "experts"] + rest[4:]
        out[(layer, ".".join(rest), expert)] = (q.spec, ispec, name, f"{name}.weight_quantizer")
    return out


def _assemble(pieces_by_rank: list[list]) -> tuple[dict[str, torch.Tensor], dict[str, int], list[str]]:
    full: dict[str, torch.Tensor] = {}
    prepend: dict[str, int] = {}
    order: list[str] = []
    for pieces in pieces_by_rank:
        for key, shape, slices, value, pre in pieces:
            if key not in full:
                full[key] = torch.empty(shape, dtype=value.dtype)
                prepend[key] = pre
                order.append(key)
            full[key][slices] = value.reshape(full[key][slices].shape)
    return full, prepend, order


def _items(full: dict, prepend: dict, order: list[str], specs: dict, config: Any) -> list[Item]:
    items: list[Item] = []
    layer_keys = [k for k in order if k.startswith("decoder.layers.")]
    top = [k for k in order if k not in layer_keys]
    first_layer_at = order.index(layer_keys[0]) if layer_keys else len(order)
    for key in [k for k in top if order.index(k) < first_layer_at]:
        items += _top_items(key, full, prepend, specs, config)
    n_layers = full[layer_keys[0]].shape[0] if layer_keys else 0
    for i in range(n_layers):
        for key in layer_keys:
            generic = key[len("decoder.layers."):]
            module, _, local = generic.rpartition(".")
            if local == "weight" and module in LINEARS:
                experts = range(full[key].shape[1]) if prepend[key] == 2 else [None]
                for e in experts:
                    items += _linear_items("decoder.layers.", (i,), e, module, full, prepend, specs, config)
            elif local == "bias" and module in LINEARS:
                continue  # with its weight, split as the weight is
            elif not generic.endswith("._amax"):
                if prepend[key] != 1:
                    raise ExportError(f"{key}: no Megatron export mapping for a tensor of {prepend[key]} stacked axes")
                # (a tensor no family names keeps its Megatron name: only with a caller's hf_config, see megatron_hf_config)
                items.append(_passthrough(f"model.layers.{i}.{hf_layer_name(generic)}", full[key][i]))
    for key in [k for k in top if order.index(k) > first_layer_at]:
        items += _top_items(key, full, prepend, specs, config)
    return items


def _top_items(key: str, full: dict, prepend: dict, specs: dict, config: Any) -> list[Item]:
    if key == "output_layer.weight":  # quantized or not, under lm_head
        return _linear_items("", (), None, "output_layer", full, prepend, specs, config)
    if key.endswith("._amax"):
        return []
    return [_passthrough(TOP_NAMES.get(key, key), full[key])]


def _passthrough(name: str, t: torch.Tensor) -> Item:
    module, _, local = name.rpartition(".")
    return Item(module, "unquantized", module, extras={local: (lambda t=t: t)}, parent=module.rpartition(".")[0],
                leaf=module.rpartition(".")[2])


def _linear_items(prefix: str, layer: tuple, e: Optional[int], module: str, full: dict, prepend: dict, specs: dict,
                  config: Any) -> list[Item]:  # fmt: skip
    """The HF modules of Megatron linear ``prefix + module`` (of layer ``layer``, a 1-tuple, or () at the top),
    q / k / v and gate / up split, with their biases."""
    index = layer if e is None else (*layer, e)
    w = full[f"{prefix}{module}.weight"][index]
    bias = full.get(f"{prefix}{module}.bias")
    bias = None if bias is None else bias[index]
    hf = hf_linear(module, e)
    hf = f"model.layers.{layer[0]}.{hf}" if layer else hf
    spec = specs.get((layer[0] if layer else None, module, e))
    out = []
    for leaf, idx, shard in split_rows(module, w.shape[0], config):
        name = f"{hf}.{leaf}" if leaf else hf
        get: Callable[[], torch.Tensor] = lambda w=w, idx=idx: w[idx]  # noqa: E731
        extras = {} if bias is None else {"bias": (lambda b=bias, idx=idx: b[idx])}
        if spec is None:
            out.append(Item(name, "unquantized", name, extras={"weight": get, **extras}, expert=e, parent=hf, leaf=leaf))
            continue
        wspec, ispec, where, where_q = spec
        amax = full.get(f"{prefix}{module}.weight_quantizer._amax")
        amax = None if amax is None else amax[index]
        ikey = f"{prefix}{module}.input_quantizer._amax"
        iamax = full.get(ikey)
        # a grouped linear's input quantizer is one per layer (no expert axis), SequentialMLP's one per expert
        iamax = None if iamax is None or ispec is None else iamax[index[: prepend[ikey]]]
        part = select_rows(amax, wspec, w.shape[0], idx, where_q)
        out.append(Item(name, "expert" if e is not None else "linear", where_q, get, wspec, part, ispec, iamax, extras, expert=e,
                        shard=shard, parent=hf if leaf else hf.rpartition(".")[0], leaf=leaf or name.rpartition(".")[2],
                        shape=(len(idx), w.shape[1]), fused=f"model.layers.{layer[0]}.mlp.experts" if e is not None else "",
                        input_where=f"{where}.input_quantizer"))  # fmt: skip
    return out


def _kv_items(model: nn.Module, packer: Packer) -> tuple[dict[int, KVItem], Optional[FormatSpec]]:
    """This rank's KV items by global layer, under HF names, and their spec. Every rank holds the same KV
    quantizer settings and (MAX-reduced over TP) amax, so a refusal raises on every rank before the gather."""
    items, spec = plan_kv(model, packer, MEGATRON_GPT)
    out = {}
    for kv in items:
        layer = int(model.get_submodule(kv.where).layer_number) - 1  # Megatron's layer_number: global, from 1
        kv.name = f"model.layers.{layer}.self_attn"
        out[layer] = kv
    return out, spec


def export_megatron_checkpoint(model: nn.Module, out_dir: str, format: Union[ExportFormat, str], *,
                               group: Optional[dist.ProcessGroup] = None, overwrite: bool = False,
                               max_shard_size: Union[int, str] = "5GB", hf_config: Optional[dict] = None,
                               unify_siblings: bool = False) -> Optional[ExportManifest]:  # fmt: skip
    """Collective over ``group`` (default: the world): gather the sharded model to rank 0, which checks
    and writes ``out_dir``; returns the manifest on rank 0, None elsewhere. ``model`` may be wrapped
    (Float16Module, DistributedDataParallel): the wrapped GPTModel is exported. config.json is that of the
    transformers family the model matches (:func:`~quantlib.export.megatron_config.megatron_hf_config`; a model
    none matches is refused) or, given, ``hf_config``'s entries, plus ``quantization_config``."""
    from quantlib import __version__

    from ..plugins.megatron_state import unwrap_megatron  # (imports Megatron)

    # every rank checks its arguments before the gather, so a bad one fails everywhere, not on rank 0 alone
    check_arguments(out_dir=out_dir, overwrite=overwrite, unify_siblings=unify_siblings)
    if hf_config is not None and not isinstance(hf_config, dict):
        raise ExportError(f"hf_config={hf_config!r} ({type(hf_config).__name__}): expected a dict of config.json entries or None")
    limit = parse_size(max_shard_size)
    fmt = as_format(format)
    packer = get_packer(fmt)
    model = unwrap_megatron(model)
    kv, kv_spec = _kv_items(model, packer)
    # every rank derives it (from the config they share), so a model no transformers family matches fails everywhere
    config = megatron_hf_config(model) if hf_config is None else dict(hf_config)
    pieces = _pieces(model)
    specs = _specs(model)
    gathered = gather_objects((pieces, specs, kv), group)
    if gathered is None:  # not the group's first rank
        return None
    all_specs: dict = {}
    all_kv: dict[int, KVItem] = {}
    for _, s, k in gathered:
        all_specs.update(s)
        for layer, item in k.items():
            all_kv.setdefault(layer, item)  # TP ranks hold the same amax: the first rank's (rank 0's) is kept
    full, prepend, order = _assemble([p for p, _, _ in gathered])
    items = _items(full, prepend, order, all_specs, model.config)
    plan = check_items(items, packer, MEGATRON_GPT, unify_siblings=unify_siblings, version=__version__, what=type(model).__name__)
    plan.kv, plan.info.kv_spec = [all_kv[i] for i in sorted(all_kv)], kv_spec
    return write_plan(plan, fmt, out_dir, config, overwrite=overwrite, limit=limit, progress=False)
