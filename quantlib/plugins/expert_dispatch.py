"""Token dispatch of a top-k MoE layer on the device: the (token, expert) assignments sorted by expert,
the cumulative row counts that a grouped GEMM takes, and the combine back to tokens.

Nothing here reads a value back to the host or makes a shape that depends on the routing, so a layer
built on it runs without a device-to-host sync and compiles into one graph that serves every routing.
The combine adds each token's expert outputs in ascending expert order, starting from zeros, in the
output dtype: the order of the per-expert loop of transformers' eager experts (``index_add_`` expert by
expert), hence its bits. On CUDA (eager, triton installed) one Triton kernel does the weighting, the cast
and the k adds in one pass with the same roundings (:mod:`quantlib.kernels.triton.combine`); the torch ops
(:func:`combine_torch`) serve the CPU, torch.compile, torch.func and the backward.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..kernels.backends import triton_available
from ..kernels.ops import _functorch_active


@dataclass
class Dispatch:
    """The sorted assignments of one forward (S = tokens * top_k rows)."""

    token: torch.Tensor  #: (S,) token of each sorted row
    key: torch.Tensor  #: (S,) expert of each sorted row in the sort's narrow dtype (sentinels clamped to E - 1)
    weight: torch.Tensor  #: (S,) routing weight of each sorted row
    offs: torch.Tensor  #: (E,) int32 end row of each expert's group
    combine_index: torch.Tensor  #: (tokens, top_k) sorted row of each token's k-th smallest expert
    valid: torch.Tensor | None  #: (S, 1) False at sentinel rows (expert index == E); None: no sentinels

    @property
    def expert(self) -> torch.Tensor:
        """(S,) int64 expert of each sorted row, an index (a uint8 index tensor would be read as a mask); made
        where a layer indexes per-expert rows (biases, per-expert pre_quant_scale), once (not a cached_property:
        its lock stops torch.compile)."""
        expert = self.__dict__.get("_expert")
        if expert is None:
            expert = self.__dict__["_expert"] = self.key.long()
        return expert

    @property
    def counts(self) -> torch.Tensor:
        """(E,) int64 rows per expert (calibration's count; the forward itself needs only ``offs``)."""
        ends = self.offs.long()
        return torch.diff(ends, prepend=ends.new_zeros(1))


def dispatch(top_k_index: torch.Tensor, top_k_weights: torch.Tensor, num_experts: int, sentinels: bool) -> Dispatch:
    """Sort the assignments of ``top_k_index`` (tokens, k) by expert (within an expert: by slot, then token);
    ``sentinels``: the index ``num_experts`` may appear (expert parallelism: a remote expert), its rows
    sort last and belong to no group."""
    tokens, k = top_k_index.shape
    # slot-major (row j * tokens + t): within an expert, rows in the order of the loop's
    # torch.where(expert_mask[e]) over (k, tokens); a GEMM's row results depend on their place in a tile
    # the narrowest key that holds 0..E (E: the sentinel): a radix sort makes one pass per key byte; the
    # transposing copy casts too
    flat = top_k_index.t().to(_key_dtype(num_experts, top_k_index.dtype), memory_format=torch.contiguous_format).reshape(-1)
    key, order = torch.sort(flat, stable=True)
    # the rows sort by expert: expert e's group ends after the rows of experts <= e (sentinels, == E, after all)
    bounds = torch.arange(num_experts, dtype=key.dtype, device=key.device)
    offs = torch.searchsorted(key, bounds, right=True, out_int32=True)
    inverse = torch.empty_like(order).scatter_(0, order, torch.arange(order.numel(), device=order.device))
    # a token's sorted rows, ascending, are its slots in ascending expert order (equal experts, i.e.
    # sentinels, by slot): the order in which the loop adds them
    combine_index = torch.sort(inverse.view(k, tokens).t(), dim=1).values
    valid = (key < num_experts).unsqueeze(-1) if sentinels else None
    if sentinels:
        key = key.clamp(max=num_experts - 1)
    token = order % tokens
    return Dispatch(token, key, top_k_weights[token, order // tokens], offs, combine_index, valid)


def _key_dtype(num_experts: int, dtype: torch.dtype) -> torch.dtype:
    """The sort key's dtype: uint8 up to 255 experts, int16 up to 32767, else ``dtype``."""
    return torch.uint8 if num_experts <= 255 else torch.int16 if num_experts <= 32767 else dtype


def combine(d: Dispatch, rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """(tokens, H) sum of each token's weighted expert rows (``rows`` (S, H), sorted), in ``dtype``."""
    if not (torch.is_grad_enabled() and rows.requires_grad):
        fused = _fused(rows, d.weight, dtype)
        if fused is not None:  # one pass, the same bits
            return fused.combine_rows(rows, d.weight, d.valid, d.combine_index, dtype)
    return combine_torch(d, rows, dtype)


def combine_torch(d: Dispatch, rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """:func:`combine` by torch ops (the CPU's, torch.compile's and autograd's; the reference of the fused kernel)."""
    rows = rows * d.weight.unsqueeze(-1)
    if d.valid is not None:
        rows = torch.where(d.valid, rows, 0)  # sentinel rows are unset by the grouped GEMM: NaN * 0 is NaN
    rows = rows.to(dtype)
    if torch.is_grad_enabled() and rows.requires_grad and not _functorch_active():
        return _Combine.apply(rows, d.combine_index, d.token)
    return _add_picked(rows, d.combine_index)  # (torch.func transforms: autograd over the adds, same values)


def _fused(rows: torch.Tensor, weight: torch.Tensor | None, dtype: torch.dtype):
    """The Triton combine module where it runs these: CUDA tensors, triton installed, eager (torch.compile
    fuses the torch ops by itself); else None."""
    if not rows.is_cuda or torch.compiler.is_compiling() or _functorch_active() or not triton_available():
        return None
    from ..kernels.triton import combine as fused

    return fused if fused.supported(rows, weight, dtype) else None


def _add_picked(rows: torch.Tensor, combine_index: torch.Tensor) -> torch.Tensor:
    """The k adds of each token's rows in ascending expert order, from zeros: the loop's ``index_add_`` bits."""
    picked = rows[combine_index].unbind(1)  # k (tokens, H) rows
    if not picked:
        return rows.new_zeros(combine_index.shape[0], rows.shape[1])
    out = picked[0] + 0  # zeros + row: a -0 becomes +0, as in the loop's first index_add_
    for row in picked[1:]:
        out = out + row
    return out


class _Combine(torch.autograd.Function):
    """:func:`_add_picked` whose backward gives each sorted row its token's gradient, one gather
    (``index_add_``'s own backward, which the loop runs). Autograd over the adds of ``picked[:, j]`` would
    instead zero-fill k (tokens, k, H) tensors, sum them and scatter the result back: about 30 passes over
    the (tokens, H) output."""

    # forward(ctx, ...): a separate setup_context costs an inspect.signature per call (see kernels.ops._FakeQuantSTE)
    @staticmethod
    def forward(ctx, rows: torch.Tensor, combine_index: torch.Tensor, token: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(token)
        fused = _fused(rows, None, rows.dtype)
        return _add_picked(rows, combine_index) if fused is None else fused.combine_rows(rows, None, None, combine_index, rows.dtype)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (token,) = ctx.saved_tensors
        return grad[token], None, None


def group_rows(counts: torch.Tensor, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(int32 end row of each group, group of each of ``rows`` rows) of rows already sorted by group,
    ``counts`` rows per group (on any device: the result is on the device it is on). Rows past the
    last group are given to it."""
    offs = torch.cumsum(counts.to(torch.int64), 0).to(torch.int32)
    group = torch.searchsorted(offs, torch.arange(rows, dtype=torch.int32, device=offs.device), right=True)
    return offs, group.clamp_(max=counts.shape[0] - 1)


__all__ = ["Dispatch", "combine", "combine_torch", "dispatch", "group_rows"]
