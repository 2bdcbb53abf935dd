"""The "triton" backend of every op (signatures of :mod:`quantlib.kernels.reference_impl`).

Inputs are made contiguous first (a non-contiguous input gives the result of its contiguous copy);
outputs are fresh contiguous tensors. Tensors on the CPU run under Triton's interpreter (tests),
CUDA tensors are compiled and autotuned (:mod:`._launch`).
"""

from __future__ import annotations

import torch

from ...formats import FormatSpec, Kind, Rounding
from ...formats.blocks import blocked_shape, check_block
from ...formats.fp8 import fp8_dtype
from ...formats.int import int_range
from ...formats.mx import mx_element, mx_limits, spec_element
from ...formats.nvfp4 import check_global_amax, nvfp4_global_scale
from ...formats.spec import FLOAT_FORMATS
from ..backends import register
from . import _kernels as K
from ._launch import (
    in_view,
    launch,
    next_pow2,
    out_view,
    tile_1d_candidates,
    tile_2d_candidates,
    tile_dynrow_candidates,
    tile_row_candidates,
)

_KIND = {Kind.INT: 0, Kind.FP8_BLOCK: 1, Kind.MX: 2, Kind.NVFP4: 3, Kind.FP8: 4}
_FP8E = {(4, 3): 0, (5, 2): 1}
_MX_FP8E = {(4, 3): 0, (3, 2): 2, (2, 3): 3, 8: 4}  # the kernels' FP8E code of each MX element but E2M1
_MX_CODE_DTYPES = {"e4m3": torch.float8_e4m3fn, "int8": torch.int8}  # FP6 codes: uint8


def _fp8e(element) -> int:
    try:
        return _FP8E[tuple(element)]
    except KeyError:
        raise ValueError(f"no FP8 element format {element}; expected (4, 3) or (5, 2)") from None


def _dummy(device: torch.device) -> torch.Tensor:
    return torch.empty(1, dtype=torch.float32, device=device)


def _format_consts(spec: FormatSpec) -> tuple[dict, float, float]:
    """Constexprs of ``spec`` and the runtime (lo, hi) of INT codes."""
    lo, hi = 0.0, 0.0
    c = {"KIND": _KIND[spec.kind], "QMAX": 1.0, "FP8E": 0, "POW2": False, "E2M1": False, "EMAX": 0, "FLOOR": False}
    if spec.kind == Kind.INT:
        lo, hi = int_range(spec.num_bits, spec.unsigned, spec.narrow_range)
    elif spec.kind == Kind.FP8_BLOCK:
        c.update(QMAX=FLOAT_FORMATS[tuple(spec.element)][0], FP8E=_fp8e(spec.element), POW2=bool(spec.pow2))
    elif spec.kind == Kind.MX:
        element = spec_element(spec)
        qmax, emax = mx_limits(element)
        fp8e = _MX_FP8E.get(element, 0)
        c.update(QMAX=qmax, EMAX=emax, FP8E=fp8e, E2M1=element == (2, 1), FLOOR=Rounding(spec.rounding) == Rounding.FLOOR)
    elif spec.kind == Kind.NVFP4:
        c.update(QMAX=6.0)
    return c, lo, hi


# --------------------------------------------------------------------------- layouts


def _norm_block(block) -> tuple[int, ...]:
    """(1, B) blocks are (B,) blocks: same groups, same amax layout for every rank >= 2."""
    block = tuple(int(b) for b in block)
    return block[1:] if len(block) == 2 and block[0] == 1 else block


def _views(x: torch.Tensor, op: int, out):
    """(input view, its dtype code, output view, its dtype code, dummy pointer) of a block kernel launch;
    only fake quant (op 1) writes ``out`` in the input's dtype."""
    xin, in_dt = in_view(x)
    out_dt = 0
    if op == 1:
        out, out_dt = out_view(out)
    return xin, in_dt, out, out_dt, _dummy(x.device)


def _block1d(
    x: torch.Tensor, B: int, op: int, fmt: dict, *, out=None, scale=None, amax=None, static=False, g=None, grows=False, s2=None,
    lo=0.0, hi=0.0, eps=0.0,
) -> None:
    C = x.shape[-1]
    R = x.numel() // C
    NB = -(-C // B)
    BP = next_pow2(B)
    xin, in_dt, out, out_dt, dummy = _views(x, op, out)
    dev = x.device
    args = (xin, out if out is not None else dummy, scale if scale is not None else dummy, amax if amax is not None else dummy,
            g if g is not None else dummy, s2 if s2 is not None else dummy, R, C, NB, (C + 1) // 2)
    consts = dict(lo=lo, hi=hi, eps=eps, OP=op, STATIC=static, GROWS=grows, B=B, BP=BP, IN_DT=in_dt, OUT_DT=out_dt, HW=x.is_cuda, **fmt)

    def grid(meta):
        return (-(-R // meta["ROWS"]), -(-NB // meta["NBT"]))

    launch(K.block1d_kernel, grid, args, consts, tile_1d_candidates(R, NB, BP, x.is_cuda), dev, x.numel())


def _block2d(x: torch.Tensor, block: tuple[int, int], op: int, fmt: dict, *, out=None, scale=None, amax=None, static=False, lo=0.0, hi=0.0,
             eps=0.0) -> None:
    BM, BK = block
    M, Kd = x.shape[-2], x.shape[-1]
    L = x.numel() // (M * Kd)
    MB, KB = -(-M // BM), -(-Kd // BK)
    xin, in_dt, out, out_dt, dummy = _views(x, op, out)
    dev = x.device
    args = (xin, out if out is not None else dummy, scale if scale is not None else dummy, amax if amax is not None else dummy, M, Kd, MB,
            KB)
    BMP, BKP = next_pow2(BM), next_pow2(BK)
    fmt = {k: fmt[k] for k in ("KIND", "QMAX", "FP8E", "POW2")}
    consts = dict(lo=lo, hi=hi, eps=eps, OP=op, STATIC=static, BM=BM, BK=BK, BMP=BMP, BKP=BKP, IN_DT=in_dt, OUT_DT=out_dt, HW=x.is_cuda,
                  **fmt)
    launch(K.block2d_kernel, lambda meta: (L * MB, KB), args, consts, tile_2d_candidates(BMP, BKP, x.is_cuda), dev, x.numel())


def _rowwise(x: torch.Tensor, out: torch.Tensor, amax: torch.Tensor | None, fmt: dict, lo: float, hi: float) -> None:
    C = x.shape[-1] if x.dim() else 1
    R = x.numel() // C
    xin, in_dt = in_view(x)
    o, out_dt = out_view(out)
    dev = x.device
    dummy = _dummy(dev)
    consts = dict(lo=lo, hi=hi, KIND=fmt["KIND"], QMAX=fmt["QMAX"], FP8E=fmt["FP8E"], IN_DT=in_dt, OUT_DT=out_dt, HW=x.is_cuda)
    if amax is None:
        args = (xin, o, dummy, dummy, dummy, dummy, R, C, 0, 0)
        consts.update(AMODE=4, NAN_GROUPS=False)
        cands = [{**c, "NCH": 1 if c["ONE_PASS"] else -(-C // c["BC"])} for c in tile_dynrow_candidates(R, C, x.is_cuda)]
        launch(K.rowwise_kernel, lambda meta: (-(-R // meta["ROWS"]), 1), args, consts, cands, dev, x.numel())
        return
    a = amax.to(device=dev, dtype=torch.float32).contiguous()
    gid = dummy
    nan_groups = fmt["KIND"] == 0  # the INT reference makes a group with a NaN element all NaN
    if a.numel() == 1:
        mode, sr, sc = 0, 0, 0
    else:
        view = a.expand(x.shape if x.dim() else (1,))
        try:
            sr, sc = view.view(R, C).stride()
            mode = 1 if sc == 0 else 2 if sr == 0 else 3
        except RuntimeError:  # a broadcast that no 2-D view of the amax expresses
            if not nan_groups and a.shape[-1] == 1:
                # one value a row (e.g. (E, 1, 1) over stacked (E, out, in) weights): R values, not R x C group indices
                a = view[..., :1].reshape(R, 1).contiguous()
                mode, sr, sc = 1, 1, 0
            else:  # index the groups
                gid = torch.arange(a.numel(), dtype=torch.int32, device=dev).view(a.shape).expand(view.shape).reshape(R, C)
                mode, sr, sc = 5, 0, 0
    flags = torch.zeros(a.numel() + 1, dtype=torch.int32, device=dev) if nan_groups else dummy
    gflag = flags[a.numel():] if nan_groups else dummy
    args = (xin, o, a, gid, flags, gflag, R, C, sr, sc)
    consts.update(AMODE=mode, NAN_GROUPS=nan_groups, ONE_PASS=True, NCH=1)
    cands = tile_row_candidates(R, C, x.is_cuda)
    launch(K.rowwise_kernel, lambda meta: (-(-R // meta["ROWS"]), -(-C // meta["BC"])), args, consts, cands, dev, x.numel())
    if nan_groups:
        rows, bc = cands[0]["ROWS"], cands[0]["BC"]
        tc = -(-C // bc)
        ntiles = -(-R // rows) * tc
        iters = next_pow2(-(-ntiles // (264 if x.is_cuda else 4)))
        nprog = -(-ntiles // iters)
        K.nan_groups_kernel[(nprog,)](o, gid, flags, gflag, R, C, sr, sc, tc, ntiles, ITERS=iters, AMODE=mode, ROWS=rows, BC=bc,
                                      NPROG=nprog, OUT_DT=out_dt, num_warps=4)


def _global_amax(x: torch.Tensor) -> torch.Tensor:
    """fp32 amax of |x| as a 1-element tensor on x's device (NaN if any NaN), computed on the device."""
    xin, in_dt = in_view(x)
    n = x.numel()
    block = 8192 if x.is_cuda else 65536
    parts = torch.empty(-(-n // block), dtype=torch.int32, device=x.device)
    K.absmax_kernel[(parts.numel(),)](xin, parts, n, BLOCK=block, IN_DT=in_dt, num_warps=8)
    return parts.max().reshape(1).view(torch.float32)


# --------------------------------------------------------------------------- ops


def _static_amax(x: torch.Tensor, spec: FormatSpec, amax: torch.Tensor | None) -> torch.Tensor | None:
    """The static group amax, None for a dynamic one; the reference's errors for misuse."""
    if spec.dynamic or amax is None:
        if not spec.dynamic:
            raise ValueError(f"{spec.kind.value} format with a static scale needs an amax (calibrate first)")
        return None
    if spec.block is not None and tuple(amax.shape) != blocked_shape(x.shape, spec.block):
        raise ValueError(f"static block amax of shape {tuple(amax.shape)} does not fit input {tuple(x.shape)} with block {spec.block}: "
                         f"expected {blocked_shape(x.shape, spec.block)}")
    return amax


def _nvfp4_static_blocks(x: torch.Tensor, block: int, amax: torch.Tensor | None, block_amax: torch.Tensor | None) -> torch.Tensor | None:
    """NVFP4's stored block amax as a contiguous fp32 tensor on ``x``'s device (None: dynamic blocks)."""
    if block_amax is None:
        return None
    if amax is None:
        raise ValueError("nvfp4: a static block amax needs the static global amax it was chosen against")
    if tuple(block_amax.shape) != blocked_shape(x.shape, (block,)):
        raise ValueError(f"nvfp4: static block amax of shape {tuple(block_amax.shape)} does not fit input {tuple(x.shape)} with block "
                         f"{block}: expected {blocked_shape(x.shape, (block,))}")
    return block_amax.to(device=x.device, dtype=torch.float32).contiguous()


def _nvfp4_global(x: torch.Tensor, amax: torch.Tensor | None) -> tuple[torch.Tensor, bool]:
    """NVFP4's global amax as contiguous fp32 on ``x``'s device: one value (computed from ``x`` where None),
    or one per row (a global amax per row, e.g. per expert: broadcast to the rows); and whether per row."""
    if amax is None:
        return _global_amax(x), False
    if amax.numel() == 1:
        return amax.to(device=x.device, dtype=torch.float32).reshape(1).contiguous(), False
    check_global_amax(x.shape, amax)
    return amax.to(device=x.device, dtype=torch.float32).expand(tuple(x.shape[:-1]) + (1,)).reshape(-1).contiguous(), True


def _rows_to_global_shape(s2_rows: torch.Tensor, shape: tuple[int, ...], global_shape: tuple[int, ...]) -> torch.Tensor:
    """The per-row ``s2`` written by the cast, back in the global amax's shape (equal along its broadcast dims)."""
    rows = tuple(shape[:-1]) + (1,)
    padded = (1,) * (len(rows) - len(global_shape)) + tuple(global_shape)
    return s2_rows.view(rows)[tuple(slice(0, 1) if g == 1 else slice(None) for g in padded)].reshape(global_shape)


@register("fake_quant", "triton")
def fake_quant(x: torch.Tensor, spec: FormatSpec, amax: torch.Tensor | None, block_amax: torch.Tensor | None = None) -> torch.Tensor:
    fmt, lo, hi = _format_consts(spec)
    if spec.kind in (Kind.MX, Kind.NVFP4):
        check_block(x, spec.block)
        out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
        if x.numel() == 0:
            return out
        g, a = None, _nvfp4_static_blocks(x, spec.block[0], amax, block_amax)
        grows = False
        if spec.kind == Kind.NVFP4:
            g, grows = _nvfp4_global(x, amax)
        _block1d(x, spec.block[0], 1, fmt, out=out, g=g, grows=grows, amax=a, static=a is not None)
        return out
    a = _static_amax(x, spec, amax)
    if spec.kind == Kind.FP8:
        if spec.block is not None:
            raise ValueError("fp8 (per tensor / channel) formats take no block; use fp8_block")
        fmt.update(QMAX=FLOAT_FORMATS[tuple(spec.element)][0], FP8E=_fp8e(spec.element))
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    if spec.block is None:
        if x.numel():
            _rowwise(x, out, a, fmt, lo, hi)
        return out
    check_block(x, spec.block)
    if x.numel() == 0:
        return out
    if a is not None:
        a = a.to(device=x.device, dtype=torch.float32).contiguous()
    eps = float(spec.eps)
    block = _norm_block(spec.block)
    if len(block) == 1:
        _block1d(x, block[0], 1, fmt, out=out, amax=a, static=a is not None, lo=lo, hi=hi, eps=eps)
    else:
        _block2d(x, block, 1, fmt, out=out, amax=a, static=a is not None, lo=lo, hi=hi, eps=eps)
    return out


@register("block_amax", "triton")
def block_amax(x: torch.Tensor, block: tuple[int, ...]) -> torch.Tensor:
    check_block(x, block)
    block = _norm_block(block)
    amax = torch.empty(blocked_shape(x.shape, block), dtype=torch.float32, device=x.device)
    if x.numel() == 0:
        return amax
    fmt, _, _ = _format_consts(FormatSpec(kind=Kind.INT))
    if len(block) == 1:
        _block1d(x, block[0], 0, fmt, amax=amax)
    else:
        _block2d(x, tuple(block), 0, fmt, amax=amax)
    return amax


@register("fp8_blockwise_cast", "triton")
def fp8_blockwise_cast(x: torch.Tensor, block: tuple[int, ...], eps: float, pow2: bool, amax: torch.Tensor
                       | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    check_block(x, block)
    codes = torch.empty(x.shape, dtype=torch.float8_e4m3fn, device=x.device)
    scale = torch.empty(blocked_shape(x.shape, block), dtype=torch.float32, device=x.device)
    if x.numel() == 0:
        return codes, scale
    fmt, _, _ = _format_consts(FormatSpec(kind=Kind.FP8_BLOCK, element=(4, 3), pow2=pow2))
    block = _norm_block(block)
    a = None
    if amax is not None:  # static: each block's scale from the stored amax, read by the same one-pass kernel
        if tuple(amax.shape) != blocked_shape(x.shape, block):
            raise ValueError(f"static block amax of shape {tuple(amax.shape)} does not fit input {tuple(x.shape)} with block {block}: "
                             f"expected {blocked_shape(x.shape, block)}")
        a = amax.to(device=x.device, dtype=torch.float32).contiguous()
    if len(block) == 1:
        _block1d(x, block[0], 2, fmt, out=codes.view(torch.uint8), scale=scale, amax=a, static=a is not None, eps=float(eps))
    else:
        _block2d(x, tuple(block), 2, fmt, out=codes.view(torch.uint8), scale=scale, amax=a, static=a is not None, eps=float(eps))
    return codes, scale


@register("mx_cast", "triton")
def mx_cast(x: torch.Tensor, elem: str, block: int, rounding: Rounding) -> tuple[torch.Tensor, torch.Tensor]:
    check_block(x, (block,))
    element = mx_element(elem)
    scales = torch.empty(blocked_shape(x.shape, (block,)), dtype=torch.uint8, device=x.device)
    if element == (2, 1):
        codes = torch.empty(*x.shape[:-1], (x.shape[-1] + 1) // 2, dtype=torch.uint8, device=x.device)
    else:
        codes = torch.empty(x.shape, dtype=_MX_CODE_DTYPES.get(elem, torch.uint8), device=x.device)
    codes_u8 = codes.view(torch.uint8)
    if x.numel() == 0:
        return codes, scales
    spec = FormatSpec(kind=Kind.MX, element=None if element == 8 else element, block=(block,), rounding=Rounding(rounding))
    fmt, _, _ = _format_consts(spec)
    _block1d(x, block, 2, fmt, out=codes_u8, scale=scales)
    return codes, scales


@register("nvfp4_cast", "triton")
def nvfp4_cast(x: torch.Tensor, global_amax: torch.Tensor | None, block: int = 16, block_amax: torch.Tensor
               | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    check_block(x, (block,))
    dev = x.device
    codes = torch.empty(*x.shape[:-1], (x.shape[-1] + 1) // 2, dtype=torch.uint8, device=dev)
    sb8 = torch.empty(blocked_shape(x.shape, (block,)), dtype=torch.float8_e4m3fn, device=dev)
    a = _nvfp4_static_blocks(x, block, global_amax, block_amax)
    if x.numel() == 0:  # no blocks: the global scale alone, from an amax of 0 where dynamic (as the C++ kernel)
        return codes, sb8, nvfp4_global_scale(torch.zeros((), device=dev) if global_amax is None else global_amax.to(device=dev))
    s2 = torch.empty((), dtype=torch.float32, device=dev)
    g, grows = _nvfp4_global(x, global_amax)
    if grows:
        s2 = torch.empty(g.numel(), dtype=torch.float32, device=dev)
    fmt, _, _ = _format_consts(FormatSpec(kind=Kind.NVFP4, element=(2, 1), block=(block,)))
    _block1d(x, block, 2, fmt, out=codes, scale=sb8.view(torch.uint8), g=g, grows=grows, s2=s2.view(-1), amax=a, static=a is not None)
    if grows:
        s2 = _rows_to_global_shape(s2, tuple(x.shape), tuple(global_amax.shape))
    return codes, sb8, s2


@register("fp8_cast", "triton")
def fp8_cast(x: torch.Tensor, scale: torch.Tensor, element: tuple[int, int]) -> torch.Tensor:
    codes = torch.empty(x.shape, dtype=fp8_dtype(element), device=x.device)
    if x.numel() == 0:
        return codes
    C = x.shape[-1] if x.dim() else 1
    R = x.numel() // C
    xin, in_dt = in_view(x)
    s = scale.to(device=x.device, dtype=torch.float32).contiguous()
    consts = dict(PER_ROW=s.numel() > 1, IN_DT=in_dt, QMAX=FLOAT_FORMATS[tuple(element)][0], FP8E=_fp8e(element), HW=x.is_cuda)
    args = (xin, codes.view(torch.uint8), s, R, C)
    launch(K.fp8_cast_kernel, lambda meta: (-(-R // meta["ROWS"]), -(-C // meta["BC"])), args, consts, tile_row_candidates(R, C, x.is_cuda),
           x.device, x.numel())
    return codes


__all__ = ["block_amax", "fake_quant", "fp8_blockwise_cast", "fp8_cast", "mx_cast", "nvfp4_cast"]
