"""SmoothQuant: per-input-channel scales that move activation outliers into the weights.

Statistics: one forward_loop pass (the max calibration's), during which each served linear records
its input's per-channel max |x| (MAX-reduced over the data-parallel ranks). Then, per linear, with
``a`` that amax and ``w`` the per-input-channel max |W|::

    s = a^alpha / w^(1 - alpha)   (channels with a <= 2^-31: s = 1; then clamped to [1e-4, 1e4])

the input quantizer's ``pre_quant_scale`` is ``1/s``, the weight quantizer's ``s`` (it quantizes
``W * s``, recalibrated) and the input's per-tensor amax is ``max(a / s)``, as ModelOpt computes them.
As ModelOpt, only INT8 inputs and weights are smoothed (other linears keep max calibration, with a
warning). The scales stay in the input quantizer (folding them into a preceding norm is not done).
Experts no token reached follow ``expert_input_policy`` as in awq_lite. Fused experts: each expert of
each projection is smoothed as a linear with its own routed inputs' amax (row e of the input
quantizer's 2-D ``pre_quant_scale``); the shared input amax is the max over the experts'.

Parallel layouts: ``a`` is MAX-reduced over the linear's replicas (an expert's own only, under expert
parallelism) and, for a column-parallel linear, over its shards; ``w`` over a column-parallel linear's
shards (each holds some rows). A row-parallel shard's channels are its own: its scales are a shard of
the single-process ones.
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from ..calib_config import SmoothQuantConfig
from ..collectives import stat_sync, targets_digest
from ..formats import Kind
from ..nn.tensor_quantizer import TensorQuantizer
from .registry import CalibContext, register_runner
from .scaling import (
    InputRecorder,
    apply_pre_quant_scale,
    check_finite,
    clear_scales,
    handle_unreached,
    input_statistics,
    reached_calls,
    served_linears,
)

_log = logging.getLogger("quantlib")

#: activation amax at or below this leaves its channel unscaled (ModelOpt's 1 / 2^31)
ZERO_AMAX = 1.0 / (1 << 31)


def smoothing_scale(act_amax: torch.Tensor, weight_amax: torch.Tensor, alpha: float) -> torch.Tensor:
    """fp32 ``pre_quant_scale`` = 1/s = w^(1-alpha) / a^alpha per input channel, ModelOpt's guards."""
    a, w = act_amax.float(), weight_amax.float()
    scale = w.pow(1 - alpha) / a.pow(alpha)
    scale = torch.where(a <= ZERO_AMAX, torch.ones_like(scale), scale)
    return scale.clamp(min=1e-4, max=1e4)


def _is_int8(q: TensorQuantizer) -> bool:
    return isinstance(q, TensorQuantizer) and q.spec.kind == Kind.INT and q.spec.num_bits == 8


@register_runner("smoothquant")
def run_smoothquant(model: nn.Module, cfg: SmoothQuantConfig, ctx: CalibContext) -> None:
    """Max calibration with per-channel input statistics, then smoothing of every INT8 linear."""
    if ctx.max_only_without_loop("smoothquant", model, "its scales come from the activations"):
        return
    sync = stat_sync(ctx)
    targets = []
    for name, m, w in served_linears(model, "smoothquant", needs_input=True, tensor_parallel=ctx.tensor_parallel):
        if _is_int8(m.input_quantizer) and _is_int8(m.weight_quantizer) and m.input_quantizer.axis is None:
            targets.append((name, m, w))
        else:
            _log.warning("%s: smoothquant smooths per-tensor INT8 inputs with INT8 weights only; it keeps max calibration", name)
    for _, m, _ in targets:
        clear_scales(m)
    rec = InputRecorder([(n, m) for n, m, _ in targets])

    def record() -> None:
        with rec:
            ctx.max_calibrate(model)

    sync.step("smoothquant", record, targets_digest("smoothquant", targets))
    # reached on any replica (an expert may get tokens on one rank only): every replica decides alike
    calls = reached_calls(targets, rec, sync)
    sync.step("smoothquant", lambda: handle_unreached("smoothquant", [(n, m) for (n, m, _), c in zip(targets, calls) if c == 0],
                                                      ctx.expert_input_policy))
    _, act_amax = input_statistics(targets, rec, sync, mean=False)
    with torch.no_grad():
        # per input channel, over the rows: a column-parallel shard holds some of them
        weight_amax = [sync.over_shards(w.detach().abs().amax(dim=0).float(), "max", m) for _, m, w in targets]

    def check() -> None:
        for (name, _, _), a, wa, c in zip(targets, act_amax, weight_amax, calls):
            if c:
                check_finite(f"{name}.input_quantizer", "input's per-channel amax", a)
                check_finite(f"{name}.weight_quantizer", "weight", wa)

    sync.step("smoothquant", check)  # a row-parallel shard's NaN raises on every rank
    with torch.no_grad():
        for (_, m, _), a, wa, c in zip(targets, act_amax, weight_amax, calls):
            if c:
                apply_pre_quant_scale(m, smoothing_scale(a, wa, cfg.alpha), a)
