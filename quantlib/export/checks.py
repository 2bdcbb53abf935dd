"""Checks of a model's structure against its layout, made before anything is packed: fused sibling
groups quantized whole, leaves the layout can name, tied weights, experts a checkpoint keeps fused."""

from __future__ import annotations

from typing import Callable, Optional

from torch import nn

from ..formats import FormatSpec, Kind
from ..formats.spec import describe
from ..nn.bypass import read_directly
from ..nn.quant_module import QuantModule
from ..nn.tensor_quantizer import TensorQuantizer
from .fold_experts import fused_experts_class
from .hf_names import STORED_FUSED
from .items import child, pre_quant_scale_of
from .layouts import ModelLayout
from .modules import ModuleWalk
from .types import ExportError

_HOW = ("pass export_checkpoint(..., layout=quantlib.export.ModelLayout(name, siblings=((...), ...), shards={...}, column=..., row=...)) "
        "or register it once with quantlib.export.register_layout(config.model_type, layout)")


def _weight_quantizer(module: nn.Module):
    q = module._modules.get("weight_quantizer")
    return q if type(q) is TensorQuantizer or isinstance(q, TensorQuantizer) else None


def _linears(walk: ModuleWalk) -> list[tuple[str, nn.Module, bool]]:
    """(name, module, weight quantizer enabled) of each linear: a quantized module with a 2-D weight of its
    own, or an ``nn.Linear`` left unconverted (never quantized)."""
    out = []
    for name, module, quant in walk.linears:
        if not quant:
            out.append((name, module, False))
            continue
        w = module._parameters.get("weight")
        if w is not None and w.dim() == 2:
            q = _weight_quantizer(module)
            if q is not None:
                out.append((name, module, q.is_enabled))
    return out


def _in_features(module: QuantModule) -> int:
    # the weight as its quantizer sees it, (out, in) (GPT-2's Conv1D stores (in, out))
    return next(iter(module.weight_groups()))[1][0].shape[1]


def check_structure(walk: ModuleWalk, layout: ModelLayout, what: str,
                    shares_global: Optional[Callable[[FormatSpec, Optional[FormatSpec]], bool]] = None) -> None:
    """Refuse a fused sibling group quantized only in part (vLLM refuses it at load: "some but not all
    shards are quantized"), leaves the layout cannot name, and a quantized weight tied to another module.
    ``shares_global``: whether the format's consumers fuse siblings of a scheme under one scale
    (:meth:`~quantlib.export.writers.base.Packer.shares_global`); linears whose fusion is unknown pass where none would
    share one (None: refused whatever the format)."""
    linears = _linears(walk)
    _refuse_indexer(linears)
    _refuse_read_directly(walk.modules)
    structure = layout.structure
    if structure is not None and structure.read:
        _refuse_read_in_probe(linears, structure.read)
    groups: dict[tuple[str, tuple], list[tuple[str, bool]]] = {}
    unknown: dict[tuple[str, int], list[str]] = {}
    # what the layout can name: its standalone leaves and its siblings' (a leaf in no group is known if standalone)
    standalone = layout.standalone
    seen = structure.seen if structure is not None else frozenset()
    group_of: dict[str, Optional[tuple[str, ...]]] = {}  # a model repeats a handful of leaf names
    for name, module, enabled in linears:
        parent, _, leaf = name.rpartition(".")
        if name in seen:  # the probe saw it: its group is what one input and the layout's names make it
            group = structure.group_of(name)
        else:
            group = group_of[leaf] if leaf in group_of else group_of.setdefault(leaf, layout.sibling_group(leaf))
        if group is not None:
            groups.setdefault((parent, group), []).append((name, enabled))
        elif standalone is not None and enabled and leaf not in standalone and name not in seen:
            # not probed (weights on meta): only linears that read inputs of one width can be fused into one GEMM
            unknown.setdefault((parent, _in_features(module)), []).append(name)
    for (_parent, group), members in groups.items():
        on = [n for n, e in members if e]
        off = [n for n, e in members if not e]
        if on and off:
            raise ExportError(f"{off[0]}: not quantized (its weight quantizer is off, or it has none) but its fused siblings {on} are; "
                              f"consumers fuse {group} into one GEMM "
                              "and refuse a group quantized in part (vLLM: 'some but not all shards are quantized'): quantize the whole "
                              "group or none of it")
    enabled_names = {n for n, _, e in linears if e}
    candidates = list(unknown.values())
    for part in structure.unknown if structure is not None else ():  # one parent, one input, a leaf no layout names
        on = [n for n in part if n in enabled_names]
        if any(layout.sibling_group(leaf) is None and leaf not in standalone for leaf in (n.rpartition(".")[2] for n in on)):
            candidates.append(on)
    modules = {n: m for n, m, _ in linears} if shares_global is not None and any(len(names) > 1 for names in candidates) else {}
    for names in candidates:
        if len(names) > 1 and not (modules and _self_scaled([modules[n] for n in names], shares_global)):
            how = "read one input in the probe forward" if names[0] in seen else "read inputs of one width"
            raise ExportError(f"{what} (layout {layout.name}): quantlib cannot tell whether consumers fuse {names} (they {how}, and "
                              "quantlib does not know all their leaf names); "
                              f"fused siblings need one global scale, so say which are: {_HOW}")
    if walk.tied:  # else no weight has a second owner
        _refuse_tied(walk.modules)


def _self_scaled(members: list[nn.Module], shares_global: Callable[[FormatSpec, Optional[FormatSpec]], bool]) -> bool:
    """Whether ``members`` are quantized alike in a scheme whose every scale is a member's own (MX, FP8 blocks, INT groups;
    no static input scale, no pre_quant_scale): written whole per member, they are exact whether or not a consumer fuses them."""
    schemes = set()
    for m in members:
        q, inp = _weight_quantizer(m), child(m, "input_quantizer")
        ispec = inp.spec if isinstance(inp, TensorQuantizer) and inp.is_enabled else None
        if q is None or pre_quant_scale_of(inp) is not None or shares_global(q.spec, ispec):
            return False
        schemes.add((q.spec, ispec))
    return len(schemes) == 1


def _refuse_read_directly(modules: list[tuple[str, nn.Module]]) -> None:
    """A quantized linear whose parent reads its weight directly (:func:`quantlib.nn.bypass.read_directly`) computes
    unquantized in the model but would be written quantized: what was calibrated and evaluated is not what would be served."""
    for name, module in modules:
        child_name = read_directly(module)
        child = module._modules.get(child_name) if child_name is not None else None
        q = _weight_quantizer(child) if child is not None else None
        if q is not None and q.is_enabled:
            raise ExportError(f"{name}.{child_name}.weight_quantizer is enabled, but {type(module).__name__} reads {child_name}.weight "
                              f"directly, not through {child_name}'s forward: the model computes with the unquantized weight, so a "
                              f"quantized one would not be the model you calibrated; disable it (quantlib.disable_quantizer(model, "
                              f"'*{child_name}*'))")


def _refuse_read_in_probe(linears: list[tuple[str, nn.Module, bool]], read: dict[str, str]) -> None:
    """A quantized linear whose weight the structure probe saw computed with outside its own forward (by any module:
    :class:`~quantlib.export.structure.Structure` ``read``): the model runs it unquantized there."""
    for name, _, enabled in linears:
        reader = read.get(name)
        if enabled and reader is not None:
            raise ExportError(f"{name}.weight_quantizer is enabled, but {reader or 'the model'} computes with {name}.weight outside "
                              f"{name}'s forward (found in the structure probe), so the model uses the unquantized weight there and a "
                              f"quantized one would not be the model you calibrated; disable it (quantlib.disable_quantizer(model, "
                              f"'*{name.rpartition('.')[2]}*'))")


def _indexer_wk_loads(spec: FormatSpec) -> bool:
    # vLLM dequantizes an indexer wk stored as E4M3 codes with per-row or 2-D block scales (bf16 or E8M0)
    return spec.kind in (Kind.FP8_BLOCK, Kind.MX) and spec.element == (4, 3)


def _refuse_indexer(linears: list[tuple[str, nn.Module, bool]]) -> None:
    """DeepSeek sparse attention's indexer (DeepSeek-V3.2, GLM-5): vLLM runs ``wk`` and ``weights_proj`` as one
    unquantized GEMM (``wk_weights_proj``); it loads ``weights_proj`` in bf16 only and dequantizes ``wk`` only from
    E4M3 codes with block scales. Anything else it would read as plain numbers or fail on, so it is refused here."""
    for name, module, enabled in linears:
        parent, _, leaf = name.rpartition(".")
        if not enabled or leaf not in ("wk", "weights_proj") or parent.rpartition(".")[2] != "indexer":
            continue
        spec = module.weight_quantizer.spec
        if leaf == "wk" and _indexer_wk_loads(spec):
            continue
        held = "only unquantized (bf16)" if leaf == "weights_proj" else "dequantized from E4M3 codes with 128x128 or MXFP8 scales only"
        raise ExportError(f"{name}.weight_quantizer is enabled ({spec.kind.value}), but the sparse-attention indexer's {leaf} is loaded "
                          f"{held}: vLLM fuses {parent}.wk and .weights_proj into one unquantized GEMM (wk_weights_proj); "
                          f"disable it (quantlib.disable_quantizer(model, '*indexer.{leaf}*'))")


def _refuse_tied(modules: list[tuple[str, nn.Module]]) -> None:
    # the checkpoint holds a tied tensor once, under its first module's name: a quantized second owner
    # would be written unquantized (or the first one quantized for both)
    first: dict[int, tuple[str, nn.Module]] = {}
    for name, module in modules:
        w = module._parameters.get("weight")
        if w is None:
            continue
        owner, owner_module = first.setdefault(id(w), (name, module))
        if owner == name:
            continue
        for n, m in ((owner, owner_module), (name, module)):
            q = _weight_quantizer(m)
            if q is not None and q.is_enabled:
                raise ExportError(f"{n}.weight_quantizer is enabled but {name}.weight is tied to {owner}.weight (tie_word_embeddings): a "
                                  "checkpoint holds "
                                  "the tensor once, so one of them would load unquantized; disable the quantizer "
                                  f"(quantlib.disable_quantizer(model, '*{n.rpartition('.')[2]}*')) "
                                  "or untie the weights before quantizing")


def stored_fused(module: nn.Module, name: str, layout: ModelLayout, carried: bool = False) -> bool:
    """Whether the checkpoint keeps ``module``'s fused experts as they are (3-D, e.g. GPT-OSS's interleaved
    ``gate_up_proj``): then they are written whole, and quantized ones are refused unless the format
    ``carried`` them (``openai_mxfp4``)."""
    projs = layout.experts.get(name, {})
    if STORED_FUSED not in projs.values():
        return False
    for proj in [] if carried else module.projections:
        q = module._modules.get(f"{proj}_weight_quantizer")
        if q is not None and any(m.is_enabled for m in q.members()):
            raise ExportError(f"{name}.{proj}_weight_quantizer: transformers' {layout.name} checkpoint keeps {name}.{proj} as one 3-D "
                              "tensor (as the model holds it, e.g. GPT-OSS's interleaved gate/up, or rearranged on save, e.g. "
                              "GraniteMoE's input_linear), and only format openai_mxfp4 (MXFP4, OpenAI's GPT-OSS checkpoint) carries "
                              "quantized 3-D experts: export in it, or disable it (quantlib.disable_quantizer(model, '*experts*'))")
    return True


def whole_experts_off(modules: ModuleWalk, layout: ModelLayout) -> list[str]:
    """Experts modules left unquantized that the checkpoint holds whole, 3-D (Llama-4's, GPT-OSS's kept, GraniteMoE's
    rearranged), not per expert: consumers build one MoE layer of them under the module's name and look for that name, or
    its experts' (vLLM's compressed-tensors: ``<m>.0.gate_proj``), in the ignore list; unlisted, they load as quantized."""
    fused_cls, out = fused_experts_class(), []
    for name, module, _, quant in modules.entries:
        qnames = getattr(module, "weight_quantizer_names", ())
        if not quant or qnames in ((), ("weight_quantizer",)):
            continue
        if isinstance(module, fused_cls) and not stored_fused(module, name, layout, carried=True):
            continue  # written per expert, each expert's modules listed under its checkpoint names
        if not any(q is not None and q.is_enabled for q in (child(module, n) for n in qnames)):
            out.append(name)
    return out


def refuse_unwritten(module: nn.Module, name: str) -> None:
    """Refuse, by name, a quantized module whose weights the export would write unquantized: one that holds them
    under names of its own (e.g. Llama-4's ``Llama4TextExperts``: ``gate_up_proj`` / ``down_proj``, 3-D (E, in, out))
    with an enabled weight quantizer, which no format here lays out; its checkpoint would load with other weights
    than the quantized model computes with."""
    for qname in getattr(module, "weight_quantizer_names", ()):
        q = child(module, qname)
        if q is not None and q.is_enabled:  # a container: any member
            params = ", ".join(f"{k} {tuple(p.shape)}" for k, p in module.named_parameters(recurse=False))
            raise ExportError(f"{name}.{qname} is enabled, and the export has no layout for a quantized {type(module).__name__} "
                              f"({params}): its weights would be written unquantized, unlike the model's. Disable its quantizers "
                              f"(quantlib.disable_quantizer(model, '*{name.rpartition('.')[2]}*')) to export them unquantized")


#: config.model_type -> the projections whose rows vLLM's loader interleaves within each head for its rotary embedding
#: (its Llama-4 ``permute_qk_weight_for_rotary``: the weight's rows, and a ``weight_scale`` with one row per weight row)
ROTARY_PERMUTED = {"llama4": ("q_proj", "k_proj"), "llama4_text": ("q_proj", "k_proj")}
#: formats whose 2-D block scale vLLM tries to permute as if it had a row per weight row (it fails at load)
_SCALE_PERMUTED = ("ct_fp8_block", "modelopt_fp8_pb")


def refuse_permuted_blocks(items: list, packer, model: nn.Module) -> None:
    """Refuses q / k weights of a family whose vLLM loader interleaves each head's rows (Llama-4) in 2-D block scales it
    cannot follow: a head wider than a block moves rows into another block's scale (silently wrong), and the formats
    whose block scale it permutes too fail at load."""
    cfg = getattr(model, "config", None)
    leaves = ROTARY_PERMUTED.get(getattr(cfg, "model_type", None), ())
    if not leaves:
        return
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    for it in items:
        spec = it.spec
        if it.leaf not in leaves or spec is None or spec.block is None or len(spec.block) != 2:
            continue
        fmt = packer.member_for(spec).fmt.value
        if spec.block[0] % head_dim:
            why = f"a head of {head_dim} rows spans {spec.block[0]}-row blocks, so rows would move under another block's scale"
        elif fmt in _SCALE_PERMUTED:
            why = f"it permutes {fmt}'s block scale as if it had a row per weight row, and fails at load"
        else:
            continue
        raise ExportError(f"{it.where} = {describe(spec)}: vLLM's loader of config.model_type {cfg.model_type!r} interleaves the rows "
                          f"of each head of {'/'.join(leaves)} for its rotary embedding, and {why}; quantize {it.leaf} per row (MX, NVFP4, "
                          "INT, FP8 per channel) or in hf_fp8_block with blocks a whole number of heads, or disable it")
