"""The C++ CPU kernels of ``quantlib._C`` (csrc/cpu) registered as the "cpu" backend of every op.

Each function has the signature of its twin in :mod:`quantlib.kernels.reference_impl` and returns what
it returns, bit for bit (NaN payloads aside). The kernels take any layout (they make the input
contiguous) and fp32 / bf16 / fp16 inputs; one pass per block computes amax, scale and codes.
This backend covers every case of every op: where it has no C++ kernel (``fp8_cast``; a static FP8 blockwise
cast whose stored amax gives other scales than the blocks' own), its kernel is the torch formula on the CPU.
"""

from __future__ import annotations

from types import ModuleType

import torch

from ..formats import FormatSpec, Kind, Rounding
from ..formats.fp8 import fp8_codes
from ..formats.fp8_blockwise import blockwise_scale, fp8_blockwise_quantize
from ..formats.mx import mx_element_name, spec_element
from .backends import native_extension, register


def _ext() -> ModuleType:
    ext = native_extension()
    if ext is None:
        raise RuntimeError("backend 'cpu' needs the compiled quantlib._C extension, which is not built")
    return ext


def _is_dynamic(spec: FormatSpec, amax: torch.Tensor | None) -> bool:
    """As the reference decides: dynamic formats ignore ``amax``; static ones need it."""
    if spec.dynamic:
        return True
    if amax is None:
        raise ValueError(f"{spec.kind.value} format with a static scale needs an amax (calibrate first)")
    return False


def _broadcast_input(x: torch.Tensor, amax: torch.Tensor) -> torch.Tensor:
    """``x`` expanded to the broadcast shape of ``x`` and a per-tensor / per-channel ``amax``."""
    # by hand: torch.broadcast_shapes imports sympy and the symbolic-shape machinery on first use (0.3 s)
    a, b = tuple(x.shape), tuple(amax.shape)
    n = max(len(a), len(b))
    a, b = (1,) * (n - len(a)) + a, (1,) * (n - len(b)) + b
    if any(p != q and 1 not in (p, q) for p, q in zip(a, b)):
        raise ValueError(f"amax of shape {tuple(amax.shape)} does not broadcast to the input's {tuple(x.shape)}")
    shape = tuple(q if p == 1 else p for p, q in zip(a, b))  # a 1 takes the other size, 0 included
    return x if shape == tuple(x.shape) else x.expand(shape)


def _block(spec: FormatSpec) -> list[int]:
    if spec.block is None:
        raise ValueError(f"{spec.kind.value} format needs a block")
    return [int(b) for b in spec.block]


@register("fake_quant", "cpu")
def fake_quant(x: torch.Tensor, spec: FormatSpec, amax: torch.Tensor | None, block_amax: torch.Tensor | None = None) -> torch.Tensor:
    C = _ext()
    kind = spec.kind
    if kind == Kind.INT:
        dynamic = _is_dynamic(spec, amax)
        if spec.block is None and not dynamic:
            x = _broadcast_input(x, amax)
        return C.cpu_fake_quant_int(x, None if dynamic else amax, list(spec.block or ()), dynamic, spec.num_bits, spec.unsigned,
                                    spec.narrow_range)
    if kind == Kind.FP8:
        if spec.block is not None:
            raise NotImplementedError(f"cpu fake_quant: FP8 with block {spec.block} is not a format (use kind fp8_block)")
        dynamic = _is_dynamic(spec, amax)
        if not dynamic:
            x = _broadcast_input(x, amax)
        return C.cpu_fake_quant_fp8(x, None if dynamic else amax, list(spec.element or ()), dynamic)
    if kind == Kind.FP8_BLOCK:
        dynamic = _is_dynamic(spec, amax)
        return C.cpu_fake_quant_fp8_blockwise(x, None if dynamic else amax, _block(spec), list(spec.element or ()), float(spec.eps),
                                              spec.pow2)
    if kind == Kind.MX:
        return C.cpu_fake_quant_mx(x, mx_element_name(spec_element(spec)), _block(spec)[0], Rounding(spec.rounding) == Rounding.FLOOR)
    if kind == Kind.NVFP4:
        return C.cpu_fake_quant_nvfp4(x, amax, _block(spec)[0], block_amax)
    raise NotImplementedError(f"cpu fake_quant: unknown format kind {kind}")


@register("block_amax", "cpu")
def block_amax(x: torch.Tensor, block: tuple[int, ...]) -> torch.Tensor:
    return _ext().cpu_block_amax(x, list(block))


@register("fp8_blockwise_cast", "cpu")
def fp8_blockwise_cast(x: torch.Tensor, block: tuple[int, ...], eps: float, pow2: bool, amax: torch.Tensor
                       | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    codes, d = _ext().cpu_fp8_blockwise_cast(x, list(block), eps, pow2, [4, 3])
    if amax is None:
        return codes, d
    # Codes depend on each block's scale alone: where the static amax gives the scale of the block's own
    # max (weights calibrated from themselves), the fast cast's codes are the static ones. Host tensors:
    # comparing them costs no device round trip.
    if torch.equal(d, blockwise_scale(amax, (4, 3), eps, pow2)):
        return codes, d
    return fp8_blockwise_quantize(x, block, (4, 3), eps, pow2, amax)


@register("mx_cast", "cpu")
def mx_cast(x: torch.Tensor, elem: str, block: int, rounding: Rounding) -> tuple[torch.Tensor, torch.Tensor]:
    return _ext().cpu_mx_cast(x, elem, block, Rounding(rounding) == Rounding.FLOOR)


@register("nvfp4_cast", "cpu")
def nvfp4_cast(x: torch.Tensor, global_amax: torch.Tensor | None, block: int = 16, block_amax: torch.Tensor
               | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return _ext().cpu_nvfp4_cast(x, global_amax, block, block_amax)


@register("fp8_cast", "cpu")
def fp8_cast(x: torch.Tensor, scale: torch.Tensor, element: tuple[int, int]) -> torch.Tensor:
    ext = _ext()
    if not hasattr(ext, "cpu_fp8_cast"):  # an extension built before this kernel: the reference formula, chunked
        return fp8_codes(x, scale, element)
    return ext.cpu_fp8_cast(x, scale, list(element))
