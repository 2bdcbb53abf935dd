"""Modules whose training forward may hand a quantized child's weight to a fused kernel instead of calling the child.

transformers' Mamba mixers, in training and with mamba_ssm's kernels (``mamba_inner_fn``,
``mamba_split_conv1d_scan_combined``), pass ``out_proj.weight`` (Mamba-1: ``x_proj`` / ``dt_proj`` / ``out_proj``) to
the kernel, so QAT would train those layers unquantized while the export writes them quantized. Mamba-1 and Jamba
multiply by ``dt_proj.weight`` on every path. :func:`guard` hooks such modules: after each training forward with grad
(a QAT step), a child with an enabled quantizer that did not run is an error naming it. The hooks hold names only (a
deep copy keeps them right). The export refuses the eval-time cases (:data:`READ_ALWAYS`) itself
(``quantlib.export.checks``).
"""

from __future__ import annotations

import functools
from typing import Callable, Optional

import torch
from torch import nn

from .quant_module import QuantModule

#: class name (transformers) -> the children whose weights mamba_ssm's fused training kernel takes instead of calling
#: them (``mamba_inner_fn``: Mamba-1's x_proj / out_proj, and dt_proj, which READ_ALWAYS names; Mamba-2's
#: ``mamba_split_conv1d_scan_combined``: out_proj). FalconMamba has no fused path.
FUSED_IN_TRAINING: dict[str, tuple[str, ...]] = {
    "MambaMixer": ("x_proj", "out_proj"),
    "Mamba2Mixer": ("out_proj",),
    "NemotronHMamba2Mixer": ("out_proj",),
    "BambaMixer": ("out_proj",),
    "FalconH1Mixer": ("out_proj",),
    "GraniteMoeHybridMambaLayer": ("out_proj",),
    "Zamba2MambaMixer": ("out_proj",),
}

#: class name (transformers) -> the child whose weight its forward reads itself on every path, eval included: Mamba-1's
#: mixers multiply by dt_proj.weight (Jamba's unless its config is marked quantized, which a fake-quantized model's is
#: not); LongCat-Flash's router casts its classifier's weight to fp32. The export refuses these children quantized.
READ_ALWAYS: dict[str, str] = {"MambaMixer": "dt_proj", "FalconMambaMixer": "dt_proj", "JambaMambaMixer": "dt_proj",
                               "LongcatFlashTopkRouter": "classifier"}


def _sliced_tp(module: nn.Module) -> bool:
    return getattr(module, "pretraining_tp", 1) > 1 and bool(getattr(module, "slow_but_exact", False))


#: class name (transformers) -> (child, whether this module's forward reads the child's weight itself): BLOOM with
#: ``pretraining_tp > 1`` and ``slow_but_exact`` multiplies by slices of its output projections' weights
READ_WHEN: dict[str, tuple[str, Callable[[nn.Module], bool]]] = {"BloomAttention": ("dense", _sliced_tp),
                                                                 "BloomMLP": ("dense_4h_to_h", _sliced_tp)}


def read_directly(module: nn.Module) -> Optional[str]:
    """The child of ``module`` whose weight its forward reads itself, on every path (:data:`READ_ALWAYS`, :data:`READ_WHEN`), or None."""
    cls_name = type(module).__name__
    always = READ_ALWAYS.get(cls_name)
    if always is not None:
        return always
    when = READ_WHEN.get(cls_name)
    return when[0] if when is not None and when[1](module) else None


def _guarded(module: nn.Module) -> tuple[str, ...]:
    """The children a training forward of ``module`` may skip (empty: not guarded)."""
    always = read_directly(module)
    return FUSED_IN_TRAINING.get(type(module).__name__, ()) + ((always,) if always is not None else ())


def _qat_step(module: nn.Module) -> bool:
    return module.training and torch.is_grad_enabled()  # calibration runs without grad


def _quantizing(module: nn.Module) -> bool:
    return isinstance(module, QuantModule) and not module.quantizers_off()


def _ran(module: nn.Module, *args) -> None:
    module._ql_ran = True


def _reset(children: tuple[str, ...], module: nn.Module, *args) -> None:
    if not _qat_step(module):  # eval forwards: nothing to check afterwards
        return
    for c in children:
        child = module._modules.get(c)
        if child is not None:
            child._ql_ran = False


def _check(children: tuple[str, ...], module: nn.Module, *args) -> None:
    if not _qat_step(module):
        return
    skipped = [c for c in children if _quantizing(module._modules.get(c)) and not getattr(module._modules[c], "_ql_ran", True)]
    if skipped:
        raise RuntimeError(f"{type(module).__name__}: its training forward read the weights of {skipped} without calling them (a fused "
                           "kernel or a direct product), so their quantizers did not run and QAT would train them unquantized; "
                           f"disable their quantizers (quantlib.disable_quantizer(model, '*{skipped[0]}*')) or train without the fused "
                           "kernels")


def guard(model: nn.Module) -> int:
    """Hook every module of ``model`` of a class in :data:`FUSED_IN_TRAINING`, or that reads a child directly
    (:func:`read_directly`), once each; returns how many are hooked."""
    count = 0
    for module in model.modules():
        children = _guarded(module)
        if not children or getattr(module, "_ql_bypass_guard", False):
            continue
        module._ql_bypass_guard = True
        module.register_forward_pre_hook(functools.partial(_reset, children))
        module.register_forward_hook(functools.partial(_check, children))
        for c in children:
            child = module._modules.get(c)
            if child is not None:
                child.register_forward_pre_hook(_ran)
        count += 1
    return count


__all__ = ["FUSED_IN_TRAINING", "READ_ALWAYS", "READ_WHEN", "guard", "read_directly"]
