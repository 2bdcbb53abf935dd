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
``pre_quant_scale`` are refused by name. A linear or expert no token reached: experts follow
``expert_input_policy`` ("error" raises; otherwise they keep max calibration), anything else raises.

Tensor / expert parallelism: a column-parallel shard owns its rows and sees the whole input, so its
Hessian is the whole linear's and its rows are GPTQ'd as one process would (rows are independent). A
row-parallel shard owns a slice of the input columns, and the column sweep runs over all of them: each
call's input slices are joined into the whole input before ``X^T X``, and the weight's columns and
their per-column amax are joined before the sweep; every shard then runs the same sweep on the same
values and keeps its own columns. (Joining = each rank's slice placed in zeros and SUM-reduced over the
shards: exact.) Experts split over expert-parallel ranks are local: their Hessians meet only their
replicas'.
"""

from __future__ import annotations

import logging
from typing import Callable, Optional

import torch
from torch import nn

from ..calib_config import GptqConfig
from ..collectives import StatSync, stat_sync, targets_digest
from ..formats import Kind
from ..formats.fp8 import cast_fp8, fp8_scale
from ..formats.int import int_range, int_scale
from ..formats.spec import TINY_AMAX
from ..kernels import ops
from ..nn.tensor_quantizer import CalibrationError, TensorQuantizer
from ..parallel_state import LayoutError, tp_shard_dim
from .registry import CalibContext, register_runner
from .scaling import InputRecorder, progress, served_linears

_log = logging.getLogger("quantlib")

ColumnQuant = Callable[[torch.Tensor, int], tuple[torch.Tensor, torch.Tensor]]


class HessianRecorder(InputRecorder):
    """Forward pre-hooks (the :class:`InputRecorder`'s) that add each GEMM input's ``X^T X`` (fp32, on
    the input's device) and token count per target; the inputs themselves are not kept."""

    def __init__(self, modules: list, widen: Optional[dict[str, Callable[[torch.Tensor], torch.Tensor]]] = None) -> None:
        super().__init__(modules)
        self.xtx: dict[str, torch.Tensor] = {}
        self.tokens: dict[str, int] = {name: 0 for name, _ in modules}
        self.widen = widen or {}

    def record(self, name: str, x: torch.Tensor) -> None:
        """Add one call's input ``x`` of target ``name`` (a row-parallel shard's: joined over its shards)."""
        if x.numel() == 0:
            return
        x = x.detach().reshape(-1, x.shape[-1]).float()
        if name in self.widen:
            x = self.widen[name](x)
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
        if not spec.calibrated_amax or not leaf.needs_calibration:
            why = "its scales are dynamic (computed from the weight on every call)"
        elif spec.two_level and not leaf.static_blocks:
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


Widen = Callable[[TensorQuantizer, str, torch.Tensor], torch.Tensor]


def _amax_by_column(amax: torch.Tensor, block: Optional[tuple[int, ...]], rows: int, cols: int) -> Optional[torch.Tensor]:
    """The stored amax of every weight element's group, as ``[cols, rows]`` (column ``j``'s in row ``j``,
    contiguous), for the layouts a column step expands: per tensor, per output / input channel, 1-D
    blocks along the input dim; None for others (2-D blocks), which take the op itself."""
    a = amax.float()
    if block is not None:
        b = block[-1]
        if len(block) != 1 or a.dim() != 2 or a.shape[0] != rows or a.shape[1] * b < cols:
            return None
        a = a.repeat_interleave(b, dim=1)[:, :cols]
    elif a.numel() == 1:
        a = a.reshape(1, 1)
    elif a.dim() != 2 or tuple(a.shape) not in ((rows, 1), (1, cols), (rows, cols)):
        return None
    return a.expand(rows, cols).T.contiguous()


def _int_step(spec, by_col: torch.Tensor) -> Callable[[torch.Tensor, int], torch.Tensor]:
    """Column ``j``'s INT fake quant as the reference computes it (:func:`quantlib.formats.int.int_codes`,
    then ``q / scale``), with the scales of every column computed once: four small ops a column instead of
    a kernel call that re-derives them (GPTQ's sweep is launch-bound on a GPU)."""
    lo, hi = int_range(spec.num_bits, spec.unsigned, spec.narrow_range)
    scale = int_scale(by_col, hi)
    zero = by_col <= TINY_AMAX  # the reference's zero groups (their scale may be inf)
    zero = zero if bool(zero.any()) else None

    def step(c: torch.Tensor, j: int) -> torch.Tensor:
        s = scale[j]
        q = torch.mul(c, s).round_().clamp_(lo, hi)
        if zero is not None:
            q.masked_fill_(zero[j], 0.0)
        return q.div_(s)

    return step


def _fp8_step(spec, by_col: torch.Tensor) -> Callable[[torch.Tensor, int], torch.Tensor]:
    """Column ``j``'s FP8 fake quant as the reference computes it (:func:`quantlib.formats.fp8.fp8_quantize`,
    then ``codes * (1 / s)``), the scales of every column computed once."""
    scale = fp8_scale(by_col, spec.element)
    inv = torch.reciprocal(scale)
    element = tuple(spec.element)

    def step(c: torch.Tensor, j: int) -> torch.Tensor:
        return cast_fp8(torch.mul(c, scale[j]), element).float().mul_(inv[j])

    return step


def _leaf_step(leaf: TensorQuantizer, rows: int, cols: int, widen: Optional[Widen]) -> Callable[[torch.Tensor, int], torch.Tensor]:
    """``fn(c, j)``: ``leaf``'s fake quant of column ``j`` (fp32 ``[rows]``) with its groups' stored amax."""
    spec, backend, amax = leaf.spec, leaf.attrs.backend, leaf.amax.float()
    if widen is not None:
        amax = widen(leaf, "amax", amax)
    if spec.kind == Kind.INT or (spec.kind == Kind.FP8 and spec.block is None):
        by_col = _amax_by_column(amax, spec.block, rows, cols)
        if by_col is not None:
            return (_int_step if spec.kind == Kind.INT else _fp8_step)(spec, by_col)
    if spec.two_level:  # the global amax stays whole; the block amax is sliced
        blocks = leaf.block_amax.float() if widen is None else widen(leaf, "block_amax", leaf.block_amax.float())
        return lambda c, j: ops.fake_quant(c.unsqueeze(1), spec, amax, backend, _column_amax(blocks, spec.block, cols, j)).squeeze(1)
    return lambda c, j: ops.fake_quant(c.unsqueeze(1), spec, _column_amax(amax, spec.block, cols, j), backend).squeeze(1)


def column_quantizer(q: nn.Module, cols: int, rows: int, widen: Optional[Widen] = None) -> ColumnQuant:
    """``fn(col, j) -> (quantized, stored)``: fake quant of column ``j`` (fp32 ``[rows]``) of a ``[rows,
    cols]`` weight by ``q`` with the stored amax of ``j``'s groups, and the value to store in the weight:
    the same, or for a chain (W4A8) the first member's output, whose fake quant by the chain is the
    chain's output (the first member's is idempotent; storing the chain's would quantize it twice). Every
    element takes the format's own formula with its own group's scale: the same bits as quantizing the
    whole weight. ``widen(leaf, attr, amax)`` gives a row-parallel shard's amax for all ``cols`` columns."""
    steps = [_leaf_step(leaf, rows, cols, widen) for leaf in _leaves(q)]

    def quantize(col: torch.Tensor, j: int) -> tuple[torch.Tensor, torch.Tensor]:
        stored = c = steps[0](col, j)
        for step in steps[1:]:
            c = step(c, j)
        return c, stored

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
        Q1, E1, d = torch.empty_like(W1), torch.empty_like(W1), U1.diagonal()
        for i in range(i2 - i1):  # launch-bound on a GPU: as few ops a column as the algorithm allows
            w_col = W1[:, i]
            q_col, Q1[:, i] = quantize(w_col, index[i1 + i])
            err = torch.sub(w_col, q_col, out=E1[:, i]).div_(d[i])
            W1[:, i:].addr_(err, U1[i, i:], alpha=-1)
        W[:, i1:i2] = Q1
        W[:, i2:].addmm_(E1, U[i1:i2, i2:], alpha=-1)
    if order is not None:
        W = W[:, torch.argsort(order)]
    return W


def _record(model: nn.Module, rec: HessianRecorder, ctx: CalibContext) -> None:
    with rec:
        ctx.max_calibrate(model)


def join_shards(t: torch.Tensor, dim: int, sync: StatSync, target: nn.Module) -> torch.Tensor:
    """``t``, this rank's slice along ``dim`` of a tensor split over ``target``'s tensor-parallel shards,
    joined with the other shards' slices in rank order, on every shard (a new tensor). Each slice is
    placed in zeros and the whole SUM-reduced: every element is one rank's value plus zeros, exact."""
    group = sync.shard_group(target)
    k, r = sync.size(group), sync.state.rank(group)
    dim, n = dim % t.dim(), t.shape[dim]
    full = t.new_zeros(t.shape[:dim] + (n * k,) + t.shape[dim + 1 :])
    full.narrow(dim, r * n, n).copy_(t)
    return sync.over_shards(full, "sum", target)


def _shard_amax(name: str, m: nn.Module, sync: StatSync, extent: int) -> Widen:
    """``widen(leaf, attr, amax)`` of a tensor-parallel shard (``extent``: its size along the split axis):
    the amax the closing amax sync gives this shard, for the sweep to round to. An amax split with the
    columns of a row-parallel shard (blocks inside a shard, NVFP4's block amax) joined over the shards
    (the sweep covers every column); one that does not keep the split axis (per tensor, NVFP4's global
    amax, a row-parallel row, a block spanning the shards) MAX-reduced over them; a column-parallel
    shard's own rows' amax as it is."""
    tp, split = sync.shards(m), 0 if sync.role(m) == "column" else 1

    def widen(leaf: TensorQuantizer, attr: str, amax: torch.Tensor) -> torch.Tensor:
        if attr == "block_amax":
            return join_shards(amax, -1, sync, m) if split == 1 else amax
        try:
            dim = tp_shard_dim(leaf, amax.dim(), split, extent, tp, f"{name}.weight_quantizer")
        except LayoutError as exc:
            raise CalibrationError(str(exc)) from None
        if dim is None:
            return sync.over_shards(amax, "max", m)
        return join_shards(amax, dim, sync, m) if split == 1 else amax

    return widen


def _check_layout(name: str, m: nn.Module, w: torch.Tensor, sync: StatSync) -> None:
    where = f"{name}.weight_quantizer"
    check_quantizer(where, m.weight_quantizer)
    if sync.role(m) != "row":
        return
    for leaf in _leaves(m.weight_quantizer):
        if leaf.spec.kind == Kind.NVFP4 and w.shape[1] % leaf.spec.block[-1]:
            why = f"NVFP4 blocks of {leaf.spec.block[-1]} straddle its {sync.shards(m)} tensor-parallel shards of {w.shape[1]} columns"
            raise CalibrationError(f"{where}: gptq cannot join the block scales of a row-parallel linear whose {why}")
        try:
            tp_shard_dim(leaf, 2, 1, w.shape[1], sync.shards(m), where)
        except LayoutError as exc:
            raise CalibrationError(str(exc)) from None


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
    sync.step("gptq", lambda: [_check_layout(n, m, w, sync) for n, m, w in targets], targets_digest("gptq", targets))
    rows = {n: m for n, m, _ in targets if sync.role(m) == "row"}  # joined over their shards, in the same order on each
    rec = HessianRecorder([(n, m) for n, m, _ in targets], {n: (lambda x, m=m: join_shards(x, -1, sync, m)) for n, m in rows.items()})
    sync.step("gptq", lambda: _record(model, rec, ctx))
    reduced = []
    for name, m, w in targets:  # every rank reduces every target, in one order (zeros where no token came)
        cols = w.shape[1] * sync.shards(m) if name in rows else w.shape[1]
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
            widen = _shard_amax(name, m, sync, w.shape[0 if sync.role(m) == "column" else 1]) if sync.shard_group(m) else None
            if name in rows:  # every shard sweeps the whole weight alike and keeps its own columns
                whole = join_shards(w.detach().float(), 1, sync, m)
                new = gptq_quantize(whole, hessian, column_quantizer(m.weight_quantizer, whole.shape[1], whole.shape[0], widen), cfg, name)
                new = new[:, sync.state.rank(sync.shard_group(m)) * w.shape[1] :][:, : w.shape[1]]
            else:
                new = gptq_quantize(w, hessian, column_quantizer(m.weight_quantizer, w.shape[1], w.shape[0], widen), cfg, name)
            w.copy_(new.to(w.dtype))  # in place: the parameter (or the experts' slice view) keeps its storage


__all__ = ["HessianRecorder", "check_quantizer", "column_quantizer", "damped_inverse_factor", "gptq_quantize", "run_gptq"]
