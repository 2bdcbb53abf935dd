"""``auto_quantize``: one format per layer, chosen by measured sensitivity under an effective-bits budget.

ModelOpt's ``auto_quantize`` (gradient method) in quantlib's pieces: every candidate format is applied and
calibrated on the whole model in turn, and each quantized module keeps a copy of its quantizers per candidate.
Then, with the model unquantized, each module's output under every candidate is compared with its unquantized
output on the scoring batches, and the difference is weighted by the loss gradient at that output: a module's
score for a candidate is ``sum((grad * (Q(y) - y))^2)`` over the batches (the second-order estimate of the loss
it adds). Modules a consumer fuses into one GEMM (q/k/v, gate/up) form one decision. The search picks, per
decision, the candidate (or no quantization) that minimizes the total score under the budget: a multiple-choice
knapsack, solved by Lagrangian relaxation on the budget and a greedy fill of what is left.
"""

from __future__ import annotations

import copy
import fnmatch
import math
import re
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Optional, Sequence, Union

import torch
from torch import nn

from . import presets
from .config import ConfigError, QuantizeConfig
from .formats import FormatSpec, Kind
from .model_quant import quantize
from .nn.containers import GroupedQuantizer, SequentialQuantizer
from .nn.quant_module import QuantModule
from .nn.tensor_quantizer import TensorQuantizer
from .traversal import clear_weight_cache, set_applied_config

NONE = "NONE"  # the candidate "leave this layer unquantized", always searched
#: leaves a consumer fuses into one GEMM: they share one decision (ModelOpt groups the same ones)
_FUSED = [re.compile(p) for p in (r"^(.*)\.(?:q_proj|k_proj|v_proj)$", r"^(.*)\.(?:gate_proj|up_proj)$", r"^(.*)\.(?:w1|w3)$",
                                  r"^(.*)\.(?:q_a_proj|kv_a_proj_with_mqa)$")]


@dataclass
class Decision:
    """Modules that take one format together, with each candidate's score and weight bits."""

    modules: list[str]
    numel: int
    score: dict[str, float] = field(default_factory=dict)
    bits: dict[str, float] = field(default_factory=dict)


def weight_bits(spec: Optional[FormatSpec]) -> float:
    """Bits per weight element of a format, scales included where they are part of the format's block
    (NVFP4 4.5, MXFP8 8.25, MXFP4 4.25); INT and FP8 count their element bits, as ModelOpt does."""
    if spec is None:
        return 16.0
    element = spec.num_bits if spec.element is None else sum(spec.element) + 1
    if spec.kind in (Kind.NVFP4, Kind.MX):  # one 8-bit scale (E4M3 / E8M0) per block
        return element + 8 / spec.block[0]
    return float(element)


def _candidates(formats: Sequence[Union[str, dict]]) -> dict[str, QuantizeConfig]:
    """Each candidate by name, parsed once: a bad one is refused here, by key, rather than after a calibration."""
    if not isinstance(formats, (list, tuple)) or not formats:
        raise ConfigError(f"quantization_formats={formats!r}: expected a non-empty list of preset names or config dicts")
    out: dict[str, QuantizeConfig] = {}
    for i, f in enumerate(formats):
        if isinstance(f, str):
            if not f.endswith("_CFG") or not isinstance(getattr(presets, f, None), dict):
                raise ConfigError(f"quantization_formats[{i}]={f!r}: not a quantlib preset name (e.g. 'NVFP4_DEFAULT_CFG')")
            name, cfg = f, getattr(presets, f)
        elif isinstance(f, dict):
            name, cfg = f"CUSTOM_{i}", f
        else:
            raise ConfigError(f"quantization_formats[{i}]={f!r}: expected a preset name or a config dict")
        out[name] = QuantizeConfig.from_any(copy.deepcopy(cfg))
    return out


def _budget(constraints: dict) -> float:
    if not isinstance(constraints, dict) or set(constraints) - {"effective_bits", "cost_model"}:
        raise ConfigError(f"constraints={constraints!r}: expected {{'effective_bits': float}} (ModelOpt's key)")
    if constraints.get("cost_model", "weight") != "weight":
        raise ConfigError(f"constraints['cost_model']={constraints['cost_model']!r}: only 'weight' (bits per weight element) is supported")
    bits = constraints.get("effective_bits")
    if isinstance(bits, bool) or not isinstance(bits, (int, float)) or not 0 < bits <= 16:
        raise ConfigError(f"constraints['effective_bits']={bits!r}: expected a number of bits in (0, 16]")
    return float(bits)


def _quantizers(module: QuantModule) -> dict[str, nn.Module]:
    return {qn: module._modules[qn] for qn in module.quantizer_names if module._modules.get(qn) is not None}


def _install(module: QuantModule, quantizers: dict[str, nn.Module]) -> None:
    module._modules.update(quantizers)
    clear_weight_cache(module)


def _numel(module: QuantModule) -> int:
    """Weight elements of a quantized module (every expert of a fused-experts module)."""
    return sum(t.numel() for _, tensors in module.weight_groups() for t in tensors)


def _disabled(quantizers: dict[str, nn.Module]) -> dict[str, nn.Module]:
    out = copy.deepcopy(quantizers)
    for q in out.values():
        for leaf in [q] if isinstance(q, TensorQuantizer) else q.modules():
            if isinstance(leaf, TensorQuantizer):
                leaf.disable()
    return out


def _weight_spec(quantizers: dict[str, nn.Module]) -> Optional[FormatSpec]:
    for qn, q in quantizers.items():
        if "weight" not in qn:
            continue
        leaf = q if isinstance(q, TensorQuantizer) else next((m for m in q.modules() if isinstance(m, TensorQuantizer)), None)
        if leaf is not None and leaf.is_enabled:
            return leaf.spec
    return None


def _decisions(names: list[str], numel: dict[str, int]) -> list[Decision]:
    groups: dict[str, list[str]] = {}
    for n in names:
        key = n
        for rule in _FUSED:
            m = rule.match(n)
            if m:
                key = f"{m.group(1)}.<{rule.pattern}>"
                break
        groups.setdefault(key, []).append(n)
    return [Decision(ms, sum(numel[m] for m in ms)) for ms in groups.values()]


def _first(out: Any) -> torch.Tensor:
    return out[0] if isinstance(out, (tuple, list)) else out


class _Scorer:
    """Wraps each searched module's forward for the scoring passes: the unquantized output goes on, the
    candidates' outputs are differenced against it, and a hook on the output's gradient adds
    ``sum((grad * diff)^2)`` to each candidate's score (kept on the device)."""

    def __init__(self, modules: dict[str, QuantModule], snaps: dict[str, dict[str, dict]], none: dict[str, dict]) -> None:
        self.modules, self.snaps, self.none = modules, snaps, none
        self.scores: dict[str, dict[str, torch.Tensor]] = {n: {} for n in modules}
        self.saved: dict[str, Any] = {}

    def __enter__(self) -> "_Scorer":
        for name, m in self.modules.items():
            self.saved[name] = m.__dict__.get("forward")
            m.forward = self._forward(name, m, m.forward)
        return self

    def __exit__(self, *exc: Any) -> None:
        for name, m in self.modules.items():
            if self.saved[name] is None:
                del m.forward
            else:
                m.forward = self.saved[name]

    def _forward(self, name: str, module: QuantModule, original: Callable) -> Callable:
        def scored(*args: Any, **kwargs: Any) -> Any:
            out = original(*args, **kwargs)
            y = _first(out)
            if not (torch.is_grad_enabled() and isinstance(y, torch.Tensor) and y.requires_grad):
                return out
            diffs = {}
            with torch.no_grad():
                for cand, snap in self.snaps.items():
                    _install(module, snap[name])
                    diffs[cand] = (_first(original(*args, **kwargs)) - y).float()
                _install(module, self.none[name])

            def add(grad: torch.Tensor) -> None:
                for cand, d in diffs.items():
                    s = (grad.float() * d).clamp(-1e10, 1e10).square().sum()
                    prev = self.scores[name].get(cand)
                    self.scores[name][cand] = s if prev is None else prev + s

            y.register_hook(add)
            return out

        return scored


#: cost units of the knapsack table at most: exact where the costs' common divisor allows, else each cost
#: rounded up to 1/_UNITS of the budget (the choice then never exceeds the budget)
_UNITS = 1 << 16


def _search(decisions: list[Decision], budget_bits: float, candidates: list[str]) -> dict[int, str]:
    """Per decision the candidate minimizing the summed score with total bits <= budget: a multiple-choice
    knapsack solved by dynamic programming over cost (quarter bits times elements, in units of their
    common divisor, or of 1/65536 of the budget, rounded up, where that divisor is too fine)."""
    total = sum(d.numel for d in decisions)
    costs = [[round(d.bits[c] * 4) * d.numel for c in candidates] for d in decisions]
    cap = int(budget_bits * 4 * total + 1e-6)
    unit = math.gcd(*[c for row in costs for c in row], cap) or 1
    if cap // unit > _UNITS:
        unit = -(-cap // _UNITS)
    units = [[-(-c // unit) for c in row] for row in costs]
    size = cap // unit + 1
    if sum(min(row) for row in units) >= size:
        low = sum(min(d.bits.values()) * d.numel for d in decisions) / total
        raise ConfigError(f"constraints['effective_bits']={budget_bits}: the smallest the candidates reach is {low:.3f} bits")
    inf = float("inf")
    best = torch.full((size,), inf, dtype=torch.float64)
    best[0] = 0.0
    picks = []
    for d, row in zip(decisions, units):
        options = torch.full((len(candidates), size), inf, dtype=torch.float64)
        for j, (c, u) in enumerate(zip(candidates, row)):
            if u < size:
                options[j, u:] = best[: size - u] + d.score[c]
        best, pick = options.min(dim=0)
        picks.append(pick)
    at = int(torch.argmin(best))
    choice = {}
    for i in range(len(decisions) - 1, -1, -1):
        j = int(picks[i][at])
        choice[i] = candidates[j]
        at -= units[i][j]
    return choice


def auto_quantize(
    model: nn.Module,
    constraints: dict,
    quantization_formats: Sequence[Union[str, dict]],
    data_loader: Iterable,
    forward_step: Callable[[nn.Module, Any], Any],
    loss_func: Callable[[Any, Any], torch.Tensor],
    *,
    disabled_layers: Union[str, Sequence[str], None] = None,
    num_calib_steps: int = 512,
    num_score_steps: int = 128,
) -> tuple[nn.Module, dict]:
    """Quantize ``model`` with a format per layer from ``quantization_formats`` (preset names or configs; leaving
    a layer unquantized is always a choice) under ``constraints={"effective_bits": b}`` (bits per weight element
    of the searched layers, 16 for unquantized). Returns ``(model, state)``; ``state["config"]`` is the chosen
    config (one rule per quantizer) and ``state["best"]`` the choice per module, its bits and score."""
    budget = _budget(constraints)
    cands = _candidates(quantization_formats)
    for name, value in (("num_calib_steps", num_calib_steps), ("num_score_steps", num_score_steps)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ConfigError(f"{name}={value!r}: expected an int >= 1")
    excluded = [disabled_layers] if isinstance(disabled_layers, str) else list(disabled_layers or [])
    batches = list(_take(data_loader, max(num_calib_steps, num_score_steps)))
    if not batches:
        raise ConfigError("data_loader yielded no batch")

    def calib_loop(m: nn.Module) -> None:
        with torch.no_grad():
            for b in batches[:num_calib_steps]:
                forward_step(m, b)

    snaps: dict[str, dict[str, dict]] = {}
    searched: dict[str, QuantModule] = {}
    for cand, cfg in cands.items():
        model = quantize(model, cfg, calib_loop)
        if not searched:
            searched = {n: m for n, m in model.named_modules() if isinstance(m, QuantModule) and _numel(m)
                        and not any(fnmatch.fnmatch(n, p) for p in excluded)}
        snaps[cand] = {n: copy.deepcopy(_quantizers(m)) for n, m in searched.items()}
    for n, m in model.named_modules():  # what is not searched stays unquantized
        if isinstance(m, QuantModule) and n not in searched:
            _install(m, _disabled(_quantizers(m)))
    searched = {n: m for n, m in searched.items() if any(_weight_spec(snaps[c][n]) is not None for c in cands)}
    if not searched:
        raise ConfigError("auto_quantize: no layer has an enabled weight quantizer under any of the quantization_formats")
    none = {n: _disabled(_quantizers(m)) for n, m in searched.items()}
    for n, m in searched.items():
        _install(m, none[n])

    params = [(p, p.requires_grad) for p in model.parameters()]
    try:
        for p, _ in params:
            p.requires_grad_(True)  # gradients must reach every searched module's output
        with _Scorer(searched, {c: {n: s[n] for n in searched} for c, s in snaps.items()}, none) as scorer:
            for b in batches[:num_score_steps]:
                loss_func(forward_step(model, b), b).backward()
                for p, _ in params:
                    p.grad = None
    finally:
        for p, req in params:
            p.requires_grad_(req)
    numel = {n: _numel(m) for n, m in searched.items()}
    decisions = _decisions(list(searched), numel)
    names = list(cands) + [NONE]
    values = _read_scores(scorer.scores)
    for d in decisions:
        d.bits = {c: weight_bits(_weight_spec(snaps[c][d.modules[0]])) for c in cands} | {NONE: 16.0}
        d.score = {c: sum(values.get((n, c), 0.0) for n in d.modules) for c in cands} | {NONE: 0.0}
    choice = _search(decisions, budget, names)
    chosen: dict[str, str] = {}
    for i, d in enumerate(decisions):
        for n in d.modules:
            chosen[n] = choice[i]
            _install(searched[n], none[n] if choice[i] == NONE else snaps[choice[i]][n])
    config = _chosen_config(searched)
    set_applied_config(model, QuantizeConfig.from_any(config))
    bits = sum(decisions[i].bits[c] * decisions[i].numel for i, c in choice.items()) / sum(d.numel for d in decisions)
    state = {
        "candidates": names,
        "decisions": [{"modules": d.modules, "numel": d.numel, "score": d.score, "bits": d.bits} for d in decisions],
        "best": {"recipe": chosen, "effective_bits": bits, "score": sum(decisions[i].score[c] for i, c in choice.items()),
                 "constraints": {"effective_bits": budget}},
        "config": config,
    }
    return model, state


def _take(it: Iterable, n: int) -> Iterable:
    for i, b in enumerate(it):
        if i >= n:
            return
        yield b


def _read_scores(scores: dict[str, dict[str, torch.Tensor]]) -> dict[tuple[str, str], float]:
    """Every score on the host in one read per device."""
    keys, tensors = [], []
    for n, per in scores.items():
        for c, t in per.items():
            keys.append((n, c))
            tensors.append(t.reshape(1))
    if not tensors:
        return {}
    by_device: dict[torch.device, list[int]] = {}
    for i, t in enumerate(tensors):
        by_device.setdefault(t.device, []).append(i)
    out: dict[tuple[str, str], float] = {}
    for idx in by_device.values():
        for i, v in zip(idx, torch.cat([tensors[i] for i in idx]).tolist()):
            out[keys[i]] = v if math.isfinite(v) else float("inf")
    return out


def _attrs(q: nn.Module) -> Union[dict, list]:
    """The attribute config of an installed quantizer as a config rule: a list for a chain, a grouped
    quantizer's first member's (its members share one config)."""
    if isinstance(q, SequentialQuantizer):
        return [leaf.attrs.to_dict() for leaf in q] if q.is_enabled else {"enable": False}
    if isinstance(q, GroupedQuantizer):
        return _attrs(q[0]) if len(q) else {"enable": False}
    return q.attrs.to_dict() if q.is_enabled else {"enable": False}


def _chosen_config(searched: dict[str, QuantModule]) -> dict:
    """The choice as a config: each searched module's quantizers by full name, every other quantizer off."""
    quant_cfg: dict[str, Any] = {"default": {"enable": False}}
    for n, m in searched.items():
        for qn, q in _quantizers(m).items():
            quant_cfg[f"{n}.{qn}"] = _attrs(q)
    return {"quant_cfg": quant_cfg, "algorithm": None}


__all__ = ["auto_quantize", "weight_bits"]
