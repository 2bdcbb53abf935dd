"""What the per-input-channel scaling algorithms (SmoothQuant, AWQ) share: which modules they can
serve, one forward-loop pass that records each served linear's inputs, and applying a scale.

Applying scales ``s`` to a linear ``y = x W^T`` sets the input quantizer's ``pre_quant_scale`` to
``1/s`` and the weight quantizer's to ``s`` (it quantizes ``W * s``), so ``y`` is unchanged before
quantization and the weight parameter is untouched (re-quantizing starts from it); the weight
quantizers are then recalibrated (max) on the scaled weight.
"""

from __future__ import annotations

import logging
import sys
from typing import Iterable, Optional, TypeVar

import torch
from torch import nn

from ..collectives import StatSync
from ..nn.containers import GroupedQuantizer
from ..nn.quant_module import QuantModule
from ..nn.tensor_quantizer import CalibrationError, TensorQuantizer

_log = logging.getLogger("quantlib")
T = TypeVar("T")


def progress(items: Iterable[T], desc: str, total: int) -> Iterable[T]:
    """``items`` with a progress bar for one phase of an algorithm, shown only if it takes a while."""
    from tqdm.auto import tqdm

    return tqdm(items, desc=f"quantlib {desc}", total=total, unit="layer", delay=2.0, leave=False, file=sys.stderr)


def linear_weight(module: QuantModule) -> Optional[torch.Tensor]:
    """The ``[out, in]`` weight of a linear-like quantized module (one plain weight quantizer, a 2-D
    weight, an ``input_quantizer`` on the ``in`` features), else None."""
    groups = list(module.weight_groups())
    if len(groups) != 1 or len(groups[0][1]) != 1 or not isinstance(getattr(module, "input_quantizer", None), TensorQuantizer):
        return None
    name, (w,) = groups[0]
    if name != "weight_quantizer" or isinstance(getattr(module, name), GroupedQuantizer) or w.dim() != 2:
        return None
    return w


def linear_bias(module: nn.Module) -> Optional[torch.Tensor]:
    """The bias the module's GEMM adds, or None: TE layers built with ``bias=False`` hold an empty tensor."""
    bias = getattr(module, "bias", None)
    return bias if isinstance(bias, torch.Tensor) and bias.numel() > 0 else None


class ExpertGemm:
    """Expert ``e``'s GEMM in projection ``proj`` of a fused-experts module (one with ``expert_gemm``),
    served as a linear: its own weight slice, bias, weight quantizer member and row ``e`` of the input
    quantizer's 2-D ``pre_quant_scale``. The input quantizer, and so its amax, is the projection's,
    shared by the experts: :meth:`offer_input_amax` keeps the max over the experts searched."""

    is_expert = True
    gemm_input_at_input_quantizer = False

    def __init__(self, module: QuantModule, proj: str, e: int, shared_amax: dict) -> None:
        self.module, self.proj, self.e = module, proj, e
        self._shared_amax = shared_amax  # one dict per module: proj -> the max offered so far
        self.parallel_role = module.parallel_role

    @property
    def weight(self) -> torch.Tensor:
        """The (out, in) slice, row-major (a transient copy where the module stores it (in, out)): the
        search's reductions and GEMMs then see what they see for a linear's weight, whatever the layout."""
        return self.module.expert_gemm(self.proj, self.e)[0].contiguous()

    @property
    def weight_view(self) -> torch.Tensor:
        """The (out, in) slice as a view of the module's parameter (no copy)."""
        return self.module.expert_gemm(self.proj, self.e)[0]

    @property
    def bias(self) -> Optional[torch.Tensor]:
        return self.module.expert_gemm(self.proj, self.e)[1]

    @property
    def input_quantizer(self) -> TensorQuantizer:
        return getattr(self.module, f"{self.proj}_input_quantizer")

    @property
    def weight_quantizer(self) -> nn.Module:
        return getattr(self.module, f"{self.proj}_weight_quantizer")[self.e]

    def input_pre_scale(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` times this expert's input ``pre_quant_scale`` row (``x`` if there is none)."""
        return self.input_quantizer.pre_scale(x, row=self.e)

    def set_input_pre_quant_scale(self, pqs: Optional[torch.Tensor]) -> None:
        """Row ``e`` := ``pqs`` (rows not searched yet are ones); None drops every row."""
        iq = self.input_quantizer
        if pqs is None:
            iq.pre_quant_scale = None
            return
        current = iq.pre_quant_scale
        table = torch.ones(self.module.num_experts, pqs.numel(), dtype=pqs.dtype,
                           device=pqs.device) if current is None or current.dim() != 2 else current.clone()
        table[self.e] = pqs
        iq.pre_quant_scale = table

    def offer_input_amax(self, amax: torch.Tensor) -> None:
        """The shared input amax becomes the max over the experts of this search so far."""
        held = self._shared_amax.get(self.proj)
        self._shared_amax[self.proj] = amax if held is None else torch.maximum(held, amax)
        self.input_quantizer.amax = self._shared_amax[self.proj]

    def calibrate_weights(self) -> None:
        """Member ``e`` takes its amax from its own (scaled) slice."""
        q = self.weight_quantizer
        if q.is_enabled and q.needs_calibration:
            q.calibrate(self.weight)

    def store_result(self, attr: str, value: object) -> None:
        """``module.<attr>[proj][e] = value`` (a search's choice, per expert)."""
        table = self.module.__dict__.setdefault(attr, {})
        table.setdefault(self.proj, [None] * self.module.num_experts)[self.e] = value


def store_result(target: object, attr: str, value: object) -> None:
    """Keep a search's choice (e.g. ``awq_lite_alpha``) on a linear, or per expert on a fused-experts module."""
    if isinstance(target, ExpertGemm):
        target.store_result(attr, value)
    else:
        setattr(target, attr, value)


def input_pre_scale(target: object, x: torch.Tensor) -> torch.Tensor:
    """``x`` as the target's input quantizer scales it (its own row for an expert GEMM)."""
    return target.input_pre_scale(x) if isinstance(target, ExpertGemm) else target.input_quantizer.pre_scale(x)


def _expert_gemms(name: str, m: QuantModule, needs_input: bool) -> list[tuple[str, ExpertGemm, torch.Tensor]]:
    """The served GEMMs of a fused-experts module: per projection whose input quantizer is enabled
    (or not ``needs_input``), each expert whose weight quantizer member is enabled."""
    shared: dict = {}
    out = []
    for proj in m.projections:
        iq, wq = getattr(m, f"{proj}_input_quantizer"), getattr(m, f"{proj}_weight_quantizer")
        if needs_input and not iq.is_enabled:
            continue
        for e in range(len(wq)):
            if wq[e].is_enabled:
                g = ExpertGemm(m, proj, e, shared)
                out.append((f"{name}.{proj}[{e}]", g, g.weight_view))
    return out


def served_linears(model: nn.Module, method: str, needs_input: bool,
                   tensor_parallel: bool = False) -> list[tuple[str, QuantModule, torch.Tensor]]:
    """(name, module, weight) of every quantized linear whose weight quantizer is enabled (and, with
    ``needs_input``, whose input quantizer too), and of every expert GEMM of fused-experts modules
    (:class:`ExpertGemm`, named ``<module>.<proj>[e]``). A module the config quantizes that the algorithm
    cannot serve is named: weight-less ones are refused (CalibrationError), weights of another shape
    (convolutions) keep max calibration with a warning; column-parallel linears with sequence
    parallelism are refused under tensor parallelism (their GEMM input is gathered after the
    quantizer, which sees each rank's slice of the tokens)."""
    out, weightless = [], []
    for name, m in model.named_modules():
        if not isinstance(m, QuantModule):
            continue
        if callable(getattr(m, "expert_gemm", None)):
            out += _expert_gemms(name, m, needs_input)
            continue
        w = linear_weight(m)
        if w is None:
            enabled = [qn for qn in m.quantizer_names if getattr(getattr(m, qn, None), "is_enabled", False)]
            if not list(m.weight_groups()) and any("input" in qn for qn in enabled):
                weightless.append(name)
            elif any(qn in m.weight_quantizer_names for qn in enabled):
                _log.warning("%s: %s serves linear layers only; %s (%s) keeps max calibration", name, method, name, type(m).__name__)
            continue
        if m.weight_quantizer.is_enabled and (m.input_quantizer.is_enabled or not needs_input):
            out.append((name, m, w))
    gathered = [n for n, m, _ in out if m.parallel_role == "column" and getattr(m, "sequence_parallel", False)]
    if tensor_parallel and gathered:
        raise CalibrationError(f"{method} under sequence parallelism is not supported: {gathered[:3]} see only this rank's tokens; "
                               "calibrate with sequence_parallel=False (the same weights)")
    if weightless:
        raise CalibrationError(f"{method} cannot serve {weightless[:5]}: they have no weight to take the per-channel scales; disable their "
                               "input quantizers in the config or use algorithm 'max'")
    return out


class InputRecorder:
    """Forward pre-hooks that record, per module, every GEMM input's per-channel max |x| and mean |x|
    (and the inputs themselves with ``keep_inputs``), detached, on the input's device. The GEMM input is
    the module's forward input, or, for a module with ``gemm_input_at_input_quantizer`` (TE
    LayerNormLinear: its forward input is pre-norm), what its ``input_quantizer`` is called on."""

    def __init__(self, modules: list[tuple[str, QuantModule]], keep_inputs: bool = False) -> None:
        self.modules = modules
        self.keep_inputs = keep_inputs
        self.amax: dict[str, torch.Tensor] = {}
        self.mean_abs_sum: dict[str, torch.Tensor] = {}
        self.calls: dict[str, int] = {name: 0 for name, _ in modules}
        self.inputs: dict[str, list[torch.Tensor]] = {name: [] for name, _ in modules}
        self._handles: list = []
        self._observed: list[nn.Module] = []

    def __enter__(self) -> "InputRecorder":
        fused: dict[int, tuple[nn.Module, dict]] = {}
        for name, m in self.modules:
            if isinstance(m, ExpertGemm):  # the fused module reports each expert GEMM's input
                fused.setdefault(id(m.module), (m.module, {}))[1][(m.proj, m.e)] = name
                continue
            at = m.input_quantizer if m.gemm_input_at_input_quantizer else m
            self._handles.append(at.register_forward_pre_hook(self._hook(name)))
        for module, names in fused.values():
            module._input_observer = self._observer(names)
            self._observed.append(module)
        return self

    def _observer(self, names: dict):
        def observe(proj: str, e: int, x: torch.Tensor) -> None:
            name = names.get((proj, e))
            if name is not None:
                self.record(name, x)

        return observe

    def _hook(self, name: str):
        def hook(_module: nn.Module, args: tuple) -> None:
            self.record(name, args[0])
            return None

        return hook

    def record(self, name: str, x: torch.Tensor) -> None:
        """Add one call's input ``x`` of target ``name`` (an empty one adds nothing)."""
        x = x.detach()
        if x.numel() == 0:
            return
        a = x.abs().reshape(-1, x.shape[-1])
        amax = a.amax(dim=0).float()
        self.amax[name] = amax if name not in self.amax else torch.maximum(self.amax[name], amax)
        mean = a.mean(dim=0, dtype=torch.float32) if a.dtype != torch.float32 else a.mean(dim=0)
        self.mean_abs_sum[name] = mean if name not in self.mean_abs_sum else self.mean_abs_sum[name] + mean
        self.calls[name] += 1
        if self.keep_inputs:
            self.inputs[name].append(x)

    def __exit__(self, *exc) -> bool:
        for h in self._handles:
            h.remove()
        self._handles.clear()
        for module in self._observed:
            module.__dict__.pop("_input_observer", None)
        self._observed.clear()
        return False


def check_finite(where: str, what: str, t: torch.Tensor) -> None:
    """NaN / Inf in a calibration statistic raise, naming the quantizer; no such scale is stored."""
    if not bool(torch.isfinite(t).all()):
        bad = "NaN" if bool(torch.isnan(t).any()) else "Inf"
        raise CalibrationError(f"{where}: calibration saw {bad} values in the {what}; check the model's activations or disable this "
                               "quantizer")


def first_leaf(q: nn.Module) -> TensorQuantizer:
    """``q`` itself, or the first member of a chain (which sees the weight first)."""
    return q if isinstance(q, TensorQuantizer) else next(iter(q.leaves()))


def set_input_pre_quant_scale(target: object, pqs: Optional[torch.Tensor]) -> None:
    """The input side of a target's scales: its input quantizer's, or its row for an expert GEMM."""
    if isinstance(target, ExpertGemm):
        target.set_input_pre_quant_scale(pqs)
    else:
        target.input_quantizer.pre_quant_scale = pqs


def clear_scales(module: QuantModule) -> None:
    """Drop the ``pre_quant_scale`` of the input and weight quantizers (a fresh search)."""
    set_input_pre_quant_scale(module, None)
    for leaf in module.weight_quantizer.leaves() if not isinstance(module.weight_quantizer, TensorQuantizer) else [module.weight_quantizer]:
        leaf.pre_quant_scale = None


@torch.no_grad()
def apply_pre_quant_scale(module: QuantModule, pre_quant_scale: torch.Tensor, input_amax: Optional[torch.Tensor]) -> None:
    """Input quantizer's ``pre_quant_scale`` := ``pre_quant_scale`` (stored in the weight's dtype), the
    weight quantizer's := its fp32 reciprocal (it quantizes ``W / pre_quant_scale``: the weight
    parameter itself is never changed), weight quantizers recalibrated; a static input quantizer gets
    the per-tensor amax of the scaled input from its per-channel ``input_amax``."""
    w = module.weight
    pqs = pre_quant_scale.float().to(w.device)
    set_input_pre_quant_scale(module, pqs.to(w.dtype))
    first_leaf(module.weight_quantizer).pre_quant_scale = 1.0 / pqs
    module.calibrate_weights()
    iq = module.input_quantizer
    if iq.is_enabled and iq.needs_calibration and input_amax is not None:
        amax = (input_amax.float().to(pqs.device) * pqs).amax()
        if isinstance(module, ExpertGemm):
            module.offer_input_amax(amax)
        else:
            iq.amax = amax


def handle_unreached(method: str, idle: list[tuple[str, QuantModule]], policy: str) -> None:
    """Targets no rank's input reached: experts follow ``policy`` ("error" raises; otherwise they keep
    max calibration with a ``pre_quant_scale`` of ones), anything else raises by name."""
    if not idle:
        return
    names = [n for n, m in idle if not m.is_expert]
    if names:
        raise CalibrationError(f"{method}: forward_loop never reached {names[:5]}; feed data that reaches them or disable their quantizers")
    if policy == "error":
        raise CalibrationError(f"{method}: no tokens reached expert(s) {[n for n, _ in idle][:5]} (expert_input_policy='error')")
    for n, m in idle:
        _log.warning("%s: no tokens reached this expert; %s leaves it max-calibrated with a pre_quant_scale of ones", n, method)
        set_input_pre_quant_scale(m, torch.ones(m.weight.shape[1], dtype=m.weight.dtype, device=m.weight.device))


def reached_calls(targets: list, rec: InputRecorder, sync: StatSync) -> list[float]:
    """Each target's number of forward calls over its replicas (an expert's over its own replicas)."""
    device = targets[0][2].device if targets else torch.device("cpu")
    counts = [torch.tensor([float(rec.calls[n])], device=device) for n, _, _ in targets]
    return [c.item() for c in sync.over_replicas_each(counts, [m.is_expert for _, m, _ in targets], "sum")]


def input_statistics(targets: list, rec: InputRecorder, sync: StatSync, mean: bool) -> tuple[list, list]:
    """Per target, (the mean |x| sums (``mean``) or None, the per-channel max |x|), each reduced over the
    target's replicas (one collective per statistic for the dense targets, one for the experts), and
    over its tensor-parallel peers (:meth:`StatSync.over_peers`)."""
    experts = [m.is_expert for _, m, _ in targets]
    zeros = [torch.zeros(w.shape[1], device=w.device) for _, _, w in targets]
    amax = sync.over_replicas_each([rec.amax.get(n, z) for (n, _, _), z in zip(targets, zeros)], experts, "max")
    sums = sync.over_replicas_each([rec.mean_abs_sum.get(n, z) for (n, _, _), z in zip(targets, zeros)], experts,
                                   "sum") if mean else [None] * len(targets)
    for i, (_, m, _) in enumerate(targets):
        if sync.peer_group(m):  # the same input on every peer up to rounding: one value for all
            amax[i] = sync.over_peers(amax[i], "max", m)
            if mean:
                sums[i] = sync.over_peers(sums[i], "sum", m) / sync.peers(m)
    return sums, amax
