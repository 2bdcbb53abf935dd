"""The straight-through backward on CUDA tensors against the torch expression on a CPU copy, bit for
bit; and the whole eager QAT path (forward + backward through ``ops.fake_quant``) against the same path
on the CPU."""

from __future__ import annotations

import pytest
import torch

from quantlib.formats import FormatSpec, Kind
from quantlib.kernels import ops

from ._ste_cases import CASES, amax_for, bits as _bits, inputs

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

DTYPES = (torch.float32, torch.bfloat16, torch.float16)
LARGE = [
    ("per-tensor", FormatSpec(kind=Kind.FP8, element=(4, 3)), (4096, 4096), ()),
    ("per-row", FormatSpec(kind=Kind.INT, num_bits=8), (1000, 4096), (1000, 1)),
    ("int4 block 128", FormatSpec(kind=Kind.INT, num_bits=4, block=(128,)), (3, 130, 1000), "blocks"),
    ("fp8 block 128x128", FormatSpec(kind=Kind.FP8_BLOCK, element=(4, 3), block=(128, 128)), (2, 300, 520), "blocks"),
]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", CASES + LARGE, ids=[c[0] for c in CASES + LARGE])
def test_cuda_ste_grad_matches_the_cpu_expression(case, dtype):
    _, spec, shape, amax_shape = case
    amax = amax_for(spec, shape, amax_shape)
    x, grad = inputs(shape, amax, dtype)
    expected = torch.where(ops.ste_mask(x, spec, amax), grad, 0.0)
    out = ops.ste_grad(grad.cuda(), x.cuda(), spec, amax.cuda())
    assert out.is_cuda and torch.equal(_bits(out), _bits(expected))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", LARGE, ids=[c[0] for c in LARGE])
def test_cuda_qat_gradient_equals_the_cpu_one(case, dtype):
    _, spec, shape, amax_shape = case
    amax = amax_for(spec, shape, amax_shape)
    x, grad = inputs(shape, amax, dtype)
    x = torch.where(x.isfinite(), x, 0.0)
    grads = []
    for dev in ("cpu", "cuda"):
        xr = x.detach().to(dev).clone().requires_grad_(True)  # x.to('cpu') is x itself: a leaf of its own per device
        ops.fake_quant(xr, spec, amax.to(dev)).backward(grad.to(dev))
        grads.append(_bits(xr.grad))
    assert torch.equal(grads[0], grads[1])


def test_double_backward_takes_the_differentiable_expression():
    spec = FormatSpec(kind=Kind.FP8, element=(4, 3))
    x = torch.tensor([0.5, 2.0, -0.25], device="cuda", requires_grad=True)
    y = ops.fake_quant(x, spec, torch.tensor(1.0, device="cuda"))
    v = torch.ones_like(y).requires_grad_(True)  # a gradient that is itself differentiated
    (g,) = torch.autograd.grad(y, x, v, create_graph=True)
    assert g.requires_grad  # recorded: the second derivative exists
    assert torch.equal(g.detach().cpu(), torch.tensor([1.0, 0.0, 1.0]))


def test_torch_func_grad_on_cuda():
    spec, amax = FormatSpec(kind=Kind.FP8, element=(4, 3)), torch.tensor(1.0, device="cuda")
    x = torch.tensor([0.5, 2.0, -0.25], device="cuda")
    g = torch.func.grad(lambda t: ops.fake_quant(t, spec, amax).sum())(x)
    assert torch.equal(g.cpu(), torch.tensor([1.0, 0.0, 1.0]))
