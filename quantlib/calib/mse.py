"""MSE calibration: per group (tensor / channel / block), the weight amax that minimises the weight's
quantization error among multiples of its max amax.

Statistics: none beyond max calibration (run first; activations keep their max amax). Then each
static weight quantizer (each member of a grouped one, on its own tensor) tries the amax
``max_amax * m`` for every ``m`` of ModelOpt's grid ``linspace(start, stop, ceil((stop - start) / step)
+ 1)`` and keeps, per group, the first ``m`` of least summed squared error. The candidates are
quantized together: the weight is stacked once per candidate along a new leading dim and quantized by
one kernel call with a per-candidate, per-group amax, on the weight's device; chunks of candidates
bound the memory (:data:`CHUNK_ELEMENTS`).
"""

from __future__ import annotations

import logging
import math
from typing import Iterator

import torch
from torch import nn

from ..formats import FormatSpec, Kind
from ..formats.blocks import to_blocks
from ..kernels import ops
from ..nn.containers import GroupedQuantizer
from ..nn.quant_module import QuantModule
from ..nn.tensor_quantizer import TensorQuantizer
from .registry import CalibContext, MseConfig, register_runner
from .scaling import progress

_log = logging.getLogger("quantlib")

#: largest number of weight elements (candidates x weight) quantized by one kernel call
CHUNK_ELEMENTS = 1 << 24


def multipliers(cfg: MseConfig) -> torch.Tensor:
    """ModelOpt's fp32 candidate multipliers of the max amax."""
    steps = math.ceil((cfg.stop_multiplier - cfg.start_multiplier) / cfg.step_size) + 1
    return torch.linspace(cfg.start_multiplier, cfg.stop_multiplier, steps=steps)


def group_sq_error(err: torch.Tensor, spec: FormatSpec, amax_shape: tuple[int, ...]) -> torch.Tensor:
    """Sum of the elementwise ``err`` [K, *w] over each group of an amax of ``amax_shape`` -> [K, *amax]."""
    if spec.block is not None:
        return to_blocks(err, spec.block).sum(dim=-1)
    return err.sum_to_size((err.shape[0],) + tuple(amax_shape))


def search_amax(w: torch.Tensor, spec: FormatSpec, amax: torch.Tensor, candidates: torch.Tensor, backend: str = "auto") -> tuple[torch.Tensor, torch.Tensor]:
    """(best amax, index of the chosen candidate per group) of weight ``w`` with max amax ``amax``
    (shape as the quantizer stores it): per group, the first candidate of least squared error."""
    x = w.detach().float()
    shape = tuple(amax.shape)
    a = amax.reshape(shape if shape else (1,) * x.dim()).to(x.device)  # per tensor: one amax broadcast over x
    cands = candidates.to(x.device, torch.float32)
    chunk = max(1, CHUNK_ELEMENTS // max(1, x.numel()))
    losses = []
    for start in range(0, cands.numel(), chunk):
        c = cands[start : start + chunk]
        batch_amax = a.unsqueeze(0) * c.reshape((-1,) + (1,) * a.dim())
        xs = x.unsqueeze(0).expand((c.numel(),) + tuple(x.shape)).contiguous()
        xq = ops.fake_quant(xs, spec, batch_amax, backend)
        losses.append(group_sq_error((xq - xs).square(), spec, tuple(a.shape)))
    loss = torch.cat(losses)
    best = torch.argmin(loss, dim=0)  # first minimum: the smaller multiplier wins ties
    chosen = a * cands[best]
    return chosen.reshape(shape), best.reshape(shape)


def _static_weight_members(module: QuantModule) -> Iterator[tuple[str, TensorQuantizer, torch.Tensor]]:
    for name, tensors in module.weight_groups():
        q = getattr(module, name)
        pairs = list(zip(q, tensors)) if isinstance(q, GroupedQuantizer) else [(q, tensors[0])]
        for i, (leaf, w) in enumerate(pairs):
            where = f"{name}.{i}" if isinstance(q, GroupedQuantizer) else name
            if not isinstance(leaf, TensorQuantizer):
                _log.info("mse: %s is a chain of quantizers; it keeps its max amax", where)
                continue
            if leaf.is_enabled and leaf.needs_calibration and leaf.spec.kind != Kind.NVFP4:
                yield where, leaf, w


@register_runner("mse")
def run_mse(model: nn.Module, cfg: MseConfig, ctx: CalibContext) -> None:
    """Max calibration, then the MSE search of every static weight quantizer's amax."""
    ctx.max_calibrate(model)
    candidates = multipliers(cfg)
    members = [(leaf, w) for _, module in model.named_modules() if isinstance(module, QuantModule) for _, leaf, w in _static_weight_members(module)]
    with torch.no_grad():
        for leaf, w in progress(members, "mse search", len(members)):
            if leaf.amax is None or leaf.amax.is_meta:
                continue
            leaf.amax, _ = search_amax(leaf.pre_scale(w), leaf.spec, leaf.amax, candidates, leaf.attrs.backend)
