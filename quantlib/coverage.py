"""Which weights a quantized model actually quantizes, and which stayed in full precision unasked.

A weight stays unquantized *silently* when nothing in the config chose it: its module has no quantized
class (an unregistered layer or fused-experts layout), or its weight quantizer is off only through the
config's blanket rule (``"default"`` / ``"*"``), e.g. because the enabling pattern is misspelled.
Weights the config switched off by name (``*lm_head*``, ``*router*``) are a choice, not silent.
Embedding tables, 1-D parameters (norms, biases) and ``*bias`` parameters are not GEMM weights and
are not counted.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Optional

from torch import nn

from .config import QuantizeConfig, turns_on
from .nn.containers import GroupedQuantizer, QuantizerContainer
from .nn.quant_module import QuantModule, QuantModuleRegistry, all_disabled
from .nn.tensor_quantizer import TensorQuantizer
from .traversal import applied_config, class_names

_log = logging.getLogger("quantlib")


@dataclass
class WeightCoverage:
    """Element counts of the model's GEMM weights (unique parameters of 2 or more dims) and where the
    unquantized ones are."""

    total: int = 0
    quantized: int = 0
    #: module name -> elements left unquantized with no config rule naming them
    silent: dict[str, int] = field(default_factory=dict)
    #: module name -> elements whose weight quantizer a named config rule disabled
    disabled: dict[str, int] = field(default_factory=dict)
    enabled_quantizers: int = 0
    #: enabling config patterns that match no quantizer of the model (typos, other architectures)
    unmatched_patterns: list[str] = field(default_factory=list)

    @property
    def silent_share(self) -> float:
        """Share of the weight elements left unquantized silently."""
        return sum(self.silent.values()) / self.total if self.total else 0.0

    @property
    def unquantized_share(self) -> float:
        """Share of the weight elements left unquantized, for any reason."""
        return (self.total - self.quantized) / self.total if self.total else 0.0


def _is_embedding(module: nn.Module) -> bool:
    return isinstance(module, (nn.Embedding, nn.EmbeddingBag)) or "Embedding" in QuantModuleRegistry.original_class_of(module).__name__


def _named_off(cfg: Optional[QuantizeConfig], qname: str, module: nn.Module) -> bool:
    """Whether the last config rule deciding ``qname`` (real or the name a weight quantizer of ``module``
    would have) disables it and is more than the blanket ``*`` rule."""
    if cfg is None:
        return False
    decided = None
    for e in cfg.quant_cfg:
        if e.matches(qname, class_names(module)) and (e.attrs is not None or e.enable is not None):
            decided = e
    if decided is None or decided.pattern == "*":
        return False
    return not turns_on(decided.attrs, decided.enable)


def _unmatched(cfg: QuantizeConfig, model: nn.Module) -> list[str]:
    names = []
    for mname, m in model.named_modules():
        for attr, child in m._modules.items():
            if isinstance(child, (TensorQuantizer, QuantizerContainer)):
                names.append((f"{mname}.{attr}" if mname else attr, class_names(m)))
    out = []
    for e in cfg.quant_cfg:
        if turns_on(e.attrs, e.enable) and e.pattern != "*" and not any(e.matches(n, c) for n, c in names):
            out.append(e.pattern)
    return out


def weight_coverage(model: nn.Module, config: Optional[QuantizeConfig] = None) -> WeightCoverage:
    """Count quantized and unquantized weight elements of ``model`` (``config``: the one applied, by
    default the model's last; it tells named choices from silent misses)."""
    cfg = config if config is not None else applied_config(model)
    cov = WeightCoverage()
    seen: set[int] = set()
    for name, m in model.named_modules():
        if isinstance(m, (TensorQuantizer, QuantizerContainer)):
            if isinstance(m, TensorQuantizer) and not m._disabled:
                cov.enabled_quantizers += 1
            continue
        params = [p for pn, p in m.named_parameters(recurse=False) if p.dim() >= 2 and not pn.endswith("bias") and id(p) not in seen]
        seen.update(id(p) for p in m.parameters(recurse=False))
        if not params or _is_embedding(m):
            continue
        if isinstance(m, QuantModule):
            numel, done = 0, 0
            for qname, tensors in m.weight_groups():
                q = getattr(m, qname)
                members = list(q) if isinstance(q, GroupedQuantizer) else [q]
                for member, t in zip(members, tensors):
                    numel += t.numel()
                    done += 0 if all_disabled([member]) else t.numel()
            qnames = [f"{name}.{q}" for q in m.weight_quantizer_names]
        else:
            numel, done = sum(p.numel() for p in params), 0
            qnames = [f"{name}.weight_quantizer"]
        cov.total += numel
        cov.quantized += done
        if numel > done:
            bucket = cov.disabled if all(_named_off(cfg, q, m) for q in qnames) else cov.silent
            bucket[name] = numel - done
    if cfg is not None:
        cov.unmatched_patterns = _unmatched(cfg, model)
    return cov


def report_coverage(model: nn.Module, config: QuantizeConfig) -> WeightCoverage:
    """:func:`weight_coverage` after ``quantize``, kept as ``model.quant_coverage``; logs a warning when
    the config enables no quantizer, when an enabling pattern matches nothing, or when weights stay
    unquantized silently while the config quantizes weights or has such a pattern."""
    cov = weight_coverage(model, config)
    model.quant_coverage = cov
    if cov.unmatched_patterns:
        _log.warning("quantize: config pattern(s) %s enable quantizers but match none in the model", cov.unmatched_patterns)
    if cov.enabled_quantizers == 0:
        _log.warning("quantize: the config enables no quantizer; the model is not quantized (0 of %d weight elements)", cov.total)
    elif cov.silent and (cov.quantized > 0 or cov.unmatched_patterns):
        names = list(cov.silent)
        _log.warning(
            "quantize: %.1f%% of the weight elements (%d of %d) stay unquantized with no config rule naming them, in %d module(s): %s%s "
            "(no quantized class for the module, or only the default rule disables it); see model.quant_coverage",
            100 * cov.silent_share, sum(cov.silent.values()), cov.total, len(names), names[:5], " ..." if len(names) > 5 else "",
        )
    return cov


__all__ = ["WeightCoverage", "report_coverage", "weight_coverage"]
