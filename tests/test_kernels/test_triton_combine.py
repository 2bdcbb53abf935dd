"""The Triton combine of the MoE forward (:mod:`quantlib.kernels.triton.combine`) under Triton's interpreter
on the CPU, bit for bit against the torch ops it replaces (:func:`quantlib.plugins.expert_dispatch.combine_torch`):
every dtype the grouped forward meets, mixed routing-weight dtypes, signed zeros and expert-parallel
sentinel rows (left unset, NaN, by the grouped GEMM). On a GPU the same comparison runs compiled in
tests/test_plugins/test_expert_dispatch.py."""

from __future__ import annotations

import pytest
import torch

from . import _interpreted

_FRESH = _interpreted.start()

triton = pytest.importorskip("triton")

from quantlib.plugins.expert_dispatch import _add_picked, combine_torch  # noqa: E402

from ._combine_cases import CASES, routed, same_bits  # noqa: E402


@pytest.fixture(autouse=True)
def interpreted(request):
    _interpreted.skip_unless_fresh(request, _FRESH)


def test_module_in_a_fresh_interpreter():
    _interpreted.run_in_subprocess(__file__, _FRESH)


@pytest.mark.parametrize("sentinels", [False, True], ids=["local", "sentinels"])
@pytest.mark.parametrize("dtypes", CASES, ids=lambda c: "-".join(str(t).removeprefix("torch.") for t in c))
def test_combine_rows_is_the_torch_combine_bit_for_bit(dtypes, sentinels):
    from quantlib.kernels.triton.combine import combine_rows

    for seed, (tokens, k, experts, hidden) in enumerate([(9, 3, 6, 40), (5, 1, 3, 7), (12, 4, 4, 64)]):
        d, rows = routed(tokens, k, experts, hidden, dtypes, sentinels, seed)
        want = combine_torch(d, rows, dtypes[2])
        got = combine_rows(rows, d.weight, d.valid, d.combine_index, dtypes[2])
        assert same_bits(got, want), (seed, (got.float() - want.float()).abs().max())
        assert not sentinels or not got.isnan().any()
        if k == 1:  # a -0 row added to zeros is +0 (as the loop's index_add_ into zeros gives)
            zeros = want == 0
            assert zeros.any() and not torch.signbit(want[zeros]).any()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
def test_combine_rows_without_weights_is_the_adds_bit_for_bit(dtype):
    """The unweighted form that the autograd combine's forward runs on the GPU."""
    from quantlib.kernels.triton.combine import combine_rows

    d, rows = routed(7, 3, 5, 24, (dtype, dtype, dtype), False, 3)
    assert same_bits(combine_rows(rows, None, None, d.combine_index, dtype), _add_picked(rows, d.combine_index))


def test_combine_rows_refuses_float64():
    from quantlib.kernels.triton.combine import combine_rows

    d, rows = routed(3, 2, 4, 8, (torch.float32,) * 3, False, 0)
    with pytest.raises(TypeError, match="float64"):
        combine_rows(rows.double(), d.weight, None, d.combine_index, torch.float64)


@pytest.mark.parametrize("sentinels", [False, True], ids=["local", "sentinels"])
def test_combine_takes_the_kernel_where_offered_with_the_same_output_and_gradient(sentinels, monkeypatch):
    """The glue of :func:`combine` (eval) and of the autograd combine's forward, run here by offering the
    interpreted kernel for CPU tensors (on the GPU it is offered for CUDA tensors)."""
    from quantlib.kernels.triton import combine as fused
    from quantlib.plugins import expert_dispatch

    dtypes = (torch.bfloat16, torch.float32, torch.bfloat16)
    d, rows = routed(8, 3, 5, 24, dtypes, sentinels, 4)
    grad = torch.randn(8, 24).to(torch.bfloat16)
    want = combine_torch(d, rows, dtypes[2])
    r = rows.clone().requires_grad_()
    want_grad = torch.autograd.grad(combine_torch(d, r, dtypes[2]), r, grad)[0]
    calls = []
    monkeypatch.setattr(expert_dispatch, "_fused", lambda *a: calls.append(a) or fused)
    assert same_bits(expert_dispatch.combine(d, rows, dtypes[2]), want)
    got = expert_dispatch.combine(d, r, dtypes[2])
    assert same_bits(got.detach(), want)
    assert same_bits(torch.autograd.grad(got, r, grad)[0], want_grad)
    assert len(calls) == 2  # the eval combine, the autograd combine's forward
