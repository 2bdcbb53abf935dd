"""Export of a Megatron-Core ``GPTModel`` (local or TE spec; SequentialMLP or TEGroupedMLP experts) sharded over TP / EP /
DP, under Hugging Face Llama / Qwen3-MoE names. Gathered, not written per rank: every rank sends its
shards of ``model.sharded_state_dict()`` (global keys, shapes and offsets; quantlib's plugin stores amax
there in their global form, per global expert) to rank 0, which assembles each global tensor and packs
it with its global amax exactly as at TP1. The export then cannot depend on the layout the model ran
at, and the consumer's tensors come whole: a rank's rows of ``linear_qkv`` interleave q, k and v per
query group and its gate / up halves of ``linear_fc1`` are separate slices, which per-rank pieces
would not tile. Rank 0 holds one copy of the model's weights while it writes.
KV-cache scales (``core_attention.k_bmm_quantizer`` / ``v_bmm_quantizer``) are written as the
transformers export writes them, under ``model.layers.{i}.self_attn``; their amax are MAX-reduced over
TP by calibration, so rank 0's are every rank's.
"""

from __future__ import annotations

from typing import Any, Callable, Optional, Union

import torch
import torch.distributed as dist
from torch import nn

from ..formats import FormatSpec
from ..nn.containers import GroupedQuantizer
from ..nn.quant_module import QuantModule
from ..nn.tensor_quantizer import TensorQuantizer
from .export_checkpoint import check_arguments, parse_size, write_plan
from .kv_plan import KVItem, plan_kv
from .layouts import ModelLayout
from .plan import Item, check_items, module_quantizers, refuse_pre_quant_scale
from .types import ExportError, ExportFormat, ExportManifest
from .writers import Packer, as_format, packer as get_packer

#: HF names of a decoder layer's tensors, by Megatron key (after ``decoder.layers.``)
_LAYER_NAMES = {
    "self_attention.linear_qkv.layer_norm_weight": "input_layernorm.weight",
    "self_attention.linear_qkv.layer_norm_bias": "input_layernorm.bias",
    "input_layernorm.weight": "input_layernorm.weight",
    "input_layernorm.bias": "input_layernorm.bias",
    "self_attention.q_layernorm.weight": "self_attn.q_norm.weight",
    "self_attention.k_layernorm.weight": "self_attn.k_norm.weight",
    "mlp.linear_fc1.layer_norm_weight": "post_attention_layernorm.weight",
    "mlp.linear_fc1.layer_norm_bias": "post_attention_layernorm.bias",
    "pre_mlp_layernorm.weight": "post_attention_layernorm.weight",
    "pre_mlp_layernorm.bias": "post_attention_layernorm.bias",
    "mlp.router.weight": "mlp.gate.weight",
}
_TOP_NAMES = {
    "embedding.word_embeddings.weight": "model.embed_tokens.weight",
    "decoder.final_layernorm.weight": "model.norm.weight",
    "decoder.final_layernorm.bias": "model.norm.bias",
    "output_layer.weight": "lm_head.weight",
}
#: quantized linears: Megatron module (after ``decoder.layers.``) -> HF module (with {e} for experts)
_LINEARS = {
    "self_attention.linear_qkv": "self_attn",
    "self_attention.linear_proj": "self_attn.o_proj",
    "mlp.linear_fc1": "mlp",
    "mlp.linear_fc2": "mlp.down_proj",
    "mlp.experts.experts.linear_fc1": "mlp.experts.{e}",
    "mlp.experts.experts.linear_fc2": "mlp.experts.{e}.down_proj",
}
#: what consumers fuse: q/k/v and gate/up (they come from one Megatron quantizer, so share its amax)
MEGATRON_GPT = ModelLayout(
    "megatron_gpt",
    siblings=(("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj")),
    shards={"q_proj": "q", "k_proj": "k", "v_proj": "v", "gate_proj": 0, "up_proj": 1},
)


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
    module name, weight quantizer name) of each enabled quantized linear (or grouped GEMM) of this rank."""
    out = {}
    for name, module in model.named_modules():
        if not isinstance(module, QuantModule) or not name.startswith("decoder.layers."):
            continue
        refuse_pre_quant_scale(module_quantizers(module, name))
        q = getattr(module, "weight_quantizer", None)
        if q is None or not q.is_enabled:
            continue
        parts = name.split(".")
        layer, rest = int(parts[2]), parts[3:]
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


def _qkv_rows(config: Any) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Row indices of q, k and v in Megatron's ``linear_qkv`` (per query group: its q heads, then k, then v)."""
    heads = config.num_attention_heads
    groups = config.num_query_groups or heads
    hn = config.kv_channels or config.hidden_size // heads
    per = heads // groups
    q, k, v = [], [], []
    for g in range(groups):
        base = g * (per + 2) * hn
        q.append(torch.arange(base, base + per * hn))
        k.append(torch.arange(base + per * hn, base + (per + 1) * hn))
        v.append(torch.arange(base + (per + 1) * hn, base + (per + 2) * hn))
    return torch.cat(q), torch.cat(k), torch.cat(v)


def _select(amax: Optional[torch.Tensor], spec: FormatSpec, rows: int, idx: torch.Tensor, where: str) -> Optional[torch.Tensor]:
    """The amax of rows ``idx`` of a weight of ``rows`` rows."""
    if amax is None or amax.numel() == 1:
        return amax
    if spec.block is not None and len(spec.block) == 2:
        bm = spec.block[0]
        contiguous = bool((idx[1:] - idx[:-1] == 1).all()) and int(idx[0]) % bm == 0 and len(idx) % bm == 0
        if not contiguous:
            raise ExportError(f"{where}: rows of q / k / v (or gate / up) interleave within {bm}-row blocks of the fused Megatron weight; "
                              "2-D blocks cannot be split")
        return amax[int(idx[0]) // bm : (int(idx[-1]) + 1) // bm]
    if amax.dim() >= 1 and amax.shape[0] == rows:
        return amax[idx]
    return amax


def _split(generic: str, rows: int, config: Any) -> list[tuple[str, torch.Tensor, Any]]:
    """(HF leaf, row indices, shard id) of a quantized Megatron linear."""
    everything = torch.arange(rows)
    if generic == "self_attention.linear_qkv":
        q, k, v = _qkv_rows(config)
        return [("q_proj", q, "q"), ("k_proj", k, "k"), ("v_proj", v, "v")]
    if generic.endswith("linear_fc1"):
        expert = "experts" in generic
        if getattr(config, "gated_linear_unit", False):
            half = rows // 2
            return [("gate_proj", everything[:half], "w1" if expert else 0), ("up_proj", everything[half:], "w3" if expert else 1)]
        return [("up_proj", everything, "w3" if expert else None)]
    return [("", everything, "w2" if "experts" in generic else None)]


def _items(full: dict, prepend: dict, order: list[str], specs: dict, config: Any) -> list[Item]:
    items: list[Item] = []
    layer_keys = [k for k in order if k.startswith("decoder.layers.")]
    top = [k for k in order if k not in layer_keys]
    first_layer_at = order.index(layer_keys[0]) if layer_keys else len(order)
    for key in [k for k in top if order.index(k) < first_layer_at]:
        items.append(_passthrough(_TOP_NAMES.get(key, key), full[key]))
    n_layers = full[layer_keys[0]].shape[0] if layer_keys else 0
    for i in range(n_layers):
        for key in layer_keys:
            generic = key[len("decoder.layers."):]
            module, _, local = generic.rpartition(".")
            if local == "weight" and module in _LINEARS:
                experts = range(full[key].shape[1]) if prepend[key] == 2 else [None]
                for e in experts:
                    items += _linear_items(i, e, module, full, prepend, specs, config)
            elif not generic.endswith("._amax"):
                if prepend[key] != 1:
                    raise ExportError(f"{key}: no Megatron export mapping for a tensor of {prepend[key]} stacked axes")
                items.append(_passthrough(f"model.layers.{i}.{_LAYER_NAMES.get(generic, generic)}", full[key][i]))
    for key in [k for k in top if order.index(k) > first_layer_at]:
        items.append(_passthrough(_TOP_NAMES.get(key, key), full[key]))
    return items


def _passthrough(name: str, t: torch.Tensor) -> Item:
    module, _, local = name.rpartition(".")
    return Item(module, "unquantized", module, extras={local: (lambda t=t: t)}, parent=module.rpartition(".")[0],
                leaf=module.rpartition(".")[2])


def _linear_items(i: int, e: Optional[int], module: str, full: dict, prepend: dict, specs: dict, config: Any) -> list[Item]:
    index = (i,) if e is None else (i, e)
    w = full[f"decoder.layers.{module}.weight"][index]
    hf = f"model.layers.{i}." + _LINEARS[module].format(e=e)
    spec = specs.get((i, module, e))
    out = []
    for leaf, idx, shard in _split(module, w.shape[0], config):
        name = f"{hf}.{leaf}" if leaf else hf
        get: Callable[[], torch.Tensor] = lambda w=w, idx=idx: w[idx]  # noqa: E731
        if spec is None:
            out.append(Item(name, "unquantized", name, extras={"weight": get}, expert=e, parent=hf, leaf=leaf))
            continue
        wspec, ispec, where, where_q = spec
        amax = full.get(f"decoder.layers.{module}.weight_quantizer._amax")
        amax = None if amax is None else amax[index]
        ikey = f"decoder.layers.{module}.input_quantizer._amax"
        iamax = full.get(ikey)
        # a grouped linear's input quantizer is one per layer (no expert axis), SequentialMLP's one per expert
        iamax = None if iamax is None or ispec is None else iamax[index[: prepend[ikey]]]
        out.append(Item(name, "expert" if e is not None else "linear", where_q, get, wspec, _select(amax, wspec, w.shape[0], idx, where_q),
                        ispec, iamax,
                        expert=e, shard=shard, parent=hf, leaf=leaf or name.rpartition(".")[2], shape=(len(idx), w.shape[1]),
                        fused=f"model.layers.{i}.mlp.experts",
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
    (Float16Module, DistributedDataParallel): the wrapped GPTModel is exported."""
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
    pieces = _pieces(model)
    specs = _specs(model)
    rank = dist.get_rank(group)
    gathered = [None] * dist.get_world_size(group) if rank == 0 else None
    dist.gather_object((pieces, specs, kv), gathered, dst=dist.get_global_rank(group, 0) if group is not None else 0, group=group)
    if rank != 0:
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
    return write_plan(plan, fmt, out_dir, dict(hf_config or {}), overwrite=overwrite, limit=limit, progress=False)
