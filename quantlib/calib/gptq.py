"""GPTQ: per linear, the weight is quantized one input column at a time, each column's rounding error
spread over the columns not yet quantized through the inverse Hessian of the layer's inputs.

Statistics: one forward_loop pass (the max calibration's, on the unquantized model) accumulates, per
served linear (and per expert GEMM of fused experts, on the tokens routed to it), ``X^T X`` of its GEMM
inputs in fp32 on their device, and their token count ``n``; both are SUM-reduced over the linear's
replicas (an expert's own only), and ``H = 2 X^T X / n``. The scales are fixed before GPTQ runs: the
weight quantizers' amax come from the original weights (max calibration, as ModelOpt 0.47's ``gptq``),
so each column is quantized with its own group's stored amax by quantlib's fake quant op, and the
updated weight's fake quant is the weight itself, bit for bit (what export packs).

Then, per linear, the textbook algorithm (Frantar et al. 2022) on the fp32 weight ``W``:

- columns whose ``H`` diagonal is 0 (inputs always zero) get ``H_jj = 1`` and ``W_j = 0``;
- ``act_order``: columns are processed by decreasing ``H_jj`` (each keeps its own group's scale:
  AutoGPTQ's ``static_groups``, llm-compressor's ``actorder="static"``);
- ``H += perc_damp * mean(diag H) * I``; ``U`` = the upper Cholesky factor of ``H^-1``;
- in blocks of ``block_size`` columns: column ``j`` is quantized, ``e = (w_j - q_j) / U_jj``, the
  block's later columns get ``-= e U_j,k``; after the block, the later columns get ``-= E U_block,rest``;
- ``W := Q`` (in the weight's dtype, in place: tied and sharded parameters keep their storage).

Supported weight quantizers: static amax (INT per tensor / channel / block, FP8 per tensor / channel,
NVFP4 with static block scales), alone or chained (W4A8: each member on the previous one's output);
dynamic scales (MX, dynamic blocks, NVFP4 dynamic blocks), affine biases and a weight
``pre_quant_scale`` are refused by name, as are row-parallel linears split over tensor-parallel ranks
(their Hessian spans every shard's columns). Column-parallel shards need no reduction: each owns its
rows and all see the same inputs. A linear or expert no token reached: experts follow
``expert_input_policy`` ("error" raises; otherwise they keep max calibration), anything else raises.
"""

from __future__ import annotations

import logging
from typing import Callable, Optional

import torch
from torch import nn

from ..formats import Kind
from ..kernels import ops
from ..nn.tensor_quantizer import CalibrationError, TensorQuantizer
from ..collectives import stat_sync, targets_digest
from .registry import CalibContext, GptqConfig, register_runner
from .scaling import InputRecorder, progress, served_linears

_log = logging.getLogger("quantlib")

ColumnQuant = Callable[[torch.Tensor, int], tuple[torch.Tensor, torch.Tensor]]


class HessianRecorder(InputRecorder):
    """Forward pre-hooks (the :class:`InputRecorder`'s) that add each GEMM input's ``X^T X`` (fp32, on
    the input's device) and token count per target; the inputs themselves are not kept."""

    def __init__(self, modules: list) -> None:
        super().__init__(modules)
        self.xtx: dict[str, torch.Tensor] = {}
        self.tokens: dict[str, int] = {name: 0 for name, _ in modules}

    def record(self, name: str, x: torch.Tensor) -> None:
        """Add one call's input ``x`` of target ``name``."""
        if x.numel() == 0:
            return
        x = x.detach().reshape(-1, x.shape[-1]).float()
        held = self.xtx.get(name)
        if held is None:
            self.xtx[name] = x.T @ x
        else:
            held.addmm_(x.T, x)
        self.tokens[name] += x.shape[0]
        self.calls[name] += 1


def _leaves(q: nn.Module) -> list[TensorQuantizer]:
    return [q] if isinstance(q, TensorQuantizer) else list(q.leaves())


def check_quantizer(where: str, q: nn.Module) -> None:
    """Raise CalibrationError naming ``where`` unless every member of ``q`` quantizes with a static scale."""
    for leaf in _leaves(q):
        spec = leaf.spec
        why = None
        if spec.kind == Kind.MX or not leaf.needs_calibration or (spec.kind != Kind.NVFP4 and spec.dynamic):
            why = "its scales are dynamic (computed from the weight on every call)"
        elif spec.kind == Kind.NVFP4 and not leaf.static_blocks:
            why = "NVFP4 with dynamic block scales; set block_sizes 'type': 'static'"
        elif leaf.attrs.bias is not None:
            why = f"bias={leaf.attrs.bias!r}"
        elif leaf.pre_quant_scale is not None:
            why = "it has a pre_quant_scale (from SmoothQuant / AWQ); calibrate from a fresh quantize()"
        if why is not None:
            raise CalibrationError(f"{where}: gptq quantizes each weight column with a fixed, stored scale; {why}")


def _column_amax(amax: torch.Tensor, spec_block: Optional[tuple[int, ...]], cols: int, j: int) -> torch.Tensor:
    """The slice of a stored amax that quantizes column ``j`` of a ``[rows, cols]`` weight, shaped for
    that column alone (``[rows, 1]``): its block along the last dim, its own entry of a per-input-channel
    amax, or all of a per-tensor / per-output-channel one."""
    if spec_block is not None:
        k = j // spec_block[-1]
        return amax[..., k : k + 1]
    if amax.dim() == 2 and amax.shape[-1] == cols and cols > 1:
        return amax[:, j : j + 1]
    return amax


def _leaf_step(leaf: TensorQuantizer, cols: int) -> Callable[[torch.Tensor, int], torch.Tensor]:
    """``fn(c, j)``: ``leaf``'s fake quant of ``c`` ``[rows, 1]``, the column ``j``, with its groups' amax."""
    spec, backend, amax = leaf.spec, leaf.attrs.backend, leaf.amax.float()
    if spec.kind == Kind.NVFP4:  # the global amax stays whole; the block amax is sliced
        blocks = leaf.block_amax.float()
        return lambda c, j: ops.fake_quant(c, spec, amax, backend, _column_amax(blocks, spec.block, cols, j))
    return lambda c, j: ops.fake_quant(c, spec, _column_amax(amax, spec.block, cols, j), backend)


def column_quantizer(q: nn.Module, cols: int) -> ColumnQuant:
    """``fn(col, j) -> (quantized, stored)``: fake quant of column ``j`` (fp32 ``[rows]``) of a ``[rows,
    cols]`` weight by ``q`` with the stored amax of ``j``'s groups, and the value to store in the weight:
    the same, or for a chain (W4A8) the first member's output, whose fake quant by the chain is the
    chain's output (the first member's is idempotent; storing the chain's would quantize it twice). A
    column is quantized as a ``[rows, 1]`` tensor whose groups are those of ``j``, so every element takes
    the op's own formula with its own group's scale: the same bits as quantizing the whole weight."""
    steps = [_leaf_step(leaf, cols) for leaf in _leaves(q)]

    def quantize(col: torch.Tensor, j: int) -> tuple[torch.Tensor, torch.Tensor]:
        stored = c = steps[0](col.unsqueeze(1), j)
        for step in steps[1:]:
            c = step(c, j)
        return c.squeeze(1), stored.squeeze(1)

    return quantize


def damped_inverse_factor(h: torch.Tensor, perc_damp: float, where: str = "") -> torch.Tensor:
    """The upper Cholesky factor of ``(h + perc_damp * mean(diag h) * I)^-1`` (fp32; ``h`` is modified)."""
    idx = torch.arange(h.shape[0], device=h.device)
    h[idx, idx] += perc_damp * torch.mean(torch.diag(h))
    try:
        return torch.linalg.cholesky(torch.cholesky_inverse(torch.linalg.cholesky(h)), upper=True)
    except (RuntimeError, torch.linalg.LinAlgError) as exc:
        raise CalibrationError(f"{where}: gptq's damped Hessian is not positive definite ({exc}); raise perc_damp") from None


def gptq_quantize(w: torch.Tensor, hessian: torch.Tensor, quantize: ColumnQuant, cfg: GptqConfig, where: str = "") -> torch.Tensor:
    """The GPTQ-quantized fp32 copy of weight ``w`` ``[rows, cols]`` for Hessian ``hessian`` (not modified):
    each column quantized by ``quantize(col, j)`` (``j``: its index in ``w``; it returns the quantized
    column and the value stored for it) after the errors of the
    columns before it (in processing order) are compensated (see the module docstring)."""
    W = w.detach().float().clone()
    H = hessian.detach().float().clone()
    cols = W.shape[1]
    dead = torch.diag(H) == 0
    H[dead, dead] = 1
    W[:, dead] = 0
    order = torch.argsort(torch.diag(H), descending=True) if cfg.act_order else None
    if order is not None:
        W, H = W[:, order], H[order][:, order]
    U = damped_inverse_factor(H, cfg.perc_damp, where)
    index = order.tolist() if order is not None else range(cols)
    for i1 in range(0, cols, cfg.block_size):
        i2 = min(i1 + cfg.block_size, cols)
        W1, U1 = W[:, i1:i2].clone(), U[i1:i2, i1:i2]
        Q1, E1 = torch.zeros_like(W1), torch.zeros_like(W1)
        for i in range(i2 - i1):
            w_col = W1[:, i]
            q_col, Q1[:, i] = quantize(w_col, index[i1 + i])
            err = (w_col - q_col) / U1[i, i]
            W1[:, i:].addr_(err, U1[i, i:], alpha=-1)
            E1[:, i] = err
        W[:, i1:i2] = Q1
        W[:, i2:].addmm_(E1, U[i1:i2, i2:], alpha=-1)
    if order is not None:
        W = W[:, torch.argsort(order)]
    return W


def _record(model: nn.Module, rec: HessianRecorder, ctx: CalibContext) -> None:
    with rec:
        ctx.max_calibrate(model)


def _check_layout(name: str, m: nn.Module, sync) -> None:
    if sync.role(m) == "row":
        why = "split over tensor-parallel ranks, its Hessian spans every shard's input columns"
        raise CalibrationError(f"{name}: gptq on a row-parallel linear is not supported ({why}); calibrate at TP=1")
    check_quantizer(f"{name}.weight_quantizer", m.weight_quantizer)


def _unreached(names: list[str], experts: list[bool], policy: str) -> None:
    dense = [n for n, e in zip(names, experts) if not e]
    if dense:
        raise CalibrationError(f"gptq: forward_loop never reached {dense[:5]}; feed data that reaches them or disable their quantizers")
    if names and policy == "error":
        raise CalibrationError(f"gptq: no tokens reached expert(s) {names[:5]} (expert_input_policy='error')")
    for n in names:
        _log.warning("%s: no tokens reached this expert; gptq leaves it max-calibrated", n)


@register_runner("gptq")
def run_gptq(model: nn.Module, cfg: GptqConfig, ctx: CalibContext) -> None:
    """Max calibration recording each served linear's Hessian, then GPTQ's weight update per linear."""
    if ctx.max_only_without_loop("gptq", model, "its Hessians come from the activations"):
        return
    sync = stat_sync(ctx)
    targets = served_linears(model, "gptq", needs_input=False, tensor_parallel=ctx.tensor_parallel)
    sync.step("gptq", lambda: [_check_layout(n, m, sync) for n, m, _ in targets], targets_digest("gptq", targets))
    rec = HessianRecorder([(n, m) for n, m, _ in targets])
    sync.step("gptq", lambda: _record(model, rec, ctx))
    reduced = []
    for name, m, w in targets:  # every rank reduces every target, in one order (zeros where no token came)
        cols = w.shape[1]
        xtx = rec.xtx.pop(name, None)
        xtx = torch.zeros(cols, cols, dtype=torch.float32, device=w.device) if xtx is None else xtx.to(w.device)
        n = torch.tensor([float(rec.tokens[name])], device=w.device)
        reduced.append((sync.over_replicas(xtx, "sum", m.is_expert), sync.over_replicas(n, "sum", m.is_expert).item()))
    idle = [(name, m.is_expert) for (name, m, _), (_, n) in zip(targets, reduced) if n == 0]
    _unreached([n for n, _ in idle], [e for _, e in idle], ctx.expert_input_policy)
    with torch.no_grad():
        for (name, m, w), (xtx, n) in progress(list(zip(targets, reduced)), "gptq", len(targets)):
            if n == 0:
                continue
            if not bool(torch.isfinite(xtx).all()):
                raise CalibrationError(f"{name}.input_quantizer: gptq's Hessian saw NaN/Inf inputs; check the model's activations")
            hessian = xtx.mul_(2.0 / n)
            new = gptq_quantize(w, hessian, column_quantizer(m.weight_quantizer, w.shape[1]), cfg, name)
            w.copy_(new.to(w.dtype))  # in place: the parameter (or the experts' slice view) keeps its storage


__all__ = ["HessianRecorder", "check_quantizer", "column_quantizer", "damped_inverse_factor", "gptq_quantize", "run_gptq"]
