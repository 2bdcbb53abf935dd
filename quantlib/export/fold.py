"""Export of SmoothQuant / AWQ models: each linear's ``pre_quant_scale`` folded into the op before it.

quantlib computes ``y = fq_in(x * p) @ fq_w(W * w)^T``: the input quantizer's ``pre_quant_scale`` ``p``
multiplies the input (``x * p.to(x.dtype)``, even when the input quantizer is disabled), the weight
quantizer's ``w`` (``1/p`` after SmoothQuant / AWQ) the weight it quantizes. The weight side is exported
as it is evaluated: the packed weight is the quantizer's own ``fq_w(W * w)``. The input side has no place
in most formats, so ``p`` goes into the op that produces ``x``, where the graph allows it exactly (up to
float rounding), as llm-compressor and ModelOpt do for vLLM:

- a norm before q/k/v or gate/up (its weight and bias times ``p``), when every consumer of the norm holds
  the same ``p``;
- v_proj's output rows before o_proj (attention output channel ``j`` is value channel ``j`` of query head
  ``j // head_dim``, whose key/value head is shared by ``heads / kv_heads`` query heads: ``p`` must agree
  across them), and up_proj's rows before down_proj (``act(gate) * up`` is linear in up; OPT's ReLU is
  positively homogeneous, so fc1 before fc2): an unquantized producer's weight rows and bias, or a
  quantized one whose scale is per output row (INT per channel or in groups along the input dim), whose
  codes stay and whose row scales take ``p``.

What folds nowhere is carried as a ``pre_quant_scale`` tensor where the format has one (ModelOpt's AWQ
formats), else refused by name. Fused MoE experts (one scale per expert) are planned per expert part by
:mod:`.fold_experts`. Nothing in the model changes: folds are applied to the export's getters.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Callable, Iterable, Optional

import torch
from torch import nn

from ..formats import Kind, QuantizedTensor
from ..kv.presets import ATTENTION_QUANTIZER_NAMES
from ..nn.containers import QuantizerContainer, SequentialQuantizer
from ..nn.quant_module import QuantModule
from ..nn.tensor_quantizer import TensorQuantizer
from .fold_experts import fused_experts_class, plan_experts
from .items import has_pqs_slot, pre_quant_scale_of
from .layouts import layout_for
from .types import ExportError


@dataclass(frozen=True)
class FoldRule:
    """``source`` produces the input of every one of ``targets`` (names below one decoder layer, or the
    model for the final norm). ``kind``: "norm" (its weight and bias scale its output), "rows" (a linear
    whose output rows feed the target channel for channel), "heads" (v_proj before o_proj)."""

    source: str
    targets: tuple[str, ...]
    kind: str


_QKV = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")
_DECODER = (
    FoldRule("input_layernorm", _QKV, "norm"),
    FoldRule("post_attention_layernorm", ("mlp.gate_proj", "mlp.up_proj"), "norm"),
    FoldRule("self_attn.v_proj", ("self_attn.o_proj",), "heads"),
    FoldRule("mlp.up_proj", ("mlp.down_proj",), "rows"),
    FoldRule("model.norm", ("lm_head",), "norm"),
)
_OPT = (
    FoldRule("self_attn_layer_norm", _QKV, "norm"),
    FoldRule("final_layer_norm", ("fc1",), "norm"),
    FoldRule("self_attn.v_proj", ("self_attn.out_proj",), "heads"),
    FoldRule("fc1", ("fc2",), "rows"),  # ReLU only (checked in rules_for): relu(x * p) = relu(x) * p for p > 0
    FoldRule("model.decoder.final_layer_norm", ("lm_head",), "norm"),
)
_NEOX = (
    FoldRule("input_layernorm", ("attention.query_key_value",), "norm"),
    FoldRule("post_attention_layernorm", ("mlp.dense_h_to_4h",), "norm"),
    FoldRule("gpt_neox.final_layer_norm", ("embed_out",), "norm"),
)
#: transformers model_type -> its rules (each norm there feeds exactly the rule's targets)
RULES: dict[str, tuple[FoldRule, ...]] = {t: _DECODER for t in ("llama", "mistral", "qwen2", "qwen3", "qwen3_moe", "mixtral", "phimoe")}
# Qwen2-MoE's shared expert reads the norm with the router and the experts: only its down_proj folds (into its up_proj)
RULES.update(opt=_OPT, gpt_neox=_NEOX, qwen2_moe=_DECODER + (FoldRule("mlp.shared_expert.up_proj", ("mlp.shared_expert.down_proj",),
                                                                     "rows"),))
#: norms whose output is ``weight * normalized (+ bias)`` (Gemma's ``(1 + weight)`` ones are not)
_NORMS = ("LlamaRMSNorm", "MistralRMSNorm", "Qwen2RMSNorm", "Qwen3RMSNorm", "Qwen3MoeRMSNorm", "Qwen2MoeRMSNorm", "MixtralRMSNorm",
          "LayerNorm")


def rules_for(model: nn.Module) -> tuple[FoldRule, ...]:
    """The fold rules of a transformers model by its ``config.model_type`` (none for other models)."""
    cfg = getattr(model, "config", None)
    rules = RULES.get(getattr(cfg, "model_type", None), ())
    if rules is _OPT:
        if not getattr(cfg, "do_layer_norm_before", True):
            return ()  # post-LN: the norms sit after the linears
        if getattr(cfg, "activation_function", "relu") != "relu":
            rules = tuple(r for r in rules if r.kind != "rows")
    return rules


@dataclass
class Folds:
    """What the export does with every ``pre_quant_scale`` (keyed by module name)."""

    weight: dict[str, torch.Tensor] = field(default_factory=dict)  # the weight quantizer's scale of its input columns
    out: dict[str, torch.Tensor] = field(default_factory=dict)  # a producer's output channels times this
    carried: dict[str, torch.Tensor] = field(default_factory=dict)  # written as the module's pre_quant_scale

    def apply(self, items: list, moved: Iterable[str] = ()) -> None:
        """Rewrite the getters of the plan's items (:class:`~quantlib.export.items.Item`) by these folds; a fold that no
        item takes (its module written under keys of another module's, :mod:`.moved`, takes it at its source) would be
        lost, so it is an error."""
        planned = set(self.out) | set(self.carried)
        for it in items:
            # an expert's part by quantlib's name (fold_experts.part_name), as its folds are planned
            name = it.part if it.expert is not None else f"{it.parent}.{it.leaf}" if it.parent else it.leaf
            planned.discard(name)
            for m in it.members:  # a fold changes one member's rows or columns alone: not written into a key of several
                if m in self.weight or m in self.out or m in self.carried:
                    raise ExportError(f"{m}.input_quantizer: a pre_quant_scale (SmoothQuant / AWQ) folds into {m}, which the checkpoint "
                                      f"saves within {it.name} of several modules; quantlib folds no scale into such a key: calibrate it "
                                      "with 'max' or 'mse'")
            if name in self.weight and it.spec is not None:
                it.pre = lambda w, p=self.weight[name]: w * p.to(w.device, w.dtype)  # the weight quantizer's own pre_scale, bit for bit
            if name in self.out:
                p = self.out[name]
                if it.spec is not None:
                    it.post = lambda q, p=p: scale_rows(q, p)
                for k in ("weight", "bias"):
                    if k in it.extras:
                        it.extras[k] = times_rows(it.extras[k], p)
            if name in self.carried:
                p = self.carried[name]
                it.extras["pre_quant_scale"] = lambda p=p: p.detach()
        lost = planned.difference(moved)
        if lost:
            raise ExportError(f"{min(lost)}: a pre_quant_scale folds into it, but the export writes it nowhere")


def times_rows(get: Callable[[], torch.Tensor], p: torch.Tensor) -> Callable[[], torch.Tensor]:
    """``get()`` times ``p`` along its first dim (output channels), in fp32."""

    def scaled() -> torch.Tensor:
        t = get()
        shape = (-1,) + (1,) * (t.dim() - 1)
        return (t.float() * p.float().to(t.device).reshape(shape)).to(t.dtype)

    return scaled


def scale_rows(q: QuantizedTensor, p: torch.Tensor) -> QuantizedTensor:
    """INT codes with row ``r``'s scales taking ``p[r]``: quantlib divides by ``s``, so ``s / p``."""
    s = q.scale.float()
    rows = q.shape[0]
    scaled = (s.reshape(rows, -1) / p.float().to(s.device).reshape(rows, 1)).reshape(s.shape)
    return replace(q, scale=scaled)


def _leaves(q: Optional[nn.Module]) -> list[TensorQuantizer]:
    if isinstance(q, TensorQuantizer):
        return [q]
    return list(q.leaves()) if isinstance(q, QuantizerContainer) else []


def holds_pre_quant_scale(module: QuantModule) -> bool:
    """Whether any quantizer of ``module`` holds a ``pre_quant_scale`` (asked of every quantized module of
    every export: a plain quantizer is answered from its dicts, without a lookup or a list)."""
    for q in module._modules.values():
        if type(q) is TensorQuantizer:
            if has_pqs_slot(q):
                return True
        elif isinstance(q, QuantizerContainer) and any(has_pqs_slot(leaf) and leaf.pre_quant_scale is not None for leaf in q.leaves()):
            return True  # (every expert's quantizer of a fused-experts module: no list and no call per leaf)
        elif isinstance(q, TensorQuantizer) and pre_quant_scale_of(q) is not None:
            return True
    return False


@dataclass
class _Linear:
    """A linear's effective scales as its forward applies them."""

    module: QuantModule
    input: Optional[torch.Tensor]  # multiplies the input (None: nothing)
    weight: Optional[torch.Tensor]  # multiplies the weight the weight quantizer quantizes


def _effective(name: str, module: QuantModule) -> _Linear:
    """A plain linear's scales, or ExportError naming a quantizer whose scale has no linear reading."""
    iq, wq = module._modules.get("input_quantizer"), module._modules.get("weight_quantizer")
    w = getattr(module, "weight", None)
    first = wq[0] if isinstance(wq, SequentialQuantizer) else wq  # a chain (W4A8) scales the weight in its first member
    plain = isinstance(iq, TensorQuantizer) and isinstance(first, TensorQuantizer) and isinstance(w, torch.Tensor) and w.dim() == 2
    for qn in module.quantizer_names:
        for leaf in _leaves(module._modules.get(qn)):
            p = pre_quant_scale_of(leaf)
            if p is not None and not (plain and (qn == "input_quantizer" or leaf is first)):
                raise ExportError(f"{name}.{qn}: pre_quant_scale of shape {tuple(p.shape)} is set on a {type(module).__name__}, which "
                                  "export can fold only for plain linears (input and weight quantizer)")
    if module.quantizers_off():
        return _Linear(module, None, None)  # the original forward: no scale applies
    pin = pre_quant_scale_of(iq)
    if pin is not None and pin.dim() != 1:
        raise ExportError(f"{name}.input_quantizer: pre_quant_scale of shape {tuple(pin.shape)} (one row per expert); export folds 1-D "
                          "scales only")
    # a disabled weight quantizer returns the weight untouched (QuantModule.quantize_weight)
    return _Linear(module, pin, pre_quant_scale_of(first) if wq.is_enabled else None)


def plan_folds(model: nn.Module, modules: list[tuple[str, nn.Module]], carries: bool, fmt: str,
               quantized: Optional[list[tuple[str, nn.Module]]] = None) -> Folds:
    """Where each ``pre_quant_scale`` of ``model`` goes (``modules``: its named modules; ``quantized``: those
    of them that may be QuantModules, in order, where the caller knows); ``carries``: the format writes
    ``pre_quant_scale`` tensors. Raises ExportError naming what neither can express."""
    folds = Folds()
    linears: dict[str, _Linear] = {}
    experts = fused_experts_class()
    for name, m in modules if quantized is None else quantized:
        if isinstance(m, QuantModule) and holds_pre_quant_scale(m):
            if isinstance(m, experts):
                for mine, theirs in zip((folds.weight, folds.out, folds.carried), plan_experts(name, m, carries, fmt)):
                    mine.update(theirs)
                continue
            linears[name] = lin = _effective(name, m)
            if lin.weight is not None:
                folds.weight[name] = lin.weight
    pending = {n for n, lin in linears.items() if lin.input is not None}
    if not pending:
        return folds
    by_name = dict(modules)
    rules = rules_for(model)
    for name in [n for n, _ in modules if n in pending]:  # in module order: a group folds at its first member
        if name not in pending:
            continue  # folded with a sibling
        rule, prefix = _rule(rules, name)
        why = "no fold rule for this module" if rule is None else None
        if rule is not None:
            targets = [prefix + t for t in rule.targets]
            why = _fold(folds, rule, prefix + rule.source, targets, by_name, linears, model)
            if why is None:
                pending -= set(targets)
                continue
        if not carries:
            raise ExportError(f"{name}.input_quantizer: pre_quant_scale is set (SmoothQuant / AWQ) and cannot be folded into the op before "
                              f"it ({why}); format {fmt} "
                              "has no pre_quant_scale tensor: export to a ModelOpt AWQ format, or calibrate this module with 'max'")
        if not linears[name].module.weight_quantizer.is_enabled:  # an excluded module's extra tensor would be ignored
            raise ExportError(f"{name}.input_quantizer: pre_quant_scale is set and folds nowhere ({why}), and the module is left "
                              "unquantized, "
                              f"where format {fmt} has no pre_quant_scale")
        folds.carried[name] = linears[name].input
        pending.discard(name)
    return folds


def _rule(rules: tuple[FoldRule, ...], name: str) -> tuple[Optional[FoldRule], str]:
    for rule in rules:
        for t in rule.targets:
            if name == t or name.endswith("." + t):
                return rule, name[: len(name) - len(t)]
    return None, ""


def _fold(folds: Folds, rule: FoldRule, source: str, targets: list[str], by_name: dict, linears: dict[str, _Linear],
          model: nn.Module) -> Optional[str]:
    """Record the fold of ``targets``' common input scale into ``source``; else why it cannot be done."""
    missing = [t for t in targets if t not in by_name]
    if source not in by_name or missing:
        return f"{source} or {missing} is not in the model"
    scales = [linears[t].input if t in linears else None for t in targets]
    if any(s is None for s in scales):
        return f"{source} also feeds {[t for t, s in zip(targets, scales) if s is None]}, which hold no pre_quant_scale"
    first = scales[0]
    for t, s in zip(targets[1:], scales[1:]):
        if s.dtype != first.dtype or not torch.equal(s, first):
            return f"{source} feeds {targets[0]} and {t}, whose pre_quant_scales differ"
    src = by_name[source]
    if rule.kind == "norm":
        if type(src).__name__ not in _NORMS:
            return f"{source} is a {type(src).__name__}, not a norm known to compute weight * normalized"
        folds.out[source] = first
        return None
    if source in folds.out:
        return f"{source} already takes another scale"
    p = first
    if rule.kind == "heads":
        p = _kv_rows(first, src, by_name[targets[0]], model)
        if isinstance(p, str):
            return p
        attn = by_name.get(source.rpartition(".")[0])
        kv = [qn for qn in ATTENTION_QUANTIZER_NAMES if isinstance(getattr(attn, qn, None), TensorQuantizer)
              and getattr(attn, qn).is_enabled]
        if kv:
            return f"the KV cache is quantized ({kv}): v scaled per channel would not match its amax"
    why = _rows_ok(source, src, p)
    if why is None:
        folds.out[source] = p
    return why


def _kv_rows(p: torch.Tensor, v: nn.Module, o: nn.Module, model: nn.Module) -> "torch.Tensor | str":
    """v_proj's row scales for o_proj's input scale ``p``: channel ``d`` of query head ``h`` reads kv head
    ``h // (heads / kv_heads)`` (transformers' ``repeat_kv``), so every query head of a group needs one scale."""
    v_rows, o_cols = v.weight.shape[0], o.weight.shape[1]
    head_dim = _head_dim(model, o)
    if not head_dim or v_rows % head_dim or o_cols % head_dim or (o_cols // head_dim) % (v_rows // head_dim):
        return f"head layout unknown (v rows {v_rows}, o columns {o_cols}, head_dim {head_dim})"
    kv = v_rows // head_dim
    grouped = p.reshape(kv, o_cols // head_dim // kv, head_dim)
    if not bool((grouped == grouped[:, :1]).all()):
        return (f"the query heads sharing a key/value head ({o_cols // v_rows} per group) have different scales, and one value channel "
                "feeds them all")
    return grouped[:, 0].reshape(-1)


def _rows_ok(source: str, src: nn.Module, p: torch.Tensor) -> Optional[str]:
    """Why a linear's output rows cannot take ``p`` exactly (None: they can)."""
    if not isinstance(getattr(src, "weight", None), torch.Tensor) or src.weight.dim() != 2 or src.weight.shape[0] != p.numel():
        return f"{source} has no [{p.numel()}, in] weight"
    if not isinstance(src, QuantModule) or src.quantizers_off():
        return None
    oq = src._modules.get("output_quantizer")
    if isinstance(oq, (TensorQuantizer, QuantizerContainer)) and oq.is_enabled:
        return f"{source}.output_quantizer is enabled"
    wq = src._modules.get("weight_quantizer")
    if not isinstance(wq, TensorQuantizer) or not wq.is_enabled:
        return None if not isinstance(wq, QuantizerContainer) or not wq.is_enabled else f"{source}.weight_quantizer is a chain"
    spec, amax = wq.spec, wq.amax
    per_row = spec.kind == Kind.INT and (spec.block is None
                                         or len(spec.block) == 1) and amax is not None and amax.numel() > 1 and amax.shape[0] == p.numel()
    if not per_row:
        return f"{source}.weight_quantizer ({spec.kind.value}) has no scale per output row to take the scale"
    return None


def share_pre_quant_scale(model: nn.Module, forward_loop: Optional[Callable[[nn.Module], None]] = None) -> dict[tuple[str, ...], str]:
    """Give the linears that one op feeds (q/k/v after a norm, the query heads sharing a key/value head
    in o_proj, siblings a consumer fuses) one ``pre_quant_scale``, the mean of theirs (ModelOpt's resmoothing), in the model itself,
    so that the model is evaluated with what its export folds. Weight amax are recalibrated (max, from the
    newly scaled weights: re-run a clip search after it if one was used); static input amax need
    ``forward_loop``, whose inputs give them. Returns {changed targets: what was shared}."""
    from ..calib.scaling import apply_pre_quant_scale

    by_name = dict(model.named_modules())
    plans: list[tuple[tuple[str, ...], list[torch.Tensor]]] = []
    for name, rule in _groups(model, by_name):
        targets = tuple(name + t for t in rule.targets)
        lins = [_effective(t, by_name[t]) for t in targets]
        if any(lin.input is None for lin in lins):
            continue
        if rule.kind == "norm" and any(not torch.equal(lin.input, lins[0].input) for lin in lins):
            mean = torch.stack([lin.input.float() for lin in lins]).mean(0)
            plans.append((targets, [mean] * len(lins)))
        elif rule.kind == "heads":
            v, o = by_name[name + rule.source], by_name[targets[0]]
            hd = _head_dim(model, o)
            if not hd or v.weight.shape[0] % hd or o.weight.shape[1] % v.weight.shape[0]:
                continue
            grouped = lins[0].input.float().reshape(v.weight.shape[0] // hd, o.weight.shape[1] // v.weight.shape[0], hd)
            if not bool((grouped == grouped[:, :1]).all()):
                plans.append((targets, [grouped.mean(1, keepdim=True).expand_as(grouped).reshape(-1)]))
    plans += _sibling_plans(model, by_name, {t for targets, _ in plans for t in targets})
    static = [t for targets, _ in plans for t in targets if by_name[t].input_quantizer.is_enabled
              and by_name[t].input_quantizer.needs_calibration]
    if static and forward_loop is None:
        raise ExportError(f"{static[0]}.input_quantizer: a static input amax depends on pre_quant_scale; pass forward_loop to recalibrate "
                          "it")
    amax = _input_amax(model, static, by_name, forward_loop) if static else {}
    changed = {}
    for targets, scales in plans:
        for t, p in zip(targets, scales):
            m = by_name[t]
            apply_pre_quant_scale(m, p.to(m.input_quantizer.pre_quant_scale.dtype), amax.get(t))
        changed[targets] = "mean pre_quant_scale"
    return changed


def _sibling_plans(model: nn.Module, by_name: dict, planned: set[str]) -> list[tuple[tuple[str, ...], list[torch.Tensor]]]:
    """Mean scales of the sibling groups (as the layout names them) no norm rule covers, e.g. Qwen2-MoE's shared expert's
    gate/up: consumers fuse them into one GEMM on one scaled input, so a carried scale must be one."""
    layout = layout_for(model)
    groups: dict[tuple[str, tuple], list[str]] = {}
    for name, m in by_name.items():
        if name not in planned and isinstance(m, QuantModule) and holds_pre_quant_scale(m):
            parent, _, leaf = name.rpartition(".")
            group = layout.sibling_group(leaf)
            if group is not None:
                groups.setdefault((parent, group), []).append(name)
    plans = []
    for members in groups.values():
        scales = [_effective(t, by_name[t]).input for t in members]
        if len(members) > 1 and all(s is not None for s in scales) and any(not torch.equal(s, scales[0]) for s in scales):
            plans.append((tuple(members), [torch.stack([s.float() for s in scales]).mean(0)] * len(members)))
    return plans


def _groups(model: nn.Module, by_name: dict) -> list[tuple[str, FoldRule]]:
    """(prefix, rule) of every rule instance present in the model."""
    out = []
    for rule in rules_for(model):
        if rule.kind == "rows":
            continue
        for name in by_name:
            if name == rule.source or name.endswith("." + rule.source):
                prefix = name[: len(name) - len(rule.source)]
                if all(prefix + t in by_name for t in rule.targets):
                    out.append((prefix, rule))
    return out


def _head_dim(model: nn.Module, o: nn.Module) -> Optional[int]:
    """The attention head size of a transformers config (None where it does not say)."""
    cfg = getattr(model, "config", None)
    heads = getattr(cfg, "num_attention_heads", None)
    return getattr(cfg, "head_dim", None) or (o.weight.shape[1] // heads if heads else None)


@torch.no_grad()
def _input_amax(model: nn.Module, names: list[str], by_name: dict, forward_loop: Callable[[nn.Module], None]) -> dict[str, torch.Tensor]:
    """Per input channel max |x| of the raw inputs (before pre_quant_scale) of ``names`` over ``forward_loop``."""
    amax: dict[str, torch.Tensor] = {}

    def hook(name: str) -> Callable:
        def record(_m: nn.Module, args: tuple) -> None:
            x = args[0].detach().abs().reshape(-1, args[0].shape[-1]).amax(0).float()
            amax[name] = x if name not in amax else torch.maximum(amax[name], x)

        return record

    handles = [by_name[n].register_forward_pre_hook(hook(n)) for n in names]
    try:
        forward_loop(model)
    finally:
        for h in handles:
            h.remove()
    return amax
