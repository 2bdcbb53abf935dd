"""Siblings that consumers fuse share one NVFP4 global amax before static block scales are chosen.

ModelOpt 0.47's default shared state (``SHARED_PATTERNS``): the weight quantizers of ``q_proj`` /
``k_proj`` / ``v_proj``, of ``gate_proj`` / ``up_proj`` and of ``w1`` / ``w3`` under one parent take
the max of their global amax, so the block scales searched against it stay valid when a consumer fuses
the siblings (and ``quantlib.export.share_sibling_amax`` finds nothing left to change).
"""

from __future__ import annotations

import torch
from torch import nn

from ..nn.tensor_quantizer import TensorQuantizer

#: leaf module name -> its sibling group (ModelOpt's SHARED_PATTERNS)
SIBLING_GROUPS: dict[str, int] = {"q_proj": 0, "k_proj": 0, "v_proj": 0, "gate_proj": 1, "up_proj": 1, "w1": 2, "w3": 2}


def share_static_block_global_amax(model: nn.Module) -> dict[tuple[str, ...], float]:
    """Give each sibling group of NVFP4 static-block weight quantizers the max of their global amax;
    returns {module names: the shared amax} of the groups changed."""
    groups: dict[tuple[str, int], list[tuple[str, TensorQuantizer]]] = {}
    for name, module in model.named_modules():
        parent, _, leaf = name.rpartition(".")
        q = getattr(module, "weight_quantizer", None)
        if leaf in SIBLING_GROUPS and isinstance(q, TensorQuantizer) and q.is_enabled and q.static_blocks and q.amax is not None:
            groups.setdefault((parent, SIBLING_GROUPS[leaf]), []).append((name, q))
    changed = {}
    for members in groups.values():
        top = torch.stack([q.amax.reshape(()).to(members[0][1].amax.device) for _, q in members]).max()
        if len(members) > 1 and any(not torch.equal(q.amax.reshape(()), top.to(q.amax.device)) for _, q in members):
            for _, q in members:
                q.amax = top.reshape(q.amax.shape).to(q.amax.device)
            changed[tuple(n for n, _ in members)] = float(top)
    return changed
