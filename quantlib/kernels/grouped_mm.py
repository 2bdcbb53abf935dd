"""One GEMM per group of rows, the groups given by device offsets: ``torch._grouped_mm`` as a
``torch.library`` op with its own backward.

Why an op of our own: torch 2.13's ``_grouped_mm`` runs on the CPU in any float dtype, but its autograd
formula fails there ("Invalid strides/sizes") and its meta kernel refuses anything but bf16 under
torch.compile; as an opaque op with a fake kernel the same kernel runs eagerly and compiled (bit for bit),
and the backward is two more grouped GEMMs. Eager calls run the same kernels without the op's dispatch
(directly, or through an autograd.Function where autograd records): the op is for torch.compile and
torch.func. The offsets stay on the device: no host read. On the CPU each group's rows get the bits of
``F.linear`` on those rows (what the per-expert loop computed).
"""

from __future__ import annotations

import torch

from .ops import _functorch_active


@torch.library.custom_op("quantlib::grouped_mm", mutates_args=())
def _grouped_mm(x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    return torch._grouped_mm(x, w, offs=offs)


@_grouped_mm.register_fake
def _(x, w, offs):
    return x.new_empty(x.shape[0], w.shape[-1])


def _backward_impl(
    grad: torch.Tensor, x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor, need_x: bool, need_w: bool, w_rows: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    grad = grad.contiguous()
    # rows past offs[-1] (expert-parallel sentinels) belong to no group: their input gradient is zero
    gx = grad.new_zeros(0)
    if need_x:
        gx = torch._grouped_mm(grad, w.transpose(-2, -1), offs=offs)
        inside = torch.arange(gx.shape[0], device=gx.device) < offs[-1:]  # the kernel leaves other rows unset
        gx = torch.where(inside.unsqueeze(-1), gx, 0)
    gw = grad.new_zeros(0)
    if need_w:
        # w_rows: w is the transposed view of (groups, out, in) weights: their gradient in that layout,
        # grad^T @ x per group (Linear's own formula), so that it needs no transposing copy downstream
        gw = torch._grouped_mm(grad.transpose(0, 1), x, offs=offs) if w_rows else torch._grouped_mm(x.transpose(0, 1), grad, offs=offs)
    return gx, gw


@torch.library.custom_op("quantlib::grouped_mm_backward", mutates_args=())
def _grouped_mm_backward(
    grad: torch.Tensor, x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor, need_x: bool, need_w: bool, w_rows: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    return _backward_impl(grad, x, w, offs, need_x, need_w, w_rows)


@_grouped_mm_backward.register_fake
def _(grad, x, w, offs, need_x, need_w, w_rows):
    gx = grad.new_empty(x.shape) if need_x else grad.new_empty(0)
    if not need_w:
        return gx, grad.new_empty(0)
    return gx, grad.new_empty(w.shape[0], w.shape[2], w.shape[1]) if w_rows else grad.new_empty(w.shape[0], w.shape[1], w.shape[2])


def _setup_context(ctx, inputs, output):
    x, w, offs = inputs
    ctx.save_for_backward(x, w, offs)


def _backward(ctx, grad, backward=_grouped_mm_backward):
    x, w, offs = ctx.saved_tensors
    need_x, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
    w_rows = w.dim() == 3 and not w.is_contiguous() and w.transpose(-2, -1).is_contiguous()
    gx, gw = backward(grad, x, w, offs, need_x, need_w, w_rows)
    if need_w and w_rows:
        gw = gw.transpose(-2, -1)
    return (gx if need_x else None), (gw.to(w.dtype) if need_w else None), None


_grouped_mm.register_autograd(_backward, setup_context=_setup_context)


class _EagerGroupedMM(torch.autograd.Function):
    """The op's forward and backward called directly in eager autograd: the same kernels and bits, without the
    custom op's dispatch (about 40 us a call on the host, 100 us with autograd, before the GPU sees the GEMM)."""

    # forward(ctx, ...): a separate setup_context costs an inspect.signature per call (see ops._FakeQuantSTE)
    @staticmethod
    def forward(ctx, x, w, offs):
        ctx.save_for_backward(x, w, offs)
        return torch._grouped_mm(x, w, offs=offs)

    @staticmethod
    def backward(ctx, grad):
        return _backward(ctx, grad, _backward_impl)


def grouped_mm(x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """``x[rows of group g] @ w[g]`` for every group g: ``x`` (rows, in) sorted by group, ``w`` (groups,
    in, out) of any strides, ``offs`` the int32 end row of each group (cumulative counts, on x's device).
    Rows past ``offs[-1]`` are left as the kernel leaves them (mask them)."""
    if offs.dtype != torch.int32:
        raise TypeError(f"grouped_mm: offs must be int32 (cumulative rows per group), got {offs.dtype}")
    if x.dim() != 2 or w.dim() != 3 or x.shape[1] != w.shape[1] or offs.shape != (w.shape[0],):
        got = f"{tuple(x.shape)}, {tuple(w.shape)}, {tuple(offs.shape)}"
        raise ValueError(f"grouped_mm: expected x (rows, in), w (groups, in, out), offs (groups,); got {got}")
    if torch.compiler.is_compiling() or _functorch_active():
        return _grouped_mm(x, w, offs)  # the op: its fake kernel keeps the graph whole
    if torch.is_grad_enabled() and (x.requires_grad or w.requires_grad):
        return _EagerGroupedMM.apply(x, w, offs)
    return torch._grouped_mm(x, w, offs=offs)


__all__ = ["grouped_mm"]
