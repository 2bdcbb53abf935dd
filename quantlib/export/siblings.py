"""Give siblings that consumers fuse (q/k/v, gate/up) one per-tensor / global weight amax in the model
itself, so that the model is evaluated with the amax its export will carry."""

from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from ..nn.containers import SequentialQuantizer
from ..nn.tensor_quantizer import TensorQuantizer
from .layouts import ModelLayout, layout_for


def share_sibling_amax(model: nn.Module, layout: Optional[ModelLayout] = None) -> dict[tuple[str, ...], float]:
    """Set each sibling group's per-tensor weight amax to the group's max; returns {group names: amax}
    for the groups changed. Weights the checkpoint saves as one key (HRM-Text's gate / q / k / v as ``gqkv_proj``)
    are one group too. Call it after calibration and before evaluating and exporting."""
    layout = layout or layout_for(model)
    groups: dict[tuple, list[tuple[str, TensorQuantizer]]] = {}
    within = {s[: -len(".weight")]: key for key, (srcs, _) in layout.built.items() for s in srcs if s.endswith(".weight")}
    for name, module in model.named_modules():
        q = getattr(module, "weight_quantizer", None)
        if isinstance(q, SequentialQuantizer) and q.is_enabled:
            q = q[-1]  # a chain's per-tensor member (W4A8's FP8) is what siblings share
        parent, _, leaf = name.rpartition(".")
        group = (parent, layout.group_of(name, leaf)) if name not in within else (within[name],)
        if group[-1] is None or not isinstance(q, TensorQuantizer) or not q.is_enabled or q.amax is None or q.amax.numel() != 1:
            continue
        groups.setdefault(group, []).append((name, q))
    changed = {}
    for members in groups.values():
        values = [float(q.amax.reshape(())) for _, q in members]
        if len(members) > 1 and len(set(values)) > 1:
            top = max(values)
            for _, q in members:
                q.amax = torch.full_like(q.amax, top)
            changed[tuple(n for n, _ in members)] = top
    return changed
