"""AWQ lite: per linear, the per-input-channel scales ``s = x^alpha / w^(1 - alpha)`` (normalised) of
the alpha that minimises the quantized linear's output error on that linear's own inputs.

Statistics: one forward_loop pass (the max calibration's, on the unquantized model), during which
each served linear keeps its inputs and their per-channel mean |x| and max |x|. Then, per linear:

- ``x``: the mean over forward calls of each call's per-channel mean |x| (sums and call counts are
  SUM-reduced over the data-parallel ranks, so it is the mean over every rank's calls);
- ``w``: per input channel, the mean over rows of |W| / (its group's max |W| + tiny), groups being
  the weight quantizer's blocks along the last dim (or whole rows);
- for each ``alpha`` of ``0, alpha_step, ..., 1``: ``s = clamp(x^alpha / (w^(1-alpha) + tiny), 1e-4,
  1e4) / sqrt(max s * min s)`` and the loss ``sum over calls of mean((x/s) Q(W s)^T - x W^T)^2``,
  with ``Q`` the first weight quantizer using the amax of ``W s`` itself; losses are SUM-reduced
  over the data-parallel ranks, so every rank picks the same alpha (the first of least loss);
- the input quantizer's ``pre_quant_scale`` becomes ``1/s``, the weight quantizer's ``s`` (it
  quantizes ``W s``; recalibrated), a static input quantizer's amax ``max over channels of max|x| / s``.

This is ModelOpt's ``awq_lite`` computed from cached inputs instead of a second forward_loop pass
(the same inputs: both see the unquantized upstream layers). Its alpha grid stops at 1 (ModelOpt's
``arange(0, 1 + step, step)`` also tries 1.2 for a step of 0.3). Experts that no token reached
(linear experts, or experts of a fused-experts module) follow ``expert_input_policy``: "error" raises,
otherwise they keep max calibration with a ``pre_quant_scale`` of ones.

Fused experts (:class:`~quantlib.calib.scaling.ExpertGemm`): each expert of each projection is searched
as a linear on the tokens routed to it (gate_up: its routed hidden states; down: its ``act(gate) * up``),
with its own statistics, alpha and scales; ``awq_lite_alpha`` is then ``{proj: [alpha per expert]}``
(None for an expert no token reached), and the shared input amax the max over the experts' scaled amax.

Parallel layouts (:mod:`~quantlib.collectives`, :mod:`~quantlib.calib.shards`): statistics and
losses are reduced over a linear's replicas (an expert's own only, under expert parallelism); a
linear split over tensor-parallel ranks gets what one process gets on the whole linear: a
column-parallel shard's ``w`` is the mean over every shard's rows and its loss the mean over every
shard's output slice; a row-parallel shard's ``w`` groups spanning the shards take their max over them,
``s`` is normalised by the max and min over every shard's channels, and the loss is on the summed
partial outputs. Every rank picks the same alpha; a row-parallel ``pre_quant_scale`` is the shard's.
"""

from __future__ import annotations

import logging
from typing import Any, Optional

import torch
import torch.nn.functional as F
from torch import nn

from ..calib_config import AwqLiteConfig
from ..collectives import StatSync, stat_sync, targets_digest
from ..kernels import ops
from ..nn.quant_module import QuantModule
from ..nn.tensor_quantizer import TensorQuantizer
from .registry import CalibContext, register_runner
from .scaling import (
    InputRecorder,
    apply_pre_quant_scale,
    check_finite,
    clear_scales,
    first_leaf,
    handle_unreached,
    input_statistics,
    linear_bias,
    progress,
    reached_calls,
    served_linears,
    store_result,
)
from .shards import groups_span_shards, output_mse, peer_mean, search_amax

_log = logging.getLogger("quantlib")


def alphas(step: float) -> list[float]:
    """The alpha grid ``0, step, ..., <= 1`` as ModelOpt builds it (fp32 values)."""
    return [a.item() for a in torch.arange(0, 1.0 + step, step) if a.item() <= 1.0 + 1e-6]


def search_quantizer(module: QuantModule) -> TensorQuantizer:
    """The weight quantizer the search quantizes with: the first of a chain (as ModelOpt)."""
    return first_leaf(module.weight_quantizer)


def weight_scale(w: torch.Tensor, block: Optional[int], target: Any = None, sync: Optional[StatSync] = None,
                 where: str = "") -> torch.Tensor:
    """fp32 per input channel: mean over rows of |W| / (its group's max |W| + tiny). Split over
    tensor-parallel ranks (``target``, ``sync``): a group spanning a row-parallel shard takes its max
    over the shards; a column-parallel shard's rows are averaged with the other shards'."""
    sync = sync or StatSync(None)
    cols, rows = w.shape[-1], w.shape[0]
    a = w.detach().contiguous()  # a transposed expert view would reduce in another order (other bits)
    span = groups_span_shards(block, target, sync, where) if target is not None else False
    if block and not span:
        pad = -cols % block
        if pad:
            a = F.pad(a, (0, pad))
        a = a.reshape(-1, block)
    a = a.abs()
    group_max = a.amax(dim=1, keepdim=True)
    if span:  # the group is the whole row (or one block covering every shard)
        group_max = sync.over_shards(group_max, "max", target)
    a = (a / (group_max + torch.finfo(w.dtype).tiny)).reshape(rows, -1)[:, :cols]
    if target is None or sync.role(target) != "column":
        return a.mean(0).float()
    total = sync.over_shards(a.sum(0, dtype=torch.float32), "sum", target)
    return (total / (rows * sync.shards(target))).to(w.dtype).float()  # a mean in the weight's dtype, as above


def awq_scale(act: torch.Tensor, wscale: torch.Tensor, alpha: float) -> torch.Tensor:
    """fp32 ``s`` for one alpha, clamped and normalised by sqrt(max s * min s)."""
    s = _raw_scale(act, wscale, alpha)
    return (s / (s.max() * s.min()).sqrt()).view(-1)


def _raw_scale(act: torch.Tensor, wscale: torch.Tensor, alpha: float) -> torch.Tensor:
    return (act.pow(alpha) / (wscale.to(act.device).pow(1 - alpha) + torch.finfo(torch.float32).tiny)).clamp(min=1e-4, max=1e4).view(-1)


def candidate_scales(act: torch.Tensor, wscale: torch.Tensor, grid: list[float], target: Any = None,
                     sync: Optional[StatSync] = None) -> list[torch.Tensor]:
    """:func:`awq_scale` of every alpha of ``grid``; a row-parallel shard normalises by the max and min
    over every shard's channels (one MAX and one MIN all-reduce for the whole grid)."""
    sync = sync or StatSync(None)
    raw = [_raw_scale(act, wscale, alpha) for alpha in grid]
    if target is None or sync.role(target) != "row":
        return [(s / (s.max() * s.min()).sqrt()).view(-1) for s in raw]
    hi = sync.over_shards(torch.stack([s.max() for s in raw]), "max", target)
    lo = sync.over_shards(torch.stack([s.min() for s in raw]), "min", target)
    return [(s / (h * m).sqrt()).view(-1) for s, h, m in zip(raw, hi, lo)]


def alpha_losses(module: QuantModule, inputs: list[torch.Tensor], scales: list[torch.Tensor], sync: Optional[StatSync] = None,
                 where: str = "") -> torch.Tensor:
    """fp32 [len(scales)]: per candidate scale, the sum over ``inputs`` of the mean squared output
    error of the whole linear: a row-parallel shard adds its partial errors over the shards before
    squaring them; column-parallel shards average their slices' means (and tensor ranks holding whole
    copies their copies of the loss)."""
    sync = sync or StatSync(None)
    role = sync.role(module)
    w = module.weight.detach()
    bias = None if role == "row" else linear_bias(module)  # a row shard's partial output has no bias
    q = search_quantizer(module)
    actual = [F.linear(x, w, bias) for x in inputs]
    losses = torch.zeros(len(scales), dtype=torch.float32, device=w.device)
    for k, s in enumerate(scales):
        x_w = w * s.to(w.dtype)
        wq = ops.fake_quant(x_w, q.spec, search_amax(q, x_w, module, sync, where), q.attrs.backend)
        inv = (1 / s).to(w.dtype)
        for x, ref in zip(inputs, actual):
            losses[k] += output_mse((F.linear(x * inv, wq, bias) - ref).float(), role, module, sync)
    return peer_mean(losses, module, sync)


def _block_of(q: TensorQuantizer) -> Optional[int]:
    return q.spec.block[-1] if q.spec.block is not None else None


@register_runner("awq_lite")
def run_awq_lite(model: nn.Module, cfg: AwqLiteConfig, ctx: CalibContext) -> None:
    """One forward_loop pass caching each linear's inputs, then the alpha search per linear."""
    if ctx.max_only_without_loop("awq_lite", model, "its scales come from the activations"):
        return
    targets, rec, calls = record_inputs(model, "awq_lite", ctx)
    search(targets, rec, calls, cfg, ctx, keep_inputs=False)


def record_inputs(model: nn.Module, method: str, ctx: CalibContext) -> tuple[list, InputRecorder, list[float]]:
    """The served linears (their old scales dropped), their inputs from one max-calibration pass, and
    each one's number of forward calls over its replicas (unreached ones handled)."""
    sync = stat_sync(ctx)
    targets = []
    for name, m, w in served_linears(model, method, needs_input=False, tensor_parallel=ctx.tensor_parallel):
        if m.input_quantizer.is_enabled and m.input_quantizer.axis is not None:
            _log.warning("%s: %s needs a per-tensor input quantizer (axis=%s); it keeps max calibration", name, method,
                         m.input_quantizer.axis)
            continue
        clear_scales(m)
        targets.append((name, m, w))
    rec = InputRecorder([(n, m) for n, m, _ in targets], keep_inputs=True)
    sync.step(method, lambda: _record(model, rec, ctx), targets_digest(method, targets))
    calls = reached_calls(targets, rec, sync)
    sync.step(method, lambda: handle_unreached(method, [(n, m) for (n, m, _), c in zip(targets, calls) if c == 0], ctx.expert_input_policy))
    return targets, rec, calls


def search(targets: list, rec: InputRecorder, calls: list[float], cfg: AwqLiteConfig, ctx: CalibContext, keep_inputs: bool) -> None:
    """The alpha search of every target with calls, then the chosen scales applied. Every rank calls the
    replicas' reduction of every target's losses (zeros where it got no tokens), and raises, together
    with the others, only once every target is searched."""
    sync = stat_sync(ctx)
    grid = alphas(cfg.alpha_step)
    sums, amaxes = input_statistics(targets, rec, sync, mean=True)
    acts = [s / max(c, 1.0) for s, c in zip(sums, calls)]

    def check_inputs() -> None:
        for (name, _, _), act, c in zip(targets, acts, calls):
            if c:
                check_finite(f"{name}.input_quantizer", "input", act)

    sync.step("awq_lite", check_inputs)
    chosen, bad = [], []
    with torch.no_grad():
        for (name, m, w), n_calls, act, amax in progress(zip(targets, calls, acts, amaxes), "awq_lite search", len(targets)):
            losses = torch.zeros(len(grid), dtype=torch.float32, device=w.device)
            if n_calls:
                wscale = weight_scale(w, _block_of(search_quantizer(m)), m, sync, name)
                scales = candidate_scales(act, wscale, grid, m, sync)
                losses = alpha_losses(m, rec.inputs[name], scales, sync, name)
            losses = sync.over_replicas(losses, "sum", m.is_expert)
            if not keep_inputs:
                rec.inputs[name] = []  # free the cache as we go
            if not n_calls:
                continue
            if not bool(torch.isfinite(losses).all()):
                bad.append((name, losses))
                continue
            best = int(torch.argmin(losses))
            chosen.append((m, scales[best], grid[best], losses, amax))
    sync.step("awq_lite", lambda: _raise_nonfinite(bad))
    for m, scale, alpha, losses, amax in chosen:
        apply_pre_quant_scale(m, 1.0 / scale, amax)
        store_result(m, "awq_lite_alpha", alpha)
        if cfg.debug:
            store_result(m, "awq_lite_losses", dict(zip(grid, losses.tolist())))


def _raise_nonfinite(bad: list[tuple[str, torch.Tensor]]) -> None:
    for name, losses in bad[:1]:
        check_finite(f"{name}.weight_quantizer", "search loss", losses)


def _record(model: nn.Module, rec: InputRecorder, ctx: CalibContext) -> None:
    with rec:
        ctx.max_calibrate(model)
