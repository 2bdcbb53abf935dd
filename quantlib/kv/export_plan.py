"""The KV-cache part of an export plan: every attention module whose ``k_bmm_quantizer`` /
``v_bmm_quantizer`` are enabled, checked against the format before anything is written. The export plan
(:mod:`quantlib.export.plan`, above) calls it with its writer and its model layout."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Optional, Protocol

import torch
from torch import nn

from ..errors import ExportError
from ..formats import FormatSpec
from ..formats.spec import describe
from ..nn.tensor_quantizer import TensorQuantizer
from .presets import ATTENTION_QUANTIZER_NAMES
from .scales import KVPlace


class CheckpointNames(Protocol):
    """What the KV plan asks of an export's model layout (:class:`quantlib.export.layouts.ModelLayout`)."""

    def checkpoint_name(self, module_name: str) -> str: ...


_DISABLE = "quantlib.disable_quantizer(model, '*_bmm_quantizer')"
_NAMES = frozenset(ATTENTION_QUANTIZER_NAMES)


@dataclass
class KVItem:
    """One attention module's calibrated key and value quantizers."""

    name: str  # checkpoint name of the attention module
    where: str  # its module name, for messages
    spec: FormatSpec
    k_amax: torch.Tensor
    v_amax: torch.Tensor


def _enabled(module: nn.Module, qname: str) -> Optional[TensorQuantizer]:
    # the quantizers are submodules: nn.Module.__getattr__ finds them only after missing three dicts
    sub = module._modules
    q = sub[qname] if qname in sub else getattr(module, qname, None)
    return q if isinstance(q, TensorQuantizer) and q.is_enabled else None


def _check_quantizer(q: TensorQuantizer, full: str, packer: KVPlace, finite: bool = True) -> None:
    if q.attrs.bias is not None:
        raise ExportError(
            f"{full}: affine KV-cache quantization (bias={q.attrs.bias}) cannot be exported to format {packer.fmt.value}: its KV-cache "
            f"scheme is one scale per tensor and has no place for the per-head bias; quantize with FP8_KV_CFG, or disable it ({_DISABLE})"
        )
    why = packer.kv_ok(q.spec, tuple(q.amax.shape) if q.amax is not None else ())
    if why is not None:
        raise ExportError(f"{full} = {describe(q.spec)}: format {packer.fmt.value} cannot carry this KV-cache quantizer ({why}); disable "
                          f"it ({_DISABLE}) or pick another format")
    if q.amax is None:
        raise ExportError(f"{full}: KV-cache quantizer has no amax; calibrate with a forward_loop (quantlib.quantize / quantlib.calibrate)")
    if finite and not q.amax.is_meta and not bool(torch.isfinite(q.amax).all()):
        raise ExportError(f"{full}: amax holds a non-finite value ({q.amax.flatten()[:4].tolist()}); recalibrate")


def _refuse_non_finite(checked: list[tuple[str, TensorQuantizer]], packer: KVPlace) -> None:
    """Raise for the first of ``checked`` whose amax is not finite, after one batched read per device;
    the per-quantizer reads only run to name it."""
    by_device: dict[torch.device, list[torch.Tensor]] = {}
    for _, q in checked:
        if not q.amax.is_meta:
            by_device.setdefault(q.amax.device, []).append(q.amax.reshape(-1))
    if all(bool(torch.isfinite(torch.cat(a)).all()) for a in by_device.values()):
        return
    for full, q in checked:
        _check_quantizer(q, full, packer)


def plan_kv(model: nn.Module, packer: KVPlace, layout: CheckpointNames,
            modules: Optional[list[tuple[str, nn.Module]]] = None) -> tuple[list[KVItem], Optional[FormatSpec]]:
    """The KV items of ``model`` and their common spec (None: no KV quantizer enabled); raises
    :class:`ExportError` naming the quantizer where the format cannot carry it. ``modules``: the
    model's named modules, where the caller has them (quantizers may be left out, and modules without a
    child of an attention quantizer's name: :attr:`~quantlib.export.modules.ModuleWalk.attention`)."""
    checked: list[tuple[str, TensorQuantizer]] = []  # finiteness is checked for all at once, below
    if not modules and modules is not None:
        return [], None  # no attention quantizer anywhere
    try:
        items, first = _walk_kv(model.named_modules() if modules is None else modules, packer, layout, checked)
    except ExportError:
        _refuse_non_finite(checked, packer)  # a non-finite amax met before this error is reported first
        raise
    _refuse_non_finite(checked, packer)
    return items, (first[1] if first is not None else None)


def _walk_kv(modules: Iterable[tuple[str, nn.Module]], packer: KVPlace, layout: CheckpointNames,
             checked: list) -> tuple[list[KVItem], Optional[tuple[str, FormatSpec]]]:
    items: list[KVItem] = []
    first: Optional[tuple[str, FormatSpec]] = None
    for name, module in modules:
        if _NAMES.isdisjoint(module._modules):  # the quantizers are submodules: most modules have none
            continue
        qs = {n: _enabled(module, n) for n in ATTENTION_QUANTIZER_NAMES}
        if not any(qs.values()):
            continue
        prefix = f"{name}." if name else ""
        if qs["p_bmm_quantizer"] is not None:
            raise ExportError(
                f"{prefix}p_bmm_quantizer = {describe(qs['p_bmm_quantizer'].spec)}: no export format carries attention-probabilities "
                "(softmax output) "
                f"quantization; disable it ({_DISABLE})"
            )
        if qs["q_bmm_quantizer"] is not None:
            raise ExportError(f"{prefix}q_bmm_quantizer = {describe(qs['q_bmm_quantizer'].spec)}: no export format carries query "
                              f"quantization; disable it ({_DISABLE})")
        for qname in ("k_bmm_quantizer", "v_bmm_quantizer"):
            if qs[qname] is None:
                other = "v_bmm_quantizer" if qname == "k_bmm_quantizer" else "k_bmm_quantizer"
                raise ExportError(f"{prefix}{qname} = disabled while {prefix}{other} is enabled: a KV cache is quantized as keys and "
                                  "values together; enable both or neither")
            _check_quantizer(qs[qname], prefix + qname, packer, finite=False)
            checked.append((prefix + qname, qs[qname]))
        k, v = qs["k_bmm_quantizer"], qs["v_bmm_quantizer"]
        for qname, q in (("k_bmm_quantizer", k), ("v_bmm_quantizer", v)):
            if first is None:
                first = (prefix + qname, q.spec)
            elif q.spec != first[1]:
                raise ExportError(f"{prefix}{qname} = {describe(q.spec)} differs from {first[0]} = {describe(first[1])}; one export "
                                  "carries one KV-cache scheme")
        items.append(KVItem(layout.checkpoint_name(name), name, k.spec, k.amax, v.amax))
    return items, first
