"""Quantized HF transformers fused MoE experts (3-D parameters, one slice per expert).

transformers declares the layout of its fused-experts classes with ``use_experts_implementation``: the
flags ``has_gate`` (``gate_up_proj`` (E, 2I, H), else ``up_proj`` (E, I, H)), ``is_transposed`` (slices
stored (in, out)), ``has_bias`` (``<proj>_bias`` (E, out)), ``has_post_expert_norm`` and the class's
``_apply_gate`` (GPT-OSS's clamped, interleaved SwiGLU, or act(gate) * up). transformers' own grouped
and batched kernels compute every such class from these flags alone; the quantized forward does the
same with fake-quantized slices, so any class carrying them is quantized faithfully. A module whose
parameters do not fit its flags is refused at conversion, never left in full precision.

Per projection the quantized module has a :class:`~quantlib.nn.GroupedQuantizer` of E weight
quantizers (member e quantizes slice e seen as an (out, in) matrix like an ``nn.Linear`` weight, and
is calibrated from slice e alone) and one input quantizer shared by the experts (one activation scale
per layer, as inference engines take it). ``tokens_per_expert`` counts the tokens routed to each expert
during the last calibration. AWQ / SmoothQuant search each expert on its own tokens: expert e's scales
are row e of the input quantizer's 2-D ``pre_quant_scale`` and member e's (weight) ``pre_quant_scale``;
``_input_observer(proj, e, x)``, when set, sees each expert GEMM's input (their recorder).

The forward reads nothing back to the host: the (token, expert) assignments are sorted by expert on the
device (:mod:`.expert_dispatch`), each projection's weights are fake-quantized as one (E, out, in) stack
with per-expert amax (:mod:`.expert_weights`) and multiplied by one grouped GEMM
(:func:`quantlib.kernels.grouped_mm.grouped_mm`), so ``torch.compile(fullgraph=True)`` makes one graph for
every routing; its bits are those of the per-expert loop. The loop (which reads the list of experts that
got tokens) remains for what the grouped path cannot reproduce exactly: an observer recording each
expert's input, an input quantizer whose scale depends on which tokens it sees together (an uncalibrated
static amax, an affine bias), a non-transposed layout with biases (``F.linear`` fuses the bias into the
GEMM), GEMM sizes that are not multiples of 16 bytes, and calibration under expert parallelism.
"""

from __future__ import annotations

from typing import ClassVar, Iterator, Optional

import torch
import torch.nn.functional as F
from torch import nn

from ..config import QuantizerAttributeConfig
from ..kernels.grouped_mm import grouped_mm
from ..nn.containers import GroupedQuantizer
from ..nn.quant_module import QuantModule
from ..nn.tensor_quantizer import TensorQuantizer
from .expert_dispatch import combine, dispatch
from .expert_tokens import count_tokens
from .expert_weights import quantize_stacked

#: the instance attributes ``use_experts_implementation`` sets, which describe the layout, with the
#: decorator's defaults (which also apply to classes registered by hand that leave one out)
LAYOUT_FLAGS = {"has_gate": True, "has_bias": False, "is_transposed": False, "has_post_expert_norm": False}


def flag(module: nn.Module, name: str) -> bool:
    """Layout flag ``name`` of a fused-experts module (its default where the module does not set it)."""
    return getattr(module, name, LAYOUT_FLAGS[name])


def _projections(module: nn.Module) -> tuple[str, str]:
    return ("gate_up_proj" if flag(module, "has_gate") else "up_proj", "down_proj")


def expert_weight(module: nn.Module, proj: str, e: int) -> torch.Tensor:
    """Expert ``e``'s slice of projection ``proj`` of a fused-experts module, as an (out, in) matrix (a view)."""
    w = getattr(module, proj)[e]
    return w.transpose(0, 1) if flag(module, "is_transposed") else w


def layout_error(module: nn.Module) -> str:
    """Why ``module``'s parameters do not fit the fused-experts layout its flags declare ('' if they do)."""
    name = type(module).__name__
    odd = {f: flag(module, f) for f in LAYOUT_FLAGS if not isinstance(flag(module, f), bool)}
    if odd:
        return f"{name}: layout flag(s) {odd} must be bools"
    num = getattr(module, "num_experts", None)
    up, down = _projections(module)
    params = {p: getattr(module, p, None) for p in (up, down)}
    bad = [p for p, t in params.items() if not isinstance(t, torch.Tensor) or t.dim() != 3 or t.shape[0] != num]
    if bad:
        return (f"{name}: {bad} must be 3-D parameters with num_experts={num} slices, got "
                f"{[tuple(t.shape) if isinstance(t, torch.Tensor) else t for t in params.values()]}")
    (up_out, up_in), (down_out, down_in) = expert_weight(module, up, 0).shape, expert_weight(module, down, 0).shape
    factor = 2 if flag(module, "has_gate") else 1
    if up_in != down_out or up_out != factor * down_in:
        return (f"{name}: {up} slice (out, in)=({up_out}, {up_in}) and {down} slice ({down_out}, {down_in}) do not chain "
                f"(is_transposed={flag(module, 'is_transposed')}, has_gate={flag(module, 'has_gate')})")
    for proj, out in ((up, up_out), (down, down_out)):
        bias = getattr(module, f"{proj}_bias", None)
        if flag(module, "has_bias") and (not isinstance(bias, torch.Tensor) or tuple(bias.shape) != (num, out)):
            return f"{name}: has_bias=True but {proj}_bias is {None if bias is None else tuple(bias.shape)}, expected {(num, out)}"
    if flag(module, "has_post_expert_norm") and not isinstance(getattr(module, "post_expert_norm", None), nn.Module):
        return f"{name}: has_post_expert_norm=True but no post_expert_norm module"
    return ""


class QuantFusedExperts(QuantModule):
    """Mixin for a fused-experts module; subclasses set ``projections`` (first: the up or gate-up
    projection, second: the down projection) and the quantizer names that follow from them."""

    projections: ClassVar[tuple[str, str]] = ("gate_up_proj", "down_proj")
    quantizer_names: ClassVar[tuple[str, ...]] = ("gate_up_proj_input_quantizer", "gate_up_proj_weight_quantizer",
                                                  "down_proj_input_quantizer", "down_proj_weight_quantizer")
    weight_quantizer_names: ClassVar[tuple[str, ...]] = ("gate_up_proj_weight_quantizer", "down_proj_weight_quantizer")
    grouped_quantizer_names: ClassVar[tuple[str, ...]] = weight_quantizer_names
    is_expert = True

    def _setup(self) -> None:
        error = layout_error(self)
        if not error and _projections(self) != self.projections:
            error = f"{type(self).__name__}: has_gate={flag(self, 'has_gate')} does not match its quantized projections {self.projections}"
        if error:
            raise ValueError(f"{error}: quantlib cannot quantize this fused-experts module faithfully (register a quantized class for it)")
        for proj in self.projections:
            num = getattr(self, proj).shape[0]
            setattr(self, f"{proj}_input_quantizer", TensorQuantizer(QuantizerAttributeConfig()))
            setattr(self, f"{proj}_weight_quantizer", GroupedQuantizer([TensorQuantizer(QuantizerAttributeConfig(axis=0))
                                                                        for _ in range(num)]))
        self.register_buffer("tokens_per_expert", torch.zeros(self.num_experts, dtype=torch.int64), persistent=False)
        self._was_calibrating = False

    def weight_groups(self) -> Iterator[tuple[str, list[torch.Tensor]]]:
        # Also called unbound on the original (unconverted) module by checkpoint validation: module
        # attributes only.
        for proj in _projections(self):
            yield f"{proj}_weight_quantizer", [expert_weight(self, proj, e) for e in range(getattr(self, proj).shape[0])]

    def _expert_view(self, proj: str, e: int) -> torch.Tensor:
        """:func:`expert_weight`, the same view object from call to call (the fake-quantized weight cache
        of :meth:`quantize_weight` keys on it) unless autograd has to see the slicing (QAT)."""
        param = getattr(self, proj)
        if torch.is_grad_enabled() and param.requires_grad:
            return expert_weight(self, proj, e)
        views = self.__dict__.setdefault("_expert_views", {})
        hit = views.get((proj, e))
        if hit is None or hit[0] is not param or hit[1] != param.data_ptr():
            with torch.no_grad():
                hit = (param, param.data_ptr(), expert_weight(self, proj, e))
            views[(proj, e)] = hit
        return hit[2]

    def expert_gemm(self, proj: str, e: int) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        """(weight as an (out, in) view, bias or None) of expert ``e``'s GEMM in projection ``proj``:
        what the activation-aware algorithms search as a linear (quantlib.calib.scaling.ExpertGemm)."""
        return expert_weight(self, proj, e), (getattr(self, f"{proj}_bias")[e] if flag(self, "has_bias") else None)

    def _linear(self, proj: str, e: int, x: torch.Tensor) -> torch.Tensor:
        w = self.quantize_weight(self._expert_view(proj, e), f"{proj}_weight_quantizer", e)
        bias = getattr(self, f"{proj}_bias")[e] if flag(self, "has_bias") else None
        if flag(self, "is_transposed"):
            # transformers' transposed layouts (GPT-OSS) compute x @ W + b: a GEMM, then the bias added;
            # F.linear would fuse the bias into the GEMM's accumulation and round differently
            h = x @ w.transpose(0, 1).contiguous()  # W as transformers holds it: row-major (in, out)
            return h if bias is None else h + bias
        return F.linear(x, w, bias)

    def _calibrating(self) -> bool:
        """Whether quantlib's calibration runs: it switches every enabled quantizer together (collecting,
        or quantization off), so the first enabled one tells; no walk over all experts per forward."""
        for name in self.quantizer_names:
            q = self._modules[name]
            for leaf in q.leaves() if hasattr(q, "leaves") else (q,):
                if not leaf._disabled:
                    return leaf._if_calib or not leaf._if_quant
        return False

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> torch.Tensor:
        if self.quantizers_off():
            # the original class's forward (transformers' eager loop or the kernel its config names)
            self._was_calibrating = False
            return self._original_class.forward(self, hidden_states, top_k_index, top_k_weights)
        calibrating = self._calibrating()
        if self._grouped_refusal(hidden_states, calibrating):
            return self._loop_forward(hidden_states, top_k_index, top_k_weights, calibrating)
        return self._grouped_forward(hidden_states, top_k_index, top_k_weights, calibrating)

    def _grouped_refusal(self, hidden_states: torch.Tensor, calibrating: bool) -> str:
        """Why this forward takes the per-expert loop rather than the grouped GEMMs ('' where it need not)."""
        if self.__dict__.get("_input_observer") is not None:
            return "an observer records each expert's GEMM input"
        if flag(self, "has_bias") and not flag(self, "is_transposed"):
            return "F.linear fuses the bias into the GEMM's accumulation"
        if calibrating and getattr(self, "_is_expert_parallel", False):
            return "calibration with expert-parallel sentinels"
        for proj in self.projections:
            param = getattr(self, proj)
            if param.dtype != hidden_states.dtype or any(n * param.element_size() % 16 for n in param.shape[1:]):
                return f"{proj} {param.dtype} {tuple(param.shape)}: not grouped-GEMM aligned"
            if not rowwise(getattr(self, f"{proj}_input_quantizer")):
                return f"{proj}_input_quantizer: its scale depends on which tokens it sees together"
        return ""

    def _grouped_forward(
        self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor, calibrating: bool
    ) -> torch.Tensor:
        """Tokens sorted by expert on the device, each projection one grouped GEMM over the stacked
        fake-quantized weights: no host read, one graph under torch.compile, bit for bit the loop."""
        up, down = self.projections
        up_input, down_input = getattr(self, f"{up}_input_quantizer"), getattr(self, f"{down}_input_quantizer")
        with torch.no_grad():
            d = dispatch(top_k_index, top_k_weights, self.num_experts, bool(getattr(self, "_is_expert_parallel", False)))
        count_tokens(self, d.counts if calibrating else None, up_input, calibrating)
        # one pre_quant_scale row per expert (AWQ / SmoothQuant): each row is scaled by its expert's row,
        # then quantized with the shared amax; otherwise every token is quantized once
        if expert_rows(up_input):
            x = up_input(hidden_states[d.token], row=d.expert)
        else:
            x = up_input(hidden_states)[d.token]
        h = self._grouped_linear(up, x, d)
        h = self._apply_gate(h) if flag(self, "has_gate") else self.act_fn(h)
        h = self._grouped_linear(down, down_input(h, row=d.expert if expert_rows(down_input) else None), d)
        if flag(self, "has_post_expert_norm"):
            h = self.post_expert_norm(h)
        return combine(d, h, hidden_states.dtype)

    def _grouped_linear(self, proj: str, x: torch.Tensor, d) -> torch.Tensor:
        transposed = flag(self, "is_transposed")
        w = quantize_stacked(self, f"{proj}_weight_quantizer", getattr(self, proj), transposed)  # (E, out, in)
        # the (E, in, out) operand as the loop multiplies: a transposed view of (out, in) slices (F.linear),
        # or row-major (in, out) slices for transposed layouts (x @ W, as transformers holds W)
        h = grouped_mm(x, self._row_major(proj, w) if transposed else w.transpose(1, 2), d.offs)
        if flag(self, "has_bias"):  # transposed layouts add the bias after the GEMM (see _linear)
            h = h + getattr(self, f"{proj}_bias")[d.expert]
        return h

    def _row_major(self, proj: str, w: torch.Tensor) -> torch.Tensor:
        """``w`` (E, out, in) as row-major (E, in, out) slices; the copy kept while the weight cache returns the
        same ``w`` (an eval forward would otherwise copy every expert's weights again)."""
        if torch.compiler.is_compiling() or w.requires_grad or w.is_inference():
            return w.transpose(1, 2).contiguous()
        cache = self.__dict__.setdefault("_weight_cache", {})
        hit = cache.get(("row_major", proj))
        if hit is None or hit[0] is not w or hit[1] != w._version:  # the entry holds w: its id is not reused
            hit = cache[("row_major", proj)] = (w, w._version, w.transpose(1, 2).contiguous())
        return hit[2]

    def _loop_forward(
        self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor, calibrating: bool
    ) -> torch.Tensor:
        """One GEMM per expert that received tokens (their list read back to the host): the fallback."""
        up, down = self.projections
        num_experts = self.num_experts
        with torch.no_grad():
            # (E + 1, k, tokens): the extra row takes expert-parallel sentinels (index == num_experts)
            expert_mask = F.one_hot(top_k_index, num_classes=num_experts + 1).permute(2, 1, 0)
            counts = expert_mask[:num_experts].sum(dim=(-1, -2))
        up_input, down_input = getattr(self, f"{up}_input_quantizer"), getattr(self, f"{down}_input_quantizer")
        count_tokens(self, counts, up_input, calibrating)
        per_expert = expert_rows(up_input)
        x = hidden_states if per_expert else up_input(hidden_states)
        observe = self.__dict__.get("_input_observer")
        out = torch.zeros_like(hidden_states)
        for e in torch.nonzero(counts > 0).flatten().tolist():
            top_k_pos, token_idx = torch.where(expert_mask[e])
            xe = x[token_idx]
            if observe is not None:
                observe(up, e, hidden_states[token_idx])
            h = self._linear(up, e, up_input(xe, row=e) if per_expert else xe)
            h = self._apply_gate(h) if flag(self, "has_gate") else self.act_fn(h)
            if observe is not None:
                observe(down, e, h)
            h = self._linear(down, e, down_input(h, row=e))
            if flag(self, "has_post_expert_norm"):
                h = self.post_expert_norm(h)
            h = h * top_k_weights[token_idx, top_k_pos, None]
            out.index_add_(0, token_idx, h.to(out.dtype))
        return out


def expert_rows(q: TensorQuantizer) -> bool:
    """Whether input quantizer ``q``'s ``pre_quant_scale`` holds one row per expert (AWQ / SmoothQuant searched each
    expert on its own tokens): its tokens are then quantized with their expert's row (``row=``)."""
    return q.pre_quant_scale is not None and q.pre_quant_scale.dim() == 2


def rowwise(q: nn.Module) -> bool:
    """Whether input quantizer ``q`` treats each row (token) alone in its current state, so that quantizing
    all experts' rows in one call equals quantizing each expert's rows apart: disabled, or a static amax
    (calibrated) or per-row / per-block scales; and, collecting, a max (not the mean of an affine bias, nor
    a block amax of one input shape)."""
    if q._disabled:
        return True
    if q._attrs.bias is not None or (q._if_calib and q.static_blocks):
        return False
    if not q._if_quant:
        return True
    spec = q.spec
    if not spec.calibrated_amax:
        return True
    return q.needs_calibration and q.amax is not None and not q.static_blocks


def _default_apply_gate(self, gate_up: torch.Tensor) -> torch.Tensor:
    """act(gate) * up over the concatenated [gate; up] output (for classes without their own gate)."""
    gate, up = gate_up.chunk(2, dim=-1)
    return self.act_fn(gate) * up


def fused_experts_mixin(cls: type, gated: bool) -> type:
    """The :class:`QuantFusedExperts` mixin for ``cls`` (``gate_up_proj`` if ``gated``, else ``up_proj``)."""
    up, down = ("gate_up_proj" if gated else "up_proj"), "down_proj"
    attrs: dict = {
        "projections": (up, down),
        "quantizer_names": (f"{up}_input_quantizer", f"{up}_weight_quantizer", f"{down}_input_quantizer", f"{down}_weight_quantizer"),
        "weight_quantizer_names": (f"{up}_weight_quantizer", f"{down}_weight_quantizer"),
        "grouped_quantizer_names": (f"{up}_weight_quantizer", f"{down}_weight_quantizer"),
    }
    if not hasattr(cls, "_apply_gate"):
        attrs["_apply_gate"] = _default_apply_gate
    return type(f"_QuantFused{cls.__name__}", (QuantFusedExperts,), attrs)


__all__ = ["LAYOUT_FLAGS", "QuantFusedExperts", "expert_weight", "flag", "fused_experts_mixin", "layout_error"]
