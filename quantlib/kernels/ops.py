"""``torch.library`` custom ops that the rest of quantlib calls (fake kernels keep compiled graphs whole).

A :class:`~quantlib.formats.FormatSpec` travels through the op schema as primitive arguments; each op
resolves its backend (see :mod:`quantlib.kernels.backends`) and calls that backend's implementation.
"""

from __future__ import annotations

from typing import Optional

import torch

from ..formats import FormatSpec, Kind, Rounding, blocked_shape
from ..formats.blocks import from_blocks, to_blocks
from ..formats.fp8 import fp8_dtype
from ..formats.reference import check_block_amax
from .backends import Backend, check_backend, select

# --------------------------------------------------------------------------- spec <-> op arguments


def spec_args(spec: FormatSpec) -> tuple:
    """Primitive op arguments of ``spec`` (see :func:`spec_from_args`)."""
    return (
        spec.kind.value,
        spec.num_bits,
        list(spec.element or ()),
        spec.unsigned,
        spec.narrow_range,
        list(spec.block or ()),
        spec.dynamic,
        float(spec.eps),
        spec.pow2,
        Rounding(spec.rounding).value,
    )


def spec_from_args(kind: str, num_bits: int, element: list[int], unsigned: bool, narrow_range: bool, block: list[int], dynamic: bool,
                   eps: float, pow2: bool, rounding: str) -> FormatSpec:
    return FormatSpec(
        kind=Kind(kind),
        num_bits=num_bits,
        element=tuple(element) if element else None,
        unsigned=unsigned,
        narrow_range=narrow_range,
        block=tuple(block) if block else None,
        dynamic=dynamic,
        eps=eps,
        pow2=pow2,
        rounding=Rounding(rounding),
    )


# --------------------------------------------------------------------------- fake quant (+ STE)


@torch.library.custom_op("quantlib::fake_quant", mutates_args=())
def _fake_quant(
    x: torch.Tensor,
    amax: Optional[torch.Tensor],
    block_amax: Optional[torch.Tensor],
    kind: str,
    num_bits: int,
    element: list[int],
    unsigned: bool,
    narrow_range: bool,
    block: list[int],
    dynamic: bool,
    eps: float,
    pow2: bool,
    rounding: str,
    backend: str,
    clip_grad: bool,
) -> torch.Tensor:
    spec = spec_from_args(kind, num_bits, element, unsigned, narrow_range, block, dynamic, eps, pow2, rounding)
    return select("fake_quant", backend, x.device)(x, spec, amax, block_amax)


@_fake_quant.register_fake
def _(x, amax, block_amax, *args):
    return x.new_empty(x.shape)  # contiguous, as every backend returns


#: whether a torch.func transform (grad, vjp, ...) is running
_functorch_active = getattr(torch._C, "_are_functorch_transforms_active", lambda: False)


def ste_bound(spec: FormatSpec, amax: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    """The amax that clips the straight-through gradient of ``spec``, or None where it passes everywhere
    (no amax, a dynamic scale but NVFP4's global one, MX)."""
    if amax is None or not spec.calibrated_amax:
        return None
    return amax.detach()


def ste_mask(x: torch.Tensor, spec: FormatSpec, amax: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    """Where the straight-through gradient passes (``|x| <= amax``), or None where it passes everywhere."""
    if ste_bound(spec, amax) is None:
        return None
    # |x| stays in x's dtype: comparing it with a dimensioned fp32 amax promotes each element to fp32
    # inside the comparison (exact for bf16/fp16), without an fp32 copy of x; a 0-dim amax would not
    # promote (the comparison would round amax to x's dtype), hence the reshape
    mag = x.detach().abs()
    bound = amax.detach().float()
    if spec.per_block_amax:
        inside = to_blocks(mag, spec.block) <= bound.unsqueeze(-1)
        return from_blocks(inside, spec.block, x.shape)
    if bound.dim() == 0 and x.dim() > 0:
        bound = bound.reshape(1)
    return mag <= bound


def ste_grad(grad: torch.Tensor, x: torch.Tensor, spec: FormatSpec, amax: torch.Tensor) -> torch.Tensor:
    """``where(|x| <= amax, grad, 0)`` for the layouts of :func:`ste_mask`, in one pass (no mask copy in
    grad's dtype); differentiable, so a recorded backward (``create_graph=True``) has its derivative."""
    return torch.where(ste_mask(x, spec, amax), grad, 0.0)


def _setup_context(ctx, inputs, output):
    x, amax, clip_grad = inputs[0], inputs[1], inputs[14]
    mask = ste_mask(x, spec_from_args(*inputs[3:13]), amax) if clip_grad else None
    ctx.has_mask = mask is not None
    if mask is not None:
        ctx.save_for_backward(mask)


def _backward(ctx, grad):
    if ctx.has_mask:
        (mask,) = ctx.saved_tensors
        grad = torch.where(mask, grad, 0.0)  # one pass; no mask copy in grad's dtype
    return (grad,) + (None,) * 14


_fake_quant.register_autograd(_backward, setup_context=_setup_context)


def _save_for_ste(ctx, x: torch.Tensor, amax: Optional[torch.Tensor], spec: FormatSpec, clip_grad: bool) -> None:
    """Keep what the straight-through backward reads: the input and the clipping amax (references), if
    the gradient is clipped at all."""
    bound = ste_bound(spec, amax) if clip_grad else None
    ctx.spec = spec
    ctx.masked = bound is not None
    if ctx.masked:
        ctx.save_for_backward(x, bound)


class _FakeQuantSTE(torch.autograd.Function):
    """Eager QAT: the implementation called directly (no dispatcher, no spec re-parsed from op args);
    the backward reads the saved input and amax (references, not copies) and clips the gradient in one
    pass, instead of a bool mask made in the forward (two passes) and applied in the backward."""

    # forward(ctx, ...) rather than a separate setup_context: Function.apply binds a setup_context
    # Function's arguments with inspect.signature on every call (+20 us); torch.func transforms, which
    # need setup_context, take _FakeQuantSTEFunc instead (see fake_quant)
    @staticmethod
    def forward(ctx, x, amax, block_amax, spec, fn, clip_grad):
        _save_for_ste(ctx, x, amax, spec, clip_grad)
        return fn(x, spec, amax, block_amax)

    @staticmethod
    def backward(ctx, grad):
        if ctx.masked:
            x, bound = ctx.saved_tensors
            grad = ste_grad(grad, x, ctx.spec, bound)
        return grad, None, None, None, None, None


class _FakeQuantSTEFunc(torch.autograd.Function):
    """:class:`_FakeQuantSTE` in the form torch.func transforms (grad, vjp, ...) accept."""

    @staticmethod
    def forward(x, amax, block_amax, spec, fn, clip_grad):
        return fn(x, spec, amax, block_amax)

    @staticmethod
    def setup_context(ctx, inputs, output):
        x, amax, _, spec, _, clip_grad = inputs
        _save_for_ste(ctx, x, amax, spec, clip_grad)

    backward = staticmethod(_FakeQuantSTE.backward)


def eager_call(x: torch.Tensor) -> bool:
    """Whether an op may call its implementation directly: not traced by torch.compile and no autograd
    graph to record. Same function, same bits; it skips the dispatcher's per-call cost and the
    1.5 s / 120 MiB import of torch._dynamo that a custom op's first call triggers."""
    return not torch.compiler.is_compiling() and not (torch.is_grad_enabled() and x.requires_grad)


def fake_quant(
    x: torch.Tensor, spec: FormatSpec, amax: Optional[torch.Tensor] = None, backend: Backend = "auto",
    block_amax: Optional[torch.Tensor] = None, clip_grad: bool = True
) -> torch.Tensor:
    """Fake-quantize ``x`` (same shape and dtype); differentiable with the straight-through estimator,
    whose gradient is zeroed where ``|x| > amax`` (static amax) if ``clip_grad``, and passes everywhere
    otherwise. ``block_amax``: the stored block amax of NVFP4 with static blocks (``amax`` is then the global one).
    Eager calls run the implementation directly (through :class:`_FakeQuantSTE` where autograd records);
    torch.compile traces the custom op, whose fake kernel keeps the graph whole."""
    check_block_amax(spec, block_amax)
    if torch.compiler.is_compiling():
        return _fake_quant(x, amax, block_amax, *spec_args(spec), check_backend(backend), clip_grad)
    fn = select("fake_quant", backend, x.device)
    if torch.is_grad_enabled() and x.requires_grad:
        return (_FakeQuantSTEFunc if _functorch_active() else _FakeQuantSTE).apply(x, amax, block_amax, spec, fn, clip_grad)
    return fn(x, spec, amax, block_amax)


# --------------------------------------------------------------------------- real quantization


def _check_float_input(x: torch.Tensor, op: str) -> None:
    if x.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise TypeError(f"{op}: input must be float32, bfloat16 or float16, got {x.dtype}")


@torch.library.custom_op("quantlib::block_amax", mutates_args=())
def _block_amax(x: torch.Tensor, block: list[int], backend: str) -> torch.Tensor:
    return select("block_amax", backend, x.device)(x, tuple(block))


@_block_amax.register_fake
def _(x, block, backend):
    return x.new_empty(blocked_shape(x.shape, tuple(block)), dtype=torch.float32)


@torch.library.custom_op("quantlib::fp8_blockwise_cast", mutates_args=())
def _fp8_blockwise_cast(x: torch.Tensor, block: list[int], eps: float, pow2: bool, amax: Optional[torch.Tensor],
                        backend: str) -> tuple[torch.Tensor, torch.Tensor]:
    return select("fp8_blockwise_cast", backend, x.device)(x, tuple(block), eps, pow2, amax)


@_fp8_blockwise_cast.register_fake
def _(x, block, eps, pow2, amax, backend):
    return x.new_empty(x.shape, dtype=torch.float8_e4m3fn), x.new_empty(blocked_shape(x.shape, tuple(block)), dtype=torch.float32)


@torch.library.custom_op("quantlib::fp8_cast", mutates_args=())
def _fp8_cast(x: torch.Tensor, scale: torch.Tensor, element: list[int], backend: str) -> torch.Tensor:
    return select("fp8_cast", backend, x.device)(x, scale, tuple(element))


@_fp8_cast.register_fake
def _(x, scale, element, backend):
    return x.new_empty(x.shape, dtype=fp8_dtype(tuple(element)))


@torch.library.custom_op("quantlib::mx_cast", mutates_args=())
def _mx_cast(x: torch.Tensor, elem: str, block: int, rounding: str, backend: str) -> tuple[torch.Tensor, torch.Tensor]:
    return select("mx_cast", backend, x.device)(x, elem, block, Rounding(rounding))


@_mx_cast.register_fake
def _(x, elem, block, rounding, backend):
    scales = x.new_empty(blocked_shape(x.shape, (block,)), dtype=torch.uint8)
    if elem == "e2m1":
        return x.new_empty(*x.shape[:-1], (x.shape[-1] + 1) // 2, dtype=torch.uint8), scales
    dtype = {"e4m3": torch.float8_e4m3fn, "int8": torch.int8}.get(elem, torch.uint8)
    return x.new_empty(x.shape, dtype=dtype), scales


@torch.library.custom_op("quantlib::nvfp4_cast", mutates_args=())
def _nvfp4_cast(x: torch.Tensor, global_amax: Optional[torch.Tensor], block: int, block_amax: Optional[torch.Tensor],
                backend: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return select("nvfp4_cast", backend, x.device)(x, global_amax, block, block_amax)


@_nvfp4_cast.register_fake
def _(x, global_amax, block, block_amax, backend):
    return (
        x.new_empty(*x.shape[:-1], (x.shape[-1] + 1) // 2, dtype=torch.uint8),
        x.new_empty(blocked_shape(x.shape, (block,)), dtype=torch.float8_e4m3fn),
        x.new_empty(() if global_amax is None or global_amax.numel() == 1 else global_amax.shape, dtype=torch.float32),
    )
