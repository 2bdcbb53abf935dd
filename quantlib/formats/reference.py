"""One entry point over all formats: the pure-torch reference that defines the numerics.

Every backend in :mod:`quantlib.kernels` must return exactly what these functions return.
"""

from __future__ import annotations

import torch

from . import fp8, fp8_blockwise, int as int_fmt, mx, nvfp4
from .blocks import block_amax, blocked_shape, from_blocks, to_blocks
from .qtensor import QuantizedTensor
from .spec import FormatSpec, Kind


def dynamic_amax(x: torch.Tensor, spec: FormatSpec) -> torch.Tensor:
    """The amax a dynamic format computes from ``x``: per block, or per row (token) without blocks."""
    if spec.block is not None:
        return block_amax(x, spec.block)
    return x.float().abs().amax(dim=-1, keepdim=True)


def _group_amax(x: torch.Tensor, spec: FormatSpec, amax: torch.Tensor | None) -> torch.Tensor | None:
    if spec.kind == Kind.MX:
        return None
    if spec.kind == Kind.NVFP4:
        return amax  # the global amax; None = dynamic
    if spec.dynamic or amax is None:
        if not spec.dynamic:
            raise ValueError(f"{spec.kind.value} format with a static scale needs an amax (calibrate first)")
        return dynamic_amax(x, spec)
    if spec.block is not None and tuple(amax.shape) != blocked_shape(x.shape, spec.block):
        raise ValueError(f"static block amax of shape {tuple(amax.shape)} does not fit input {tuple(x.shape)} with block {spec.block}: "
                         f"expected {blocked_shape(x.shape, spec.block)}")
    return amax


def check_block_amax(spec: FormatSpec, block_amax: torch.Tensor | None) -> None:
    """Only NVFP4 with static blocks takes a separate block amax (its ``amax`` is the global one)."""
    if block_amax is not None and (spec.kind != Kind.NVFP4 or spec.dynamic):
        raise ValueError(f"a block amax is for NVFP4 with static blocks, not {spec.kind.value} (dynamic={spec.dynamic})")


def quantize(x: torch.Tensor, spec: FormatSpec, amax: torch.Tensor | None = None, block_amax: torch.Tensor
             | None = None) -> QuantizedTensor:
    """Real quantization of ``x``: codes + scales; ``amax`` is the static amax (None if dynamic);
    ``block_amax``: the stored block amax of NVFP4 with static blocks (None: from ``x``)."""
    check_block_amax(spec, block_amax)
    a = _group_amax(x, spec, amax)
    shape, dtype = tuple(x.shape), x.dtype
    if spec.kind == Kind.INT:
        if spec.block is None:
            q, scale = int_fmt.int_codes(x, a, spec.num_bits, spec.unsigned, spec.narrow_range)
        else:
            q, scale = int_fmt.int_codes(to_blocks(x.float(), spec.block), a.unsqueeze(-1), spec.num_bits, spec.unsigned, spec.narrow_range)
            q, scale = from_blocks(q, spec.block, shape), scale.squeeze(-1)
        return QuantizedTensor(q.to(int_fmt.code_dtype(spec.num_bits, spec.unsigned)), scale, spec, shape, dtype)
    if spec.kind == Kind.FP8:
        codes, inv = fp8.fp8_quantize(x, a, spec.element)
        return QuantizedTensor(codes, inv, spec, shape, dtype)
    if spec.kind == Kind.FP8_BLOCK:
        codes, d = fp8_blockwise.fp8_blockwise_quantize(x, spec.block, spec.element, spec.eps, spec.pow2, a)
        return QuantizedTensor(codes, d, spec, shape, dtype)
    if spec.kind == Kind.MX:
        codes, byte = mx.mx_quantize(x, mx.spec_element(spec), spec.block[0], spec.rounding)
        return QuantizedTensor(codes, byte, spec, shape, dtype)
    if spec.kind == Kind.NVFP4:
        packed, sb8, s2 = nvfp4.nvfp4_quantize(x, a, spec.block[0], block_amax)
        return QuantizedTensor(packed, sb8, spec, shape, dtype, global_scale=s2)
    raise ValueError(f"unknown format kind {spec.kind}")


def dequantize(q: QuantizedTensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """Values of ``q`` in ``dtype`` (default: the dtype it was quantized from)."""
    spec, n = q.spec, q.shape[-1] if q.shape else 1
    if spec.kind == Kind.INT:
        if spec.block is None:
            out = int_fmt.int_dequant(q.codes, q.scale)
        else:
            out = from_blocks(int_fmt.int_dequant(to_blocks(q.codes.float(), spec.block), q.scale.unsqueeze(-1)), spec.block, q.shape)
    elif spec.kind == Kind.FP8:
        out = fp8.fp8_dequantize(q.codes, q.scale)
    elif spec.kind == Kind.FP8_BLOCK:
        out = fp8_blockwise.fp8_blockwise_dequantize(q.codes, q.scale, spec.block)
    elif spec.kind == Kind.MX:
        out = mx.mx_dequantize(q.codes, q.scale, mx.spec_element(spec), spec.block[0], n)
    elif spec.kind == Kind.NVFP4:
        out = nvfp4.nvfp4_dequantize(q.codes, q.scale, q.global_scale, n, spec.block[0])
    else:
        raise ValueError(f"unknown format kind {spec.kind}")
    return out.to(dtype or q.dtype)


def fake_quant(x: torch.Tensor, spec: FormatSpec, amax: torch.Tensor | None = None, block_amax: torch.Tensor | None = None) -> torch.Tensor:
    """``dequantize(quantize(x))`` in ``x``'s dtype."""
    return dequantize(quantize(x, spec, amax, block_amax))
