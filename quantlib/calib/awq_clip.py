"""AWQ clip: per weight group, the fraction of its max amax that minimises the quantized linear's
output error on that linear's own inputs; ``awq_full`` runs awq_lite first, on the same inputs.

Statistics: one forward_loop pass (the max calibration's, on the unquantized model) keeping each
served linear's inputs. Then, per linear whose first weight quantizer has a static amax over blocks
along the last dim (INT / FP8 blocks) or is NVFP4 (its global amax is clipped), with ``W'`` the
weight its quantizer sees (``W s`` after awq_lite) and ``x'`` the input times its
``pre_quant_scale``, for each ratio ``r`` of ``min_clip_ratio, + shrink_step, ..., 1`` (ModelOpt's
grid, rounded to 2 decimals):

- blocks: per (output channel, block), the mean over (at most ``max_tokens_per_batch`` per call,
  evenly strided) tokens of ``(sum over the block of x' (Q_r(W') - W'))^2``, summed over calls;
- NVFP4: the mean of ``(x' Q_r(W')^T - x' W'^T)^2`` summed over calls;

``Q_r`` quantizing with ``r`` times the max amax of ``W'``. Blocks search every ratio at once (one
batched GEMM per call over ``W'`` and its quantized copies, bit for bit the per-ratio losses). Losses are SUM-reduced over the
data-parallel ranks; each group keeps the first ratio of least loss. As ModelOpt's ``awq_clip``,
computed from cached inputs instead of another forward_loop pass. Chains of weight quantizers (W4A8)
and other layouts keep their amax, with a warning. Fused experts: each expert's weight quantizer member
is searched on that expert's routed inputs; ``awq_clip_ratio`` is ``{proj: [ratio per expert]}``.

Parallel layouts: losses are SUM-reduced over a linear's replicas (an expert's own only). Under tensor
parallelism a block lies in one shard (a column-parallel shard's rows, a row-parallel shard's columns
where the block divides them) and is searched there alone; a row-parallel block covering every shard
takes its amax over the shards and its loss on the summed partial outputs, as does NVFP4's global
amax on a row-parallel linear; a column-parallel NVFP4 loss is the mean over every shard's slice.
"""

from __future__ import annotations

import logging
from typing import Callable, Optional

import torch
import torch.nn.functional as F
from torch import nn

from ..calib_config import AwqClipConfig, AwqFullConfig
from ..collectives import StatSync, stat_sync
from ..kernels import ops
from ..nn.max_collector import static_amax
from ..nn.quant_module import QuantModule
from ..nn.tensor_quantizer import CalibrationError, TensorQuantizer
from .awq_lite import record_inputs, search
from .registry import CalibContext, register_runner
from .scaling import input_pre_scale, progress, store_result
from .shards import groups_span_shards, output_mse, peer_mean

_log = logging.getLogger("quantlib")

#: largest number of weight elements (quantized copies included) one batched clip search holds; on the CPU
#: too: unlike mse's elementwise search, its work is batched GEMMs, and a smaller chunk re-quantizes the
#: copies on every call (benchmarks/RESULTS.md, "awq_clip's chunk on the CPU")
CHUNK_ELEMENTS = 1 << 24


def clip_ratios(cfg: AwqClipConfig) -> list[float]:
    """ModelOpt's ratios: ``arange(min_clip_ratio, 1, shrink_step)`` rounded to 2 decimals, then 1
    (once: fp32 steps can land on 0.99999..., which rounds to 1 as well)."""
    return list(dict.fromkeys([round(k, 2) for k in torch.arange(cfg.min_clip_ratio, 1.0, cfg.shrink_step).tolist()] + [1.0]))


def clippable(q: nn.Module) -> bool:
    """Whether awq_clip can search ``q``: one quantizer with a static amax over 1-D blocks, or NVFP4."""
    if not isinstance(q, TensorQuantizer) or not q.is_enabled:
        return False
    s = q.spec
    return s.two_level or (s.block is not None and len(s.block) == 1 and not s.dynamic)


def _quantize(q: TensorQuantizer, w: torch.Tensor, amax: torch.Tensor) -> torch.Tensor:
    """``q``'s fake quant of ``w`` with ``amax``."""
    return ops.fake_quant(w, q.spec, amax, q.attrs.backend)


def _blocked(w: torch.Tensor, block: int) -> torch.Tensor:
    """[n_blocks, block, rows] of ``w`` [rows, ci] (zero-padded along ci)."""
    pad = -w.shape[-1] % block
    return (F.pad(w, (0, pad)) if pad else w).reshape(w.shape[0], -1, block).permute(1, 2, 0)


def _pieces(rows: int, cols: int, n_ratios: int, co_batch: int) -> list[tuple[slice, slice]]:
    """(output channels, ratios) searched by one batched product: ``co_batch`` channels, and as many
    ratios as :data:`CHUNK_ELEMENTS` weight elements hold (at least one)."""
    per = max(1, min(n_ratios, CHUNK_ELEMENTS // max(1, min(rows, co_batch) * cols) - 1))  # - 1: the reference
    return [(slice(r, min(r + co_batch, rows)), slice(k, min(k + per, n_ratios))) for r in range(0, rows, co_batch)
            for k in range(0, n_ratios, per)]


def _piece_weights(q: TensorQuantizer, w: torch.Tensor, cands: torch.Tensor, rows: slice, ks: slice, block: int) -> torch.Tensor:
    """[(1 + k) * n_blocks, block, co]: the blocks (:func:`_blocked`) of the ``rows`` of ``w`` (the
    reference), then of their fake quant with each candidate amax of ``cands[ks]``, quantized by one
    kernel call (a block lies in one row: a row slice quantizes as the whole weight does)."""
    ws = w[rows]
    c = cands[ks, rows].transpose(0, 1).contiguous()  # [co, k, n_blocks]
    wq = _quantize(q, ws.unsqueeze(1).expand(ws.shape[0], c.shape[1], ws.shape[1]).contiguous(), c)
    both = torch.cat([ws.unsqueeze(1), wq], dim=1)  # [co, 1 + k, ci]: each copy's blocks side by side
    pad = -both.shape[-1] % block
    return _blocked((F.pad(both, (0, pad)) if pad else both).flatten(1), block)


def clip_losses(module: QuantModule, q: TensorQuantizer, inputs: list[torch.Tensor], w_amax: torch.Tensor, ratios: list[float],
                cfg: AwqClipConfig, sync: Optional[StatSync] = None, span: bool = False) -> torch.Tensor:
    """fp32 [len(ratios), *w_amax.shape] (NVFP4: [len(ratios)]), summed over ``inputs``. Split over
    tensor-parallel ranks: a row-parallel shard adds its partial outputs over the shards before squaring
    where the loss is over the whole row (NVFP4, or ``span``: one block covering every shard); a
    column-parallel shard's NVFP4 mean is averaged with the other shards' (its blocks are its own rows);
    tensor ranks holding whole copies average their copies of the loss."""
    sync = sync or StatSync(None)
    role = sync.role(module)
    w = q.pre_scale(module.weight.detach())
    xs = [input_pre_scale(module, x) for x in inputs]
    if q.spec.two_level:
        losses = torch.zeros(len(ratios), dtype=torch.float32, device=w.device)
        refs = [x @ w.T for x in xs]
        for k, r in enumerate(ratios):
            wq = _quantize(q, w, w_amax * r)
            for x, ref in zip(xs, refs):
                losses[k] += output_mse((x @ wq.T - ref).float(), role, module, sync)
        return peer_mean(losses, module, sync)
    losses = block_losses(q, w, xs, w_amax, ratios, cfg, (lambda e: sync.over_shards(e, "sum", module)) if span else None)
    return peer_mean(losses, module, sync) if role == "replicated" else losses  # whole copies on every tensor rank: one loss


def block_losses(q: TensorQuantizer, w: torch.Tensor, xs: list[torch.Tensor], w_amax: torch.Tensor, ratios: list[float], cfg: AwqClipConfig,
                 span: Optional[Callable[[torch.Tensor], torch.Tensor]] = None) -> torch.Tensor:
    """fp32 [len(ratios), *w_amax.shape]: per block, the summed loss of every ratio of weight ``w`` on
    the (pre-scaled) inputs ``xs``; ``span`` sums a block's partial outputs over the shards.

    Every ratio is searched at once: the blocks of the reference weight and of its quantized copies
    are one batched GEMM's entries, so a call costs a fixed number of ops whatever the number of
    ratios; each GEMM (same shape and operand layout) and each reduction (same layout, same reduced
    dim) is the one a single ratio's search runs, so the losses are bit for bit the per-ratio ones. The copies are quantized once per linear
    where they fit (:data:`CHUNK_ELEMENTS` in all), else once per call (as ModelOpt: ~1/tokens of the
    products)."""
    block, rows = q.spec.block[0], w.shape[0]
    cands = w_amax.unsqueeze(0) * _ratio_tensor(ratios, w_amax.device).reshape((-1,) + (1,) * w_amax.dim())
    pieces = _pieces(rows, w.shape[-1], len(ratios), cfg.max_co_batch_size)
    small = len(pieces) == 1 or (len(ratios) + 1) * w.numel() <= CHUNK_ELEMENTS
    kept = [_piece_weights(q, w, cands, r, k, block) for r, k in pieces] if small else None
    sums: list[Optional[torch.Tensor]] = [None] * len(pieces)  # per piece: the sum over the calls so far
    for x in xs:
        x = x.reshape(-1, x.shape[-1])
        x = x[0 :: max(1, x.shape[0] // cfg.max_tokens_per_batch)]
        pad = -x.shape[-1] % block
        x = F.pad(x, (0, pad)) if pad else x
        for i, (r, k) in enumerate(pieces):
            n = 1 + k.stop - k.start
            # each GEMM of the batch is one copy's block: the very product a single copy's bmm computes
            xb = x.repeat(1, n).reshape(x.shape[0], -1, block).transpose(0, 1)
            out = torch.bmm(xb, kept[i] if kept is not None else _piece_weights(q, w, cands, r, k, block)).unflatten(0, (n, -1))
            err = out[1:] - out[:1]  # [k, n_blocks, tokens, co]
            err = err if err.dtype == torch.float32 else err.float()
            if span is not None:  # each shard holds a part of the one block of a row: the block's output is their sum
                err = span(err)
            loss = err.permute(0, 3, 2, 1).pow(2).mean(dim=2)  # [k, co, n_blocks]
            sums[i] = loss if sums[i] is None else sums[i].add_(loss)  # 0 + loss would be loss: the same sums
    losses = torch.zeros((len(ratios),) + tuple(w_amax.shape), dtype=torch.float32, device=w.device)
    for (r, k), total in zip(pieces, sums):
        if total is not None:
            losses[k, r] = total
    return losses


_RATIOS: dict[tuple[tuple[float, ...], torch.device], torch.Tensor] = {}


def _ratio_tensor(ratios: list[float], device: torch.device) -> torch.Tensor:
    """fp32 ``ratios`` on ``device``, copied there once."""
    key = (tuple(ratios), torch.device(device))
    if key not in _RATIOS:
        _RATIOS[key] = torch.tensor(ratios, dtype=torch.float32, device=device)
    return _RATIOS[key]


def clip(targets: list, inputs: dict[str, list[torch.Tensor]], calls: list[float], cfg: AwqClipConfig, ctx: CalibContext) -> None:
    """The clip search of every clippable target, then the chosen amax set. Every rank calls the
    replicas' reduction of every clippable target's losses (zeros where it got no tokens), and raises,
    together with the others, only once every target is searched. The losses' finiteness is read back
    once for every target (one device sync), not per target."""
    sync = stat_sync(ctx)
    ratios = clip_ratios(cfg)
    searched, finite = [], []
    with torch.no_grad():
        for (name, m, _), n_calls in progress(zip(targets, calls), "awq_clip search", len(targets)):
            q = m.weight_quantizer
            if not clippable(q):
                if n_calls:
                    _log.warning("%s: awq_clip searches one weight quantizer with static 1-D blocks or NVFP4; %s keeps its amax", name,
                                 type(q).__name__)
                continue
            where = f"{name}.weight_quantizer"
            per_tensor = q.spec.per_tensor_amax(q.axis)
            span = not per_tensor and groups_span_shards(q.spec.block[0], m, sync, where)
            w_amax = static_amax(q.pre_scale(m.weight.detach()), q.spec, q.axis, q.attrs.backend)
            if per_tensor or span:  # the global amax, or the one block of a row: over every shard
                w_amax = sync.over_shards(w_amax, "max", m)
            losses = torch.zeros((len(ratios),) + (() if per_tensor else tuple(w_amax.shape)), dtype=torch.float32, device=w_amax.device)
            if n_calls:
                losses = clip_losses(m, q, inputs[name], w_amax, ratios, cfg, sync, span)
            losses = sync.over_replicas(losses, "sum", m.is_expert)
            inputs[name] = []
            if not n_calls:
                continue
            best = torch.argmin(losses, dim=0)  # first least loss: the smaller ratio wins ties
            ratio = _ratio_tensor(ratios, w_amax.device)[best]
            searched.append((name, m, q, w_amax * ratio.reshape(w_amax.shape), ratio))
            finite.append(torch.isfinite(losses).all())
    ok = torch.stack([f.to(finite[0].device) for f in finite]).tolist() if finite else []  # targets may sit on several devices
    bad = [name for (name, *_), good in zip(searched, ok) if not good]
    sync.step("awq_clip", lambda: _raise_nonfinite(bad))
    for _, m, q, amax, ratio in searched:
        q.amax = amax
        store_result(m, "awq_clip_ratio", ratio)


def _raise_nonfinite(bad: list[str]) -> None:
    if bad:
        raise CalibrationError(f"{bad[0]}.weight_quantizer: awq_clip's search loss is not finite (NaN/Inf in the weight or inputs)")


@register_runner("awq_clip")
def run_awq_clip(model: nn.Module, cfg: AwqClipConfig, ctx: CalibContext) -> None:
    """One forward_loop pass caching each linear's inputs, then the clip search per linear."""
    if not ctx.max_only_without_loop("awq_clip", model, "it searches on the activations"):
        targets, rec, calls = record_inputs(model, "awq_clip", ctx)
        clip(targets, rec.inputs, calls, cfg, ctx)


@register_runner("awq_full")
def run_awq_full(model: nn.Module, cfg: AwqFullConfig, ctx: CalibContext) -> None:
    """awq_lite, then awq_clip on the scaled weights, from one forward_loop pass."""
    if not ctx.max_only_without_loop("awq_full", model, "it searches on the activations"):
        targets, rec, calls = record_inputs(model, "awq_full", ctx)
        search(targets, rec, calls, cfg.lite(), ctx, keep_inputs=True)
        clip(targets, rec.inputs, calls, cfg.clip(), ctx)
