"""The eager straight-through backward of ``ops.fake_quant`` (an autograd.Function that saves the input
and amax and clips the gradient in the backward) against the custom op's (a bool mask made in the
forward): same outputs, same gradient bits, for every format and amax layout, on the CPU."""

from __future__ import annotations

import pytest
import torch

from quantlib.formats import FormatSpec, Kind, Rounding
from quantlib.kernels import ops

from ._ste_cases import CASES, amax_for, bits as _bits, inputs

DTYPES = (torch.float32, torch.bfloat16, torch.float16)



def _custom_op_grad(x: torch.Tensor, spec: FormatSpec, amax, grad: torch.Tensor, clip: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """(output, input gradient) through the custom op and its registered autograd (the path before)."""
    xr = x.detach().clone().requires_grad_(True)
    y = ops._fake_quant(xr, amax, None, *ops.spec_args(spec), "auto", clip)
    y.backward(grad)
    return y.detach(), xr.grad


def _eager_grad(x: torch.Tensor, spec: FormatSpec, amax, grad: torch.Tensor, clip: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    xr = x.detach().clone().requires_grad_(True)
    y = ops.fake_quant(xr, spec, amax, clip_grad=clip)
    y.backward(grad)
    return y.detach(), xr.grad


def _checked(x: torch.Tensor, spec: FormatSpec, amax) -> bool:
    """Whether the CPU kernels take this case forward (some layouts are only for the mask)."""
    try:
        ops.fake_quant(x, spec, amax)
    except (ValueError, NotImplementedError, RuntimeError):
        return False
    return True


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_eager_gradient_bits_equal_the_custom_op_gradient(case, dtype):
    _, spec, shape, amax_shape = case
    amax = amax_for(spec, shape, amax_shape)
    x, grad = inputs(shape, amax, dtype)
    mask = ops.ste_mask(x, spec, amax)
    assert mask.any() and not mask.all()  # the case clips some gradients and passes others
    expected = torch.where(mask, grad, 0.0)
    if not _checked(x, spec, amax):
        pytest.skip("no CPU forward for this layout (the mask's layouts are wider than the kernels')")
    y_op, g_op = _custom_op_grad(x, spec, amax, grad)
    y, g = _eager_grad(x, spec, amax, grad)
    assert torch.equal(_bits(y), _bits(y_op))
    assert torch.equal(_bits(g), _bits(g_op))
    assert torch.equal(_bits(g), _bits(expected))


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_without_clip_grad_every_gradient_passes_on_both_paths(case):
    # ModelOpt's pass_through_bwd: the same forward, the gradient untouched even where |x| > amax
    _, spec, shape, amax_shape = case
    amax = amax_for(spec, shape, amax_shape)
    x, grad = inputs(shape, amax, torch.float32)
    if not _checked(x, spec, amax):
        pytest.skip("no CPU forward for this layout")
    y_clip, g_clip = _eager_grad(x, spec, amax, grad)
    y_op, g_op = _custom_op_grad(x, spec, amax, grad, clip=False)
    y, g = _eager_grad(x, spec, amax, grad, clip=False)
    assert not torch.equal(_bits(g_clip), _bits(grad))  # the case does clip when asked to
    assert torch.equal(_bits(y), _bits(y_clip)) and torch.equal(_bits(y_op), _bits(y_clip))
    assert torch.equal(_bits(g), _bits(grad)) and torch.equal(_bits(g_op), _bits(grad))


PASS_THROUGH = [
    ("dynamic int row", FormatSpec(kind=Kind.INT, num_bits=8, dynamic=True), True),
    ("mxfp8", FormatSpec(kind=Kind.MX, element=(4, 3), block=(32,), dynamic=True, rounding=Rounding.RCEIL), False),
    ("fp8 no amax", FormatSpec(kind=Kind.NVFP4, element=(2, 1), block=(16,), dynamic=True), False),
]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("name, spec, with_amax", PASS_THROUGH, ids=[c[0] for c in PASS_THROUGH])
def test_gradient_passes_where_the_format_has_no_mask(name, spec, with_amax, dtype):
    x, grad = inputs((4, 64), torch.tensor(1.0), dtype)
    x = torch.where(x.isfinite(), x, 0.0)  # dynamic scales: finite inputs
    amax = torch.tensor(0.5) if with_amax else None
    assert ops.ste_mask(x, spec, amax) is None
    y_op, g_op = _custom_op_grad(x, spec, amax, grad)
    y, g = _eager_grad(x, spec, amax, grad)
    assert torch.equal(_bits(y), _bits(y_op)) and torch.equal(_bits(g), _bits(grad)) and torch.equal(_bits(g), _bits(g_op))


def test_eager_grad_path_skips_the_custom_op(monkeypatch):
    def refused(*args, **kwargs):
        raise AssertionError("the custom op ran in eager mode")

    monkeypatch.setattr(ops, "_fake_quant", refused)
    x = torch.randn(4, 32, requires_grad=True)
    ops.fake_quant(x, FormatSpec(kind=Kind.FP8, element=(4, 3)), torch.tensor(1.0)).sum().backward()
    assert torch.equal(x.grad, (x.detach().abs() <= 1.0).float())


def test_backward_saves_the_input_itself_and_no_mask():
    x = torch.randn(8, 32, requires_grad=True)
    amax = torch.full((8, 1), 0.7)
    y = ops.fake_quant(x, FormatSpec(kind=Kind.INT, num_bits=8), amax)
    saved = y.grad_fn.saved_tensors
    assert len(saved) == 2 and saved[0].data_ptr() == x.data_ptr() and saved[1].data_ptr() == amax.data_ptr()
    assert all(t.dtype != torch.bool for t in saved)
    # a format without a mask saves nothing
    z = ops.fake_quant(x, FormatSpec(kind=Kind.INT, num_bits=8, dynamic=True))
    assert z.grad_fn.saved_tensors == ()
    # nor does a pass-through backward: x is not kept alive until the backward
    p = ops.fake_quant(x, FormatSpec(kind=Kind.INT, num_bits=8), amax, clip_grad=False)
    assert p.grad_fn.saved_tensors == ()


def test_double_backward_is_recorded():
    x = torch.tensor([0.5, 2.0, -0.25], requires_grad=True)
    y = ops.fake_quant(x, FormatSpec(kind=Kind.FP8, element=(4, 3)), torch.tensor(1.0))
    v = torch.ones_like(y).requires_grad_(True)  # a gradient that is itself differentiated
    (g,) = torch.autograd.grad(y, x, v, create_graph=True)
    assert g.requires_grad and torch.equal(g.detach(), torch.tensor([1.0, 0.0, 1.0]))


def test_torch_func_grad_works():  # the custom op's autograd refused torch.func transforms
    spec, amax = FormatSpec(kind=Kind.FP8, element=(4, 3)), torch.tensor(1.0)
    x = torch.tensor([0.5, 2.0, -0.25])
    g = torch.func.grad(lambda t: ops.fake_quant(t, spec, amax).sum())(x)
    assert torch.equal(g, torch.tensor([1.0, 0.0, 1.0]))
