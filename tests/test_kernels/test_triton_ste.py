"""The fused straight-through backward kernel (:mod:`quantlib.kernels.triton.ste`) under Triton's
interpreter on the CPU, bit for bit against the torch expression ``where(|x| <= amax, grad, 0)``.

As in test_triton_kernels.py: the interpreter must be on when triton is first imported and the switch
is process-wide, so where a GPU is present (or triton came up compiled) the module runs in a subprocess.
"""

from __future__ import annotations

import pytest
import torch

from . import _interpreted  # noqa: E402

_FRESH = _interpreted.start()

triton = pytest.importorskip("triton")

from quantlib.formats import FormatSpec, Kind  # noqa: E402
from quantlib.kernels import ops  # noqa: E402

from ._ste_cases import CASES, amax_for, bits, inputs  # noqa: E402

DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@pytest.fixture(autouse=True)
def interpreted(request):
    _interpreted.skip_unless_fresh(request, _FRESH)


def test_module_in_a_fresh_interpreter():
    _interpreted.run_in_subprocess(__file__, _FRESH)


def _fused(grad, x, spec, amax):
    from quantlib.kernels.triton.ste import ste_grad

    return ste_grad(grad, x, spec, amax)


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(bits(a), bits(b))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_kernel_matches_the_torch_expression(case, dtype):
    name, spec, shape, amax_shape = case
    amax = amax_for(spec, shape, amax_shape)
    x, grad = inputs(shape, amax, dtype)
    mask = ops.ste_mask(x, spec, amax)
    expected = torch.where(mask, grad, 0.0)
    out = _fused(grad, x, spec, amax)
    if name == "no 2-D view":
        assert out is None  # a broadcast no [R, C] strides express: the caller's torch expression
        return
    assert out is not None and _same(out, expected)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_non_contiguous_input_and_expanded_gradient(dtype):
    spec = FormatSpec(kind=Kind.INT, num_bits=8)
    amax = amax_for(spec, (40, 6), (40, 1))
    base, _ = inputs((6, 40), amax, dtype)
    x = base.t()  # (40, 6), not contiguous
    grad = torch.tensor(1.5, dtype=dtype).expand(40, 6)  # what sum().backward() hands over
    out = _fused(grad, x, spec, amax)
    assert _same(out, torch.where(ops.ste_mask(x, spec, amax), grad, 0.0))


def test_partial_tiles_of_long_rows():
    spec = FormatSpec(kind=Kind.INT, num_bits=4, block=(128,))
    shape = (3, 20000)  # a row wider than one tile, and a partial last block
    amax = amax_for(spec, shape, "blocks")
    x, grad = inputs(shape, amax, torch.bfloat16)
    assert _same(_fused(grad, x, spec, amax), torch.where(ops.ste_mask(x, spec, amax), grad, 0.0))


def test_amax_of_other_dtypes_is_read_as_fp32():
    spec = FormatSpec(kind=Kind.FP8, element=(4, 3))
    amax = torch.full((6, 1), 1.006, dtype=torch.float64)  # float() rounds it, as the torch expression does
    x, grad = inputs((6, 40), amax.float(), torch.bfloat16)
    assert _same(_fused(grad, x, spec, amax), torch.where(ops.ste_mask(x, spec, amax), grad, 0.0))


@pytest.mark.parametrize("bad", ["rank 0", "float64", "empty", "grad shape"])
def test_cases_left_to_torch(bad):
    spec = FormatSpec(kind=Kind.FP8, element=(4, 3))
    x, grad, amax = torch.randn(4, 8), torch.randn(4, 8), torch.tensor(1.0)
    if bad == "rank 0":
        x, grad = x[0, 0], grad[0, 0]
    elif bad == "float64":
        x, grad = x.double(), grad.double()
    elif bad == "empty":
        x, grad = x[:0], grad[:0]
    else:
        grad = grad[:, :4]
    assert _fused(grad, x, spec, amax) is None
