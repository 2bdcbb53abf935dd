"""MSE calibration: per group (tensor / channel / block), the weight amax that minimises the weight's
quantization error among multiples of its max amax.

Statistics: none beyond max calibration (run first; activations keep their max amax). Then each
static weight quantizer (each member of a grouped one, on its own tensor) tries the amax
``max_amax * m`` for every ``m`` of ModelOpt's grid ``linspace(start, stop, ceil((stop - start) / step)
+ 1)`` and keeps, per group, the first ``m`` of least summed squared error. The candidates are
quantized together: the weight is stacked once per candidate along a new leading dim and quantized by
one kernel call with a per-candidate, per-group amax, on the weight's device; chunks of candidates
bound the memory and, on the CPU, keep the temporaries in the cache (:func:`chunk_elements`).

NVFP4 weights with dynamic blocks (``"type": "dynamic"``, e.g. ``W4A16_NVFP4_CFG``) search their global
amax, as ModelOpt's ``MseCalibrator`` does with the per-tensor ``_amax`` of such a quantizer (its op's
global amax): each candidate ``max_amax * m`` is the fake quant's global amax, the E4M3 block scales
recomputed from every block's max against it (a block whose max exceeds ``m * max_amax`` gets scale 448
and is clipped there), and the first candidate of least squared error summed over the whole weight
becomes the quantizer's amax, which fake quant and export use. The kernels take one global amax, so
each candidate is one kernel call over the whole weight (a group of one: nothing to batch), its loss
kept on the device; one argmin reads the choice.

NVFP4 weights with static blocks search their block amax (the global amax stays the max-calibrated
one, which the block scales are relative to). ``fp8_scale_sweep`` (ModelOpt's
``NVFP4_W4A4_WEIGHT_MSE_FP8_SWEEP_CFG``) replaces the multipliers by the 126 positive finite E4M3
values ``v``: block amax ``A * v / 448``, whose block scale is exactly ``v`` (times the global scale),
so every block tries every E4M3 scale; only those weights are searched then, the others keep their
max amax (as in ModelOpt). Static-block siblings that consumers fuse (q/k/v, gate/up) first share
their max global amax in max calibration first (:mod:`quantlib.calib.shared_global_amax`), as
ModelOpt's shared state does; under tensor parallelism (whose sync moves the global amax afterwards) the
search refuses them.
"""

from __future__ import annotations

import logging
import math
from typing import Callable, Iterator

import torch
from torch import nn

from ..calib_config import MseConfig
from ..formats import FormatSpec
from ..formats.blocks import to_blocks
from ..kernels import block_amax, ops
from ..nn.containers import GroupedQuantizer
from ..nn.quant_module import QuantModule
from ..nn.tensor_quantizer import TensorQuantizer
from .registry import CalibContext, register_runner
from .scaling import progress

_log = logging.getLogger("quantlib")

#: largest number of weight elements (candidates x weight) quantized by one kernel call on a GPU, which
#: needs large calls to be busy
CHUNK_ELEMENTS = 1 << 24
#: the same on the CPU, where the stacked candidates and the error's temporaries (a few fp32 copies of a
#: chunk, 1 MiB each) must stay in the cache: with 1 << 24 (tens of MB of temporaries) the search was
#: memory-bound (benchmarks/RESULTS.md, "mse on the CPU")
CPU_CHUNK_ELEMENTS = 1 << 18


def chunk_elements(device: torch.device) -> int:
    """Weight elements one kernel call of the search quantizes on ``device``."""
    return CPU_CHUNK_ELEMENTS if device.type == "cpu" else CHUNK_ELEMENTS


def multipliers(cfg: MseConfig) -> torch.Tensor:
    """ModelOpt's fp32 candidate multipliers of the max amax."""
    steps = math.ceil((cfg.stop_multiplier - cfg.start_multiplier) / cfg.step_size) + 1
    return torch.linspace(cfg.start_multiplier, cfg.stop_multiplier, steps=steps)


def fp8_scale_candidates() -> torch.Tensor:
    """The 126 positive finite E4M3 values divided by 448, ascending (ModelOpt's sweep candidates)."""
    values = torch.arange(0, 128, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    return values[torch.isfinite(values) & (values > 0)] / 448.0


def group_sq_error(err: torch.Tensor, spec: FormatSpec, amax_shape: tuple[int, ...]) -> torch.Tensor:
    """Sum of the elementwise ``err`` [K, *w] over each group of an amax of ``amax_shape`` -> [K, *amax]."""
    if spec.block is not None:
        return to_blocks(err, spec.block).sum(dim=-1)
    return err.sum_to_size((err.shape[0],) + tuple(amax_shape))


def search_amax(w: torch.Tensor, spec: FormatSpec, amax: torch.Tensor, candidates: torch.Tensor,
                backend: str = "auto") -> tuple[torch.Tensor, torch.Tensor]:
    """(best amax, index of the chosen candidate per group) of weight ``w`` with max amax ``amax``
    (shape as the quantizer stores it): per group, the first candidate of least squared error."""
    shape = tuple(amax.shape)
    a = amax.reshape(shape if shape else (1,) * w.dim()).to(w.device)  # per tensor: one amax broadcast over x
    cands = candidates.to(w.device, torch.float32)
    batch = a.unsqueeze(0) * cands.reshape((-1,) + (1,) * a.dim())
    best = _first_least(w, spec, batch, lambda xs, c: ops.fake_quant(xs, spec, c, backend))
    return (a * cands[best]).reshape(shape), best.reshape(shape)


def search_global_amax(w: torch.Tensor, spec: FormatSpec, amax: torch.Tensor, candidates: torch.Tensor,
                       backend: str = "auto") -> tuple[torch.Tensor, torch.Tensor]:
    """NVFP4 dynamic blocks: (best global amax, index of the chosen candidate) of weight ``w`` with max
    global amax ``amax``: the first multiple of least squared error summed over the whole weight."""
    a = amax.to(w.device, torch.float32)
    batch = a.reshape(()) * candidates.to(w.device, torch.float32)  # [K], as ModelOpt's amax * candidate
    x = w.detach().float()  # as ModelOpt: the error of the fp32 weight's fake quant
    losses = torch.stack([(ops.fake_quant(x, spec, g, backend) - x).square().sum() for g in batch])
    best = torch.argmin(losses)  # first minimum: the smaller candidate wins ties
    return batch[best].reshape(a.shape), best


def search_block_amax(w: torch.Tensor, spec: FormatSpec, global_amax: torch.Tensor, block_amax: torch.Tensor, candidates: torch.Tensor,
                      sweep: bool, backend: str = "auto") -> tuple[torch.Tensor, torch.Tensor]:
    """NVFP4 static blocks: (best block amax, index of the chosen candidate per block) of weight ``w``
    against the fixed ``global_amax``: candidates are multipliers of ``block_amax``, or with ``sweep``
    the fractions ``v / 448`` of the global amax (:func:`fp8_scale_candidates`)."""
    g = global_amax.to(w.device, torch.float32).reshape(())
    cands = candidates.to(w.device, torch.float32)
    base = torch.ones_like(block_amax, dtype=torch.float32, device=w.device) * g if sweep else block_amax.to(w.device, torch.float32)
    batch = base.unsqueeze(0) * cands.reshape((-1,) + (1,) * base.dim())
    best = _first_least(w, spec, batch, lambda xs, c: ops.fake_quant(xs, spec, g, backend, block_amax=c))
    return base * cands[best], best


def _first_least(w: torch.Tensor, spec: FormatSpec, batch_amax: torch.Tensor,
                 quant: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """Per group, the index of the first of the ``K`` candidate amax ``batch_amax`` [K, *amax] whose
    fake quant ``quant(stacked w, amax chunk)`` has the least summed squared error over the group."""
    x = w.detach().float()
    chunk = max(1, chunk_elements(x.device) // max(1, x.numel()))
    losses = []
    for start in range(0, batch_amax.shape[0], chunk):
        c = batch_amax[start : start + chunk]
        xs = x.unsqueeze(0).expand((c.shape[0],) + tuple(x.shape)).contiguous()
        losses.append(group_sq_error((quant(xs, c) - xs).square(), spec, tuple(c.shape[1:])))
    return torch.argmin(torch.cat(losses), dim=0)  # first minimum: the smaller candidate wins ties


def _static_weight_members(module: QuantModule) -> Iterator[tuple[str, TensorQuantizer, torch.Tensor]]:
    for name, tensors in module.weight_groups():
        q = getattr(module, name)
        pairs = list(zip(q, tensors)) if isinstance(q, GroupedQuantizer) else [(q, tensors[0])]
        for i, (leaf, w) in enumerate(pairs):
            where = f"{name}.{i}" if isinstance(q, GroupedQuantizer) else name
            if not isinstance(leaf, TensorQuantizer):
                _log.info("mse: %s is a chain of quantizers; it keeps its max amax", where)
                continue
            if leaf.is_enabled and leaf.needs_calibration:  # dynamic NVFP4 blocks: the global amax is searched
                yield where, leaf, w


@register_runner("mse")
def run_mse(model: nn.Module, cfg: MseConfig, ctx: CalibContext) -> None:
    """Max calibration, then the MSE search of every static weight quantizer's amax (NVFP4 dynamic
    blocks: the global amax; with ``fp8_scale_sweep``: the E4M3 scale sweep of NVFP4 static block
    weights only)."""
    ctx.max_calibrate(model)
    candidates = fp8_scale_candidates() if cfg.fp8_scale_sweep else multipliers(cfg)
    members = [(leaf, w) for _, module in model.named_modules() if isinstance(module, QuantModule)
               for _, leaf, w in _static_weight_members(module)]
    if cfg.fp8_scale_sweep:
        members = [(leaf, w) for leaf, w in members if leaf.static_blocks]
    statics = [leaf for leaf, _ in members if leaf.static_blocks]
    if statics and ctx.tensor_parallel:  # the TP sync after calibration would move the global amax under them
        raise ValueError(f"{statics[0]._qname}: mse on NVFP4 static block scales under tensor parallelism is not supported (ModelOpt "
                         "refuses it too): calibrate at TP=1")
    with torch.no_grad():
        for leaf, w in progress(members, "mse search", len(members)):
            if leaf.amax is None or leaf.amax.is_meta:
                continue
            x = leaf.pre_scale(w)
            if leaf.static_blocks:
                blocks = leaf.block_amax if leaf.block_amax is not None else block_amax(x.detach(), leaf.spec.block,
                                                                                        backend=leaf.attrs.backend)
                leaf.block_amax, _ = search_block_amax(x, leaf.spec, leaf.amax, blocks, candidates, cfg.fp8_scale_sweep, leaf.attrs.backend)
            elif leaf.spec.two_level:
                leaf.amax, _ = search_global_amax(x, leaf.spec, leaf.amax, candidates, leaf.attrs.backend)
            else:
                leaf.amax, _ = search_amax(x, leaf.spec, leaf.amax, candidates, leaf.attrs.backend)
