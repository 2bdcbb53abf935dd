"""The "cuda" backend: the compiled CUDA kernels of ``quantlib._C`` (csrc/cuda), bit-exact to the reference.

What the CUDA kernels cover (one pass over device memory, 16-byte vector loads, block amax + scale +
cast fused):

- ``fp8_blockwise_cast`` and FP8 blockwise fake quant: E4M3, blocks (128,) / (1, 128) and (128, 128),
  static or dynamic amax, eps, pow2;
- ``mx_cast`` and MX fake quant: MXFP8 and MXFP4, blocks of 32, rceil and floor (MXFP6 and MXINT8 are
  a gap: Triton's kernels implement every MX element);
- ``nvfp4_cast`` and NVFP4 fake quant: blocks of 16, static (one value) or dynamic global amax, dynamic blocks;
- INT block fake quant: blocks (16|32|64|128,) and (128, 128), static or dynamic amax;
- INT fake quant with one group a row (no block): a static amax per row (per channel, of shape
  ``x.shape[:-1] + (1,)``) or a dynamic one, for rows of up to 16384 16-bit / 8192 fp32 elements;

all for float32 / bfloat16 / float16 inputs of any rank whose last dim is a whole number of 16-byte
vectors (a multiple of 4 for float32, of 8 for 16-bit inputs).

This backend covers ``fake_quant``, ``fp8_blockwise_cast``, ``mx_cast`` and ``nvfp4_cast``
(:data:`~quantlib.kernels.backends.COVERS`), and of those the cases above: each kernel is registered with
its gap, the cases it does not take -- FP8 per tensor / per channel / dynamic per row, INT per tensor or
with other broadcast amax shapes or longer rows, E5M2 blockwise, other block sizes (NVFP4's 32), NVFP4
with static block amax or a global amax per row (stacked experts), other last dims, empty tensors. AUTO
runs those with Triton (or the reference), passing over this backend; an explicit ``KernelPreference.CUDA``
raises :class:`~quantlib.kernels.backends.KernelUnavailable` naming the op, the case and the backend, as it
does for ``fp8_cast`` and ``block_amax``, which it lacks.
"""

from __future__ import annotations

import torch

from ..formats import FormatSpec, Kind, Rounding
from ..formats.blocks import blocked_shape, check_block
from ..formats.int import int_range
from ..formats.mx import mx_element_name
from .backends import native_extension, register

_INT_BLOCKS = {(16,), (32,), (64,), (128,), (128, 128)}
_CUDA_MX_ELEMENTS = ("e4m3", "e2m1")  # the MX elements csrc/cuda/mx.cu implements


def _ext():
    return native_extension()


def _vector_ok(x: torch.Tensor) -> bool:
    """Shapes the CUDA kernels take: rank >= 1, a last dim of whole 16-byte vectors, not empty."""
    return x.is_cuda and x.dim() >= 1 and x.numel() > 0 and x.shape[-1] % (16 // x.element_size()) == 0


def _norm(block) -> tuple[int, ...]:
    block = tuple(int(b) for b in block)
    return block[1:] if len(block) == 2 and block[0] == 1 else block


def _where(x: torch.Tensor) -> str:
    return f"shape {tuple(x.shape)}, {str(x.dtype)[6:]} on {x.device.type}"


def _cuda_fake_quant_kind(x: torch.Tensor, spec: FormatSpec) -> bool:
    """Whether the CUDA kernels implement fake quant of ``spec`` on ``x``."""
    if not _vector_ok(x) or spec.block is None:
        return False
    block = _norm(spec.block)
    if len(block) == 2 and x.dim() < 2:
        return False
    if spec.kind == Kind.FP8_BLOCK:
        return tuple(spec.element) == (4, 3) and block in ((128,), (128, 128))
    if spec.kind == Kind.MX:
        return block == (32,) and spec.element is not None and mx_element_name(spec.element) in _CUDA_MX_ELEMENTS
    if spec.kind == Kind.NVFP4:  # blocks of 32 (and a static block amax, see _fake_quant_gap): a gap
        return block == (16,)
    if spec.kind == Kind.INT:
        return block in _INT_BLOCKS
    return False


def _static_block_amax(x: torch.Tensor, spec: FormatSpec, amax: torch.Tensor | None) -> torch.Tensor | None:
    if spec.dynamic or amax is None:
        if not spec.dynamic:
            raise ValueError(f"{spec.kind.value} format with a static scale needs an amax (calibrate first)")
        return None
    if tuple(amax.shape) != blocked_shape(x.shape, spec.block):
        raise ValueError(f"static block amax of shape {tuple(amax.shape)} does not fit input {tuple(x.shape)} with block {spec.block}: "
                         f"expected {blocked_shape(x.shape, spec.block)}")
    return amax.to(device=x.device, dtype=torch.float32)


def _int_rows(x: torch.Tensor, spec: FormatSpec, amax: torch.Tensor | None) -> bool:
    """Whether the per-row INT kernel takes ``spec`` on ``x`` (no block; dynamic, or a static amax with
    one element a row). A static format without an amax is taken: the kernel raises the reference's error."""
    if spec.kind != Kind.INT or spec.block is not None or not _vector_ok(x):
        return False
    if x.shape[-1] // (16 // x.element_size()) > _ext().cuda_int_row_max_vectors:
        return False
    return spec.dynamic or amax is None or is_per_row_amax(tuple(x.shape), tuple(amax.shape))


def is_per_row_amax(x_shape: tuple[int, ...], amax_shape: tuple[int, ...]) -> bool:
    """Whether an amax of ``amax_shape`` broadcast over ``x_shape`` gives one value a row (last dim):
    ``x_shape[:-1] + (1,)``, leading ones optional."""
    if len(amax_shape) > len(x_shape) or not x_shape:
        return False
    return (1,) * (len(x_shape) - len(amax_shape)) + tuple(amax_shape) == tuple(x_shape[:-1]) + (1,)


def _per_row_global(global_amax: torch.Tensor | None) -> bool:
    """An NVFP4 global amax of more than one value (one per row, e.g. per expert): the CUDA kernels take one
    scalar, the Triton kernel a value per row."""
    return global_amax is not None and global_amax.numel() != 1


def _fake_quant_gap(x: torch.Tensor, spec: FormatSpec, amax: torch.Tensor | None, block_amax: torch.Tensor | None = None) -> str | None:
    if _int_rows(x, spec, amax):
        return None
    per_row_global = spec.kind == Kind.NVFP4 and _per_row_global(amax)
    if _cuda_fake_quant_kind(x, spec) and block_amax is None and not per_row_global:
        return None
    extra = ", static block amax" if block_amax is not None else ", a global amax per row" if per_row_global else ""
    return f"kind {spec.kind.value!r} (block {spec.block}, element {spec.element}{extra}, {_where(x)})"


@register("fake_quant", "cuda", _fake_quant_gap)
def fake_quant(x: torch.Tensor, spec: FormatSpec, amax: torch.Tensor | None, block_amax: torch.Tensor | None = None) -> torch.Tensor:
    ext = _ext()
    if spec.kind == Kind.INT and spec.block is None:  # the gap lets only the per-row kernel's cases through
        if not spec.dynamic and amax is None:
            raise ValueError(f"{spec.kind.value} format with a static scale needs an amax (calibrate first)")
        a = None if spec.dynamic else amax.to(device=x.device, dtype=torch.float32).reshape(-1)
        lo, hi = int_range(spec.num_bits, spec.unsigned, spec.narrow_range)
        return ext.cuda_fake_quant_int_row(x, a, lo, hi)
    check_block(x, spec.block)
    block = list(_norm(spec.block))
    if spec.kind == Kind.MX:
        return ext.cuda_fake_quant_mx(x, tuple(spec.element) == (2, 1), Rounding(spec.rounding) == Rounding.FLOOR)
    if spec.kind == Kind.NVFP4:
        g = None if amax is None else amax.to(device=x.device, dtype=torch.float32).reshape(())
        return ext.cuda_fake_quant_nvfp4(x, g)
    a = _static_block_amax(x, spec, amax)
    if spec.kind == Kind.FP8_BLOCK:
        return ext.cuda_fake_quant_fp8_blockwise(x, a, block, float(spec.eps), bool(spec.pow2))
    lo, hi = int_range(spec.num_bits, spec.unsigned, spec.narrow_range)
    return ext.cuda_fake_quant_int_block(x, a, block, lo, hi)


def _fp8_blockwise_cast_gap(x: torch.Tensor, block: tuple[int, ...], eps: float, pow2: bool,
                            amax: torch.Tensor | None = None) -> str | None:
    b = _norm(block)
    # an extension built before the static cast existed has no cuda_fp8_blockwise_cast_static
    static_ok = amax is None or hasattr(_ext(), "cuda_fp8_blockwise_cast_static")
    if static_ok and _vector_ok(x) and b in ((128,), (128, 128)) and not (len(b) == 2 and x.dim() < 2):
        return None
    return f"{'static' if amax is not None else 'dynamic'} block {tuple(block)}, {_where(x)}"


@register("fp8_blockwise_cast", "cuda", _fp8_blockwise_cast_gap)
def fp8_blockwise_cast(x: torch.Tensor, block: tuple[int, ...], eps: float, pow2: bool, amax: torch.Tensor
                       | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    b = list(_norm(block))
    if amax is not None:
        return tuple(_ext().cuda_fp8_blockwise_cast_static(x, amax.to(device=x.device, dtype=torch.float32), b, float(eps), bool(pow2)))
    return tuple(_ext().cuda_fp8_blockwise_cast(x, b, float(eps), bool(pow2)))


def _mx_cast_gap(x: torch.Tensor, elem: str, block: int, rounding: Rounding) -> str | None:
    if _vector_ok(x) and block == 32 and elem in _CUDA_MX_ELEMENTS:
        return None
    return f"element {elem}, block {block}, {_where(x)}"


@register("mx_cast", "cuda", _mx_cast_gap)
def mx_cast(x: torch.Tensor, elem: str, block: int, rounding: Rounding) -> tuple[torch.Tensor, torch.Tensor]:
    return tuple(_ext().cuda_mx_cast(x, elem == "e2m1", Rounding(rounding) == Rounding.FLOOR))


def _nvfp4_cast_gap(x: torch.Tensor, global_amax: torch.Tensor | None, block: int = 16,
                    block_amax: torch.Tensor | None = None) -> str | None:
    if _vector_ok(x) and block == 16 and block_amax is None and not _per_row_global(global_amax):
        return None
    return (f"block {block}, static blocks {block_amax is not None}, global amax per row {_per_row_global(global_amax)}, "
            f"{_where(x)}")


@register("nvfp4_cast", "cuda", _nvfp4_cast_gap)
def nvfp4_cast(x: torch.Tensor, global_amax: torch.Tensor | None, block: int = 16,
               block_amax: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = None if global_amax is None else global_amax.to(device=x.device, dtype=torch.float32).reshape(())
    return tuple(_ext().cuda_nvfp4_cast(x, g))
