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
"""

from __future__ import annotations

import logging
from typing import Any, Callable, Optional

import torch
import torch.nn.functional as F
from torch import nn

from ..formats import Kind
from ..kernels import ops
from ..nn.quant_module import QuantModule
from ..nn.tensor_quantizer import CalibrationError, TensorQuantizer
from .max import static_amax
from .registry import AwqLiteConfig, CalibContext, register_runner
from .scaling import InputRecorder, apply_pre_quant_scale, check_finite, clear_scales, first_leaf, handle_unreached, linear_bias, progress, served_linears, store_result

_log = logging.getLogger("quantlib")


def alphas(step: float) -> list[float]:
    """The alpha grid ``0, step, ..., <= 1`` as ModelOpt builds it (fp32 values)."""
    return [a.item() for a in torch.arange(0, 1.0 + step, step) if a.item() <= 1.0 + 1e-6]


def search_quantizer(module: QuantModule) -> TensorQuantizer:
    """The weight quantizer the search quantizes with: the first of a chain (as ModelOpt)."""
    return first_leaf(module.weight_quantizer)


def weight_scale(w: torch.Tensor, block: Optional[int]) -> torch.Tensor:
    """fp32 per input channel: mean over rows of |W| / (its group's max |W| + tiny)."""
    cols = w.shape[-1]
    a = w.detach().contiguous()  # a transposed expert view would reduce in another order (other bits)
    if block:
        pad = -cols % block
        if pad:
            a = F.pad(a, (0, pad))
        a = a.reshape(-1, block)
    a = a.abs()
    a = a / (a.amax(dim=1, keepdim=True) + torch.finfo(w.dtype).tiny)
    return a.reshape(w.shape[0], -1)[:, :cols].mean(0).float()


def awq_scale(act: torch.Tensor, wscale: torch.Tensor, alpha: float) -> torch.Tensor:
    """fp32 ``s`` for one alpha, clamped and normalised by sqrt(max s * min s)."""
    s = (act.pow(alpha) / (wscale.to(act.device).pow(1 - alpha) + torch.finfo(torch.float32).tiny)).clamp(min=1e-4, max=1e4).view(-1)
    return (s / (s.max() * s.min()).sqrt()).view(-1)


def _quantize_like(q: TensorQuantizer, x: torch.Tensor) -> torch.Tensor:
    """``q``'s fake quant of ``x`` with the amax of ``x`` itself (no calibrated amax)."""
    amax = None
    if q.needs_calibration and q.spec.kind != Kind.NVFP4:
        amax = static_amax(x, q.spec, q.axis, q.attrs.backend)
    return ops.fake_quant(x, q.spec, amax, q.attrs.backend)


def alpha_losses(module: QuantModule, inputs: list[torch.Tensor], act: torch.Tensor, wscale: torch.Tensor, grid: list[float]) -> torch.Tensor:
    """fp32 [len(grid)]: per alpha, the sum over ``inputs`` of the mean squared output error."""
    w, bias = module.weight.detach(), linear_bias(module)
    q = search_quantizer(module)
    actual = [F.linear(x, w, bias) for x in inputs]
    losses = torch.zeros(len(grid), dtype=torch.float32, device=w.device)
    for k, alpha in enumerate(grid):
        s = awq_scale(act, wscale, alpha)
        wq = _quantize_like(q, w * s.to(w.dtype))
        inv = (1 / s).to(w.dtype)
        for x, ref in zip(inputs, actual):
            losses[k] += (F.linear(x * inv, wq, bias) - ref).float().pow(2).mean()
    return losses


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
    each one's number of forward calls over every data-parallel rank (unreached ones handled)."""
    targets = []
    for name, m, w in served_linears(model, method, needs_input=False, expert_parallel=ctx.expert_parallel, tensor_parallel=ctx.tensor_parallel):
        if m.input_quantizer.is_enabled and m.input_quantizer.axis is not None:
            _log.warning("%s: %s needs a per-tensor input quantizer (axis=%s); it keeps max calibration", name, method, m.input_quantizer.axis)
            continue
        clear_scales(m)
        targets.append((name, m, w))
    rec = InputRecorder([(n, m) for n, m, _ in targets], keep_inputs=True)
    collective_step(ctx, targets, lambda: _record(model, rec, ctx))
    device = targets[0][2].device if targets else torch.device("cpu")
    calls = ctx.all_reduce_sum(torch.tensor([float(rec.calls[n]) for n, _, _ in targets], device=device)).tolist()
    handle_unreached(method, [(n, m) for (n, m, _), c in zip(targets, calls) if c == 0], ctx.expert_input_policy)
    return targets, rec, calls


def search(targets: list, rec: InputRecorder, calls: list[float], cfg: AwqLiteConfig, ctx: CalibContext, keep_inputs: bool) -> None:
    """The alpha search of every target with calls; applies the chosen scales."""
    grid = alphas(cfg.alpha_step)
    with torch.no_grad():
        for (name, m, w), n_calls in progress(zip(targets, calls), "awq_lite search", len(targets)):
            if n_calls == 0:
                continue
            mean_sum = rec.mean_abs_sum.get(name, torch.zeros(w.shape[1], device=w.device))
            act = ctx.all_reduce_sum(mean_sum.clone()) / n_calls
            check_finite(f"{name}.input_quantizer", "input", act)  # global: every rank raises here together
            wscale = weight_scale(w, _block_of(search_quantizer(m)))
            losses = ctx.all_reduce_sum(alpha_losses(m, rec.inputs[name], act, wscale, grid))
            check_finite(f"{name}.weight_quantizer", "search loss", losses)
            best = int(torch.argmin(losses))
            scale = awq_scale(act, wscale, grid[best])
            amax = rec.amax.get(name, torch.zeros(w.shape[1], device=w.device))
            apply_pre_quant_scale(m, 1.0 / scale, ctx.all_reduce_max(amax.clone()))
            store_result(m, "awq_lite_alpha", grid[best])
            if cfg.debug:
                store_result(m, "awq_lite_losses", dict(zip(grid, losses.tolist())))
            if not keep_inputs:
                rec.inputs[name] = []  # free the cache as we go


def _record(model: nn.Module, rec: InputRecorder, ctx: CalibContext) -> None:
    with rec:
        ctx.max_calibrate(model)


def collective_step(ctx: CalibContext, targets: list, step: Callable[[], Any]) -> None:
    """Run ``step``; a CalibrationError on any data-parallel rank is raised on every rank here, before
    the search's collectives, so no rank waits in one the others never reach."""
    error = None
    try:
        step()
    except CalibrationError as exc:
        error = exc
    device = targets[0][2].device if targets else torch.device("cpu")
    failed = ctx.all_reduce_max(torch.tensor([0.0 if error is None else 1.0], device=device))
    if error is not None:
        raise error
    if failed.item():
        raise CalibrationError("calibration failed on another data-parallel rank (its error is reported there)")
