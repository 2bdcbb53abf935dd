"""The straight-through gradient of fake quant in one pass: ``where(|x| <= amax, grad, 0)``.

The backward of :func:`quantlib.kernels.ops.fake_quant` under autograd reads the saved input ``x`` and
the amax and writes the clipped gradient, instead of a bool mask made in the forward (|x|, then <=)
and a select in the backward. The amax is indexed over a ``[R, C]`` view of ``x`` (C its last dim):
one value, a broadcast with row / column strides (per tensor, per row, per column), blocks of B along
the last dim, or BM x BK blocks over the last two dims. The gradient's bits are copied (or zeroed), so
the result is the torch expression's bit for bit; ``|x|`` is compared in fp32, as torch compares a
bf16 / fp16 ``|x|`` with a dimensioned fp32 amax.
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from ...formats import FormatSpec, Kind
from ...formats.blocks import blocked_shape
from ._launch import in_view, next_pow2
from ._numerics import load_f32

_BITS = {2: torch.int16, 4: torch.int32, 8: torch.int64}


@triton.jit
def ste_grad_kernel(
    g_ptr, x_ptr, a_ptr, out_ptr, R, C, a_sr, a_sc, M, NB, MB, KB,
    MODE: tl.constexpr, B: tl.constexpr, BM: tl.constexpr, BK: tl.constexpr, IN_DT: tl.constexpr,
    ROWS: tl.constexpr, BC: tl.constexpr,
):  # fmt: skip
    """MODE 0: one amax; 1: amax at ``row * a_sr + col * a_sc`` (4: ``a_sc`` is 0, one a row; 5: ``a_sr``
    is 0, one a column); 2: blocks of B along the row (NB a row); 3: BM x BK blocks of [L, M, C] (MB x KB
    of them per matrix)."""
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)[:, None]
    cols = tl.program_id(1) * BC + tl.arange(0, BC)[None, :]
    mask = (rows < R) & (cols < C)
    r64 = rows.to(tl.int64)
    offs = r64 * C + cols
    x = load_f32(x_ptr, offs, mask, IN_DT)
    if MODE == 0:
        a = tl.load(a_ptr)
    elif MODE == 4:  # one amax a row: a [ROWS, 1] load, not a gather per element
        a = tl.load(a_ptr + r64 * a_sr, mask=rows < R, other=0.0)
    elif MODE == 5:  # one a column
        a = tl.load(a_ptr + cols.to(tl.int64) * a_sc, mask=cols < C, other=0.0)
    else:
        if MODE == 1:
            idx = r64 * a_sr + cols.to(tl.int64) * a_sc
        elif MODE == 2:
            idx = r64 * NB + cols // B
        else:
            mat = r64 // M
            idx = (mat * MB + (r64 - mat * M) // BM) * KB + cols // BK
        a = tl.load(a_ptr + idx, mask=mask, other=0.0)
    inside = tl.abs(x) <= a  # NaN on either side: outside
    g = tl.load(g_ptr + offs, mask=mask, other=0)
    tl.store(out_ptr + offs, tl.where(inside, g, tl.zeros_like(g)), mask=mask)


def _norm_block(block) -> tuple[int, ...]:
    block = tuple(int(b) for b in block)
    return block[1:] if len(block) == 2 and block[0] == 1 else block


def _layout(x: torch.Tensor, spec: FormatSpec, amax: torch.Tensor) -> Optional[tuple[int, dict]]:
    """(MODE, index arguments) of the amax over ``x``'s [R, C] view, or None for a layout the kernel
    does not index (the caller then runs the torch expression, errors included)."""
    C = x.shape[-1]
    R = x.numel() // C
    args = {"a_sr": 0, "a_sc": 0, "M": 1, "NB": 1, "MB": 1, "KB": 1, "B": 1, "BM": 1, "BK": 1}
    if spec.block is not None and spec.kind != Kind.NVFP4:
        block = _norm_block(spec.block)
        if tuple(amax.shape) != blocked_shape(x.shape, block):
            return None
        if len(block) == 1:
            args.update(NB=-(-C // block[0]), B=block[0])
            return 2, args
        M = x.shape[-2]
        args.update(M=M, MB=-(-M // block[0]), KB=-(-C // block[1]), BM=block[0], BK=block[1])
        return 3, args
    if amax.numel() == 1 and amax.dim() <= x.dim():
        return 0, args
    if amax.dim() > x.dim():
        return None
    try:
        sr, sc = amax.expand(x.shape).view(R, C).stride()
    except RuntimeError:  # not a broadcast to x's shape, or one no 2-D view expresses
        return None
    args.update(a_sr=sr, a_sc=sc)
    return (4 if sc == 0 else 5 if sr == 0 else 1), args


def ste_grad(grad: torch.Tensor, x: torch.Tensor, spec: FormatSpec, amax: torch.Tensor) -> Optional[torch.Tensor]:
    """``where(|x| <= amax, grad, 0)`` with ``amax`` laid out as :func:`~quantlib.kernels.ops.ste_mask`
    reads it for ``spec``; None where the kernel does not take the case (ranks 0, other dtypes, devices
    or layouts: the caller computes it with torch)."""
    if (
        x.dim() == 0 or x.numel() == 0 or grad.shape != x.shape or grad.device != x.device or amax.device != x.device
        or x.dtype not in (torch.float32, torch.bfloat16, torch.float16) or grad.element_size() not in _BITS
        or (spec.block is not None and spec.kind != Kind.NVFP4 and x.dim() < len(_norm_block(spec.block)))
    ):  # fmt: skip
        return None
    amax = amax.float().contiguous()  # as the torch expression reads it
    layout = _layout(x, spec, amax)
    if layout is None:
        return None
    mode, a = layout
    C = x.shape[-1]
    R = x.numel() // C
    xin, in_dt = in_view(x)
    bits = _BITS[grad.element_size()]
    g = grad.contiguous()
    out = torch.empty(g.shape, dtype=g.dtype, device=g.device)
    elems = 4096 if x.is_cuda else 1 << 16
    BC = min(next_pow2(C), 1024 if x.is_cuda else 1 << 14)
    ROWS = max(1, min(next_pow2(R), elems // BC))
    grid = (-(-R // ROWS), -(-C // BC))
    ste_grad_kernel[grid](
        g.view(bits), xin, amax, out.view(bits), R, C,
        a["a_sr"], a["a_sc"], a["M"], a["NB"], a["MB"], a["KB"],
        MODE=mode, B=a["B"], BM=a["BM"], BK=a["BK"], IN_DT=in_dt, ROWS=ROWS, BC=BC, num_warps=4,
    )  # fmt: skip
    return out


__all__ = ["ste_grad"]
