"""HF transformers plugin: registers quantized classes for the transformers modules loaded in the process.

- Fused MoE experts (:mod:`quantlib.plugins.hf_experts`): every class transformers decorates with
  ``use_experts_implementation`` (Qwen3-MoE, Mixtral, DeepSeek-V2/V3, GPT-OSS, Phi-MoE, ... about 70 in
  transformers 5.25), found by that decoration rather than by a list of names; each instance's
  parameters are checked against the layout its flags declare when it is converted.
- Llama-4's ``Llama4TextExperts`` and GPT-2's ``Conv1D`` (:mod:`quantlib.plugins.hf_layouts`).
- Falcon's ``FalconLinear`` (an ``nn.Linear`` subclass computing ``x @ W.T + b``): quantized as a linear, as ModelOpt does
  (the registry matches classes exactly, so it was left unquantized).

Registration never imports transformers' modeling code (seconds per model family): it looks at the
modules already imported, which a model built from them has done. ``convert`` calls :func:`refresh`
every time; call :func:`register_fused_experts` for another class with the same layout.
"""

from __future__ import annotations

import sys
from typing import Optional

from torch import nn

from ..model_quant import tokens_per_expert_report  # noqa: F401  (re-exported)
from ..nn.modules.linear import _QuantLinear
from ..nn.quant_module import QuantModuleRegistry
from .hf_experts import QuantFusedExperts, expert_weight, fused_experts_mixin, layout_error  # noqa: F401  (re-exported)
from .hf_layouts import QuantConv1D, QuantLlama4TextExperts

#: modeling modules already looked at (a module's classes do not change once imported)
_scanned: set[str] = set()


def _decorator_flags(cls: type) -> Optional[dict]:
    """The layout flags ``use_experts_implementation`` gave ``cls`` (read from its wrapped ``__init__``),
    or None if ``cls`` does not carry that decoration."""
    init, forward = cls.__dict__.get("__init__"), cls.__dict__.get("forward")
    if getattr(init, "__wrapped__", None) is None or getattr(forward, "__wrapped__", None) is None or not hasattr(cls, "_apply_gate"):
        return None
    code, cells = init.__code__, init.__closure__ or ()
    flags = {n: c.cell_contents for n, c in zip(code.co_freevars, cells) if n in ("has_gate", "has_bias", "is_transposed")}
    return flags if len(flags) == 3 else None


def register_fused_experts(cls: type, gated: bool = True) -> None:
    """Quantize modules of ``cls``: a fused-experts class with ``forward(hidden_states, top_k_index,
    top_k_weights)``, ``gate_up_proj`` (or ``up_proj`` if not ``gated``) and ``down_proj`` with one slice
    per expert along dim 0, and the layout flags of ``use_experts_implementation`` on its instances."""
    if not QuantModuleRegistry.is_registered(cls):
        QuantModuleRegistry.register(cls, cls.__name__)(fused_experts_mixin(cls, gated))


class QuantFalconLinear(_QuantLinear):
    """Falcon's ``FalconLinear`` quantized: ``nn.Linear``'s math; a class of its own so that its registry name is its own."""


def _register_module(module) -> list[str]:
    done = []
    for cls in list(vars(module).values()):
        if not (isinstance(cls, type) and issubclass(cls, nn.Module) and cls.__module__ == module.__name__):
            continue
        if QuantModuleRegistry.is_registered(cls):
            continue
        if cls.__name__ == "Llama4TextExperts":  # its own layout and forward (bmm over routed inputs)
            QuantModuleRegistry.register(cls, cls.__name__)(QuantLlama4TextExperts)
        elif cls.__name__ == "Conv1D" and module.__name__ == "transformers.pytorch_utils":
            QuantModuleRegistry.register(cls, "transformers.Conv1D")(QuantConv1D)
        elif cls.__name__ == "FalconLinear" and issubclass(cls, nn.Linear):
            QuantModuleRegistry.register(cls, "hf.FalconLinear")(QuantFalconLinear)
        else:
            flags = _decorator_flags(cls)
            if flags is None:
                continue
            register_fused_experts(cls, gated=flags["has_gate"])
        done.append(cls.__name__)
    return done


def refresh() -> list[str]:
    """Register the quantized classes of transformers modules imported since the last call; returns the
    class names registered. Cheap (modules are looked at once), so ``convert`` calls it every time."""
    done = []
    for name in [n for n in list(sys.modules) if n not in _scanned]:
        if name == "transformers.pytorch_utils" or (name.startswith("transformers.models.") and ".modeling_" in name):
            module = sys.modules.get(name)
            if module is not None:
                done += _register_module(module)
                _scanned.add(name)
    return done


refresh()

__all__ = ["QuantConv1D", "QuantFalconLinear", "QuantFusedExperts", "QuantLlama4TextExperts", "expert_weight", "layout_error", "refresh",
           "register_fused_experts", "tokens_per_expert_report"]
