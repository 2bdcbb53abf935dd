"""Fast, bit-exact kernels of every format; every function takes ``backend=``, a :class:`KernelPreference`
(or its name: "auto" | "reference" | "cpu" | "triton" | "cuda"), and returns exactly what the torch reference
(:mod:`quantlib.formats`) returns.
"""

from __future__ import annotations

from typing import Optional, Union

import torch

from ..formats import FormatSpec, Rounding, blocked_shape
from ..formats.fp8 import fp8_dtype
from ..formats.fp8_blockwise import fp8_blockwise_dequantize
from ..formats.mx import MX_ELEMENTS, mx_dequantize
from ..formats.nvfp4 import check_global_amax, nvfp4_dequantize
from ..formats.spec import MIN_EPS
from . import ops
from .backends import BACKENDS, Backend, KernelPreference, KernelUnavailable, check_backend, resolve, select, uncovered


def _spec_of(attrs) -> FormatSpec:
    return attrs if isinstance(attrs, FormatSpec) else attrs.format_spec()


def fake_quant(x: torch.Tensor, attrs, amax: Optional[torch.Tensor] = None, backend: Backend = "auto",
               block_amax: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``dequantize(cast(x))`` for any QuantizerAttributeConfig or FormatSpec, straight-through backward:
    clipped at a static amax unless a config's ``pass_through_bwd`` says otherwise (a FormatSpec has no
    such field: clipped). ``block_amax``: NVFP4's static block amax, with ``amax`` its global amax."""
    return ops.fake_quant(x, _spec_of(attrs), amax, backend, block_amax, not getattr(attrs, "pass_through_bwd", False))


def block_amax(x: torch.Tensor, block: tuple[int, ...], backend: Backend = "auto") -> torch.Tensor:
    """fp32 amax per block: ``block`` is ``(B,)``/``(1, B)`` along the last dim or ``(BM, BK)``."""
    ops._check_float_input(x, "block_amax")
    if ops.eager_call(x):
        return select("block_amax", backend, x.device)(x, _norm_block(block))
    return ops._block_amax(x, list(_norm_block(block)), check_backend(backend))


def _norm_block(block: tuple[int, ...]) -> tuple[int, ...]:
    block = tuple(int(b) for b in block)
    return block[1:] if len(block) == 2 and block[0] == 1 else block


def fp8_blockwise_cast(
    x: torch.Tensor, block: tuple[int, int] = (128, 128), eps: float = 1e-10, pow2: bool = False, backend: Backend = "auto",
    amax: Optional[torch.Tensor] = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """E4M3 codes (shape of ``x``) and fp32 dequant scales per block, ``block`` = (1, B) or (BM, BK);
    ``amax``: a static amax per block (shape ``blocked_shape``), None: each block's max |x|."""
    ops._check_float_input(x, "fp8_blockwise_cast")
    if not eps >= MIN_EPS:
        raise ValueError(f"fp8_blockwise_cast: eps must be >= {MIN_EPS:g} (eps / 448 stays a normal fp32), got {eps}")
    block = _norm_block(block)
    if amax is not None:
        amax = amax.to(device=x.device, dtype=torch.float32)
        if tuple(amax.shape) != blocked_shape(x.shape, block):
            raise ValueError(f"fp8_blockwise_cast: static amax of shape {tuple(amax.shape)} does not fit input {tuple(x.shape)} with block "
                             f"{block}: expected {blocked_shape(x.shape, block)}")
    if ops.eager_call(x):
        return select("fp8_blockwise_cast", backend, x.device)(x, block, float(eps), bool(pow2), amax)
    return ops._fp8_blockwise_cast(x, list(block), float(eps), bool(pow2), amax, check_backend(backend))


def fp8_cast(x: torch.Tensor, scale: torch.Tensor, element: tuple[int, int] = (4, 3), backend: Backend = "auto") -> torch.Tensor:
    """FP8 codes ``cast(clamp(x * scale, -Q, Q))`` (E4M3 or E5M2 dtype, shape of ``x``) with the quantization
    scale ``Q / amax`` of a per-tensor (one value) or per-row (shape ``x.shape[:-1] + (1,)``) quantizer."""
    ops._check_float_input(x, "fp8_cast")
    element = tuple(int(e) for e in element)
    try:
        fp8_dtype(element)
    except ValueError as exc:
        raise ValueError(f"fp8_cast: {exc}") from None
    if scale.numel() != 1 and tuple(scale.shape) != tuple(x.shape[:-1]) + (1,):
        raise ValueError(f"fp8_cast: scale must have one element or shape {tuple(x.shape[:-1]) + (1,)} (one per row of the input "
                         f"{tuple(x.shape)}), got {tuple(scale.shape)}")
    if ops.eager_call(x):
        return select("fp8_cast", backend, x.device)(x, scale, element)
    return ops._fp8_cast(x, scale, list(element), check_backend(backend))


def mx_cast(x: torch.Tensor, elem: str = "e4m3", block: int = 32, rounding: Union[str, Rounding] = "rceil",
            backend: Backend = "auto") -> tuple[torch.Tensor, torch.Tensor]:
    """MX element codes (float8_e4m3fn; uint8 two E2M1 per byte; uint8 FP6 "e3m2" / "e2m3" codes, sign in
    bit 5; int8 for "int8") and uint8 E8M0 exponents."""
    ops._check_float_input(x, "mx_cast")
    if elem not in MX_ELEMENTS:
        raise ValueError(f"mx_cast: elem must be one of {sorted(MX_ELEMENTS)}, got {elem!r}")
    if block != 32:
        raise ValueError(f"mx_cast: MX blocks are 32 elements, got block={block}")
    if ops.eager_call(x):
        return select("mx_cast", backend, x.device)(x, elem, block, Rounding(rounding))
    return ops._mx_cast(x, elem, block, Rounding(rounding).value, check_backend(backend))


def nvfp4_cast(
    x: torch.Tensor, global_amax: Optional[torch.Tensor] = None, backend: Backend = "auto", block: int = 16,
    block_amax: Optional[torch.Tensor] = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Packed E2M1 codes (uint8), float8_e4m3fn block scales (``block`` = 16 or 32 elements) and fp32
    global scale; ``global_amax``: one value (0-dim scale) or one per row (a scale of its shape, e.g.
    ``(E, 1, 1)`` per expert of an ``(E, out, in)`` stack); ``block_amax``: static block amax (needs
    ``global_amax``), None: from ``x``."""
    ops._check_float_input(x, "nvfp4_cast")
    if block not in (16, 32):
        raise ValueError(f"nvfp4_cast: NVFP4 blocks are 16 or 32 elements, got block={block}")
    if global_amax is not None:
        try:
            check_global_amax(x.shape, global_amax)
        except ValueError as exc:
            raise ValueError(f"nvfp4_cast: {exc}") from None
        global_amax = global_amax.float().reshape(()) if global_amax.numel() == 1 else global_amax.float()
    if block_amax is not None and global_amax is None:
        raise ValueError("nvfp4_cast: a static block_amax needs the static global_amax it was chosen against")
    if ops.eager_call(x):
        return select("nvfp4_cast", backend, x.device)(x, global_amax, block, block_amax)
    return ops._nvfp4_cast(x, global_amax, block, block_amax, check_backend(backend))


#: MX format names of :func:`dequantize` and their element formats.
_MX_FMTS = {"mxfp8": "e4m3", "mxfp6_e3m2": "e3m2", "mxfp6_e2m3": "e2m3", "mxfp4": "e2m1", "mxint8": "int8"}


def dequantize(codes: torch.Tensor, scales: torch.Tensor, fmt: str, *, global_scale: Optional[torch.Tensor] = None,
               block: Union[int, tuple[int, ...]] = None, n: Optional[int] = None, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Inverse of each cast: ``fmt`` is "fp8_blockwise" (``block``), an MX format of ``_MX_FMTS`` or "nvfp4"
    (``global_scale``; ``block`` 16 or 32, default 16); ``n`` is the original last-dim size of packed FP4 codes."""
    if fmt == "fp8_blockwise":
        if block is None:
            raise ValueError("dequantize('fp8_blockwise') needs block=")
        out = fp8_blockwise_dequantize(codes, scales, _norm_block(block))
    elif fmt in _MX_FMTS:
        out = mx_dequantize(codes, scales, _MX_FMTS[fmt], 32, n)
    elif fmt == "nvfp4":
        if global_scale is None:
            raise ValueError("dequantize('nvfp4') needs global_scale=")
        out = nvfp4_dequantize(codes, scales, global_scale, n if n is not None else codes.shape[-1] * 2, block or 16)
    else:
        raise ValueError(f"dequantize: fmt must be 'fp8_blockwise', 'nvfp4' or one of {sorted(_MX_FMTS)}, got {fmt!r}")
    return out.to(dtype)


__all__ = ["BACKENDS", "KernelPreference", "KernelUnavailable", "block_amax", "dequantize", "fake_quant", "fp8_blockwise_cast", "fp8_cast",
           "mx_cast", "nvfp4_cast", "resolve", "uncovered"]
