"""kernels.grouped_mm: one GEMM per group of rows, bit for bit the per-group ``F.linear`` (forward and
backward), empty groups and rows past the last offset included, and one graph under torch.compile."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from quantlib.kernels.grouped_mm import grouped_mm

ENDS = [3, 3, 9, 12]  # group 1 is empty, rows 12.. (expert-parallel sentinels) belong to no group


def _data():
    g = torch.Generator().manual_seed(0)
    return torch.randn(14, 32, generator=g), torch.randn(4, 16, 32, generator=g)  # x (rows, in), w (groups, out, in)


def _loop(x, w):
    out, start = torch.zeros(x.shape[0], w.shape[1]), 0
    for e, end in enumerate(ENDS):
        out[start:end] = F.linear(x[start:end], w[e])
        start = end
    return out


def test_forward_and_backward_equal_the_per_group_linear():
    x, w = _data()
    offs = torch.tensor(ENDS, dtype=torch.int32)
    results = []
    for fn in (lambda a, b: grouped_mm(a, b.transpose(1, 2), offs), _loop):
        a, b = x.clone().requires_grad_(), w.clone().requires_grad_()
        out = fn(a, b)
        out[:12].square().sum().backward()
        results.append((out[:12], a.grad, b.grad))
    for got, want in zip(*results):
        assert torch.equal(got, want)
    assert torch.equal(results[0][1][12:], torch.zeros(2, 32))  # no gradient reaches rows of no group


def test_fullgraph_compile_equals_eager():
    x, w = _data()
    offs = torch.tensor(ENDS, dtype=torch.int32)
    compiled = torch.compile(lambda a, b, o: grouped_mm(a, b.transpose(1, 2), o), fullgraph=True, backend="aot_eager")
    assert torch.equal(compiled(x, w, offs)[:12], grouped_mm(x, w.transpose(1, 2), offs)[:12])


def test_offsets_must_be_int32_and_shapes_must_chain():
    x, w = _data()
    with pytest.raises(TypeError, match="offs must be int32"):
        grouped_mm(x, w.transpose(1, 2), torch.tensor(ENDS))
    with pytest.raises(ValueError, match=r"grouped_mm: expected x \(rows, in\)"):
        grouped_mm(x, w, torch.tensor(ENDS, dtype=torch.int32))


def _matmul_loop(x, w_in_out):
    out, start = torch.zeros(x.shape[0], w_in_out.shape[2]), 0
    for e, end in enumerate(ENDS):
        out[start:end] = x[start:end] @ w_in_out[e]
        start = end
    return out


@pytest.mark.parametrize("layout", ["out-in", "in-out"])
def test_weight_gradient_comes_in_the_weights_layout(layout):
    """(groups, out, in) weights multiplied as a transposed view get their gradient as a view of (groups,
    out, in) rows (grad^T @ x, Linear's formula: no transposing copy where it is accumulated or clipped);
    (groups, in, out) weights (x @ W, GPT-OSS's layout) x^T @ grad as they are; both bit for bit the
    per-group loop, eager and compiled."""
    x, w = _data()
    offs = torch.tensor(ENDS, dtype=torch.int32)
    a0 = x.clone()
    start = w if layout == "out-in" else w.transpose(1, 2).contiguous()
    loop = _loop if layout == "out-in" else _matmul_loop
    want = torch.func.grad(lambda b: loop(x, b)[:12].square().sum())(start)

    def run(fn):
        b = start.clone().requires_grad_()
        operand = b.transpose(1, 2) if layout == "out-in" else b
        seen = []
        if operand is not b:
            operand.register_hook(seen.append)
        fn(a0, operand, offs)[:12].square().sum().backward()
        return b.grad, seen

    eager, seen = run(grouped_mm)
    assert torch.equal(eager, want)
    if layout == "out-in":
        assert seen[0].transpose(1, 2).is_contiguous()
    compiled, _ = run(torch.compile(grouped_mm, fullgraph=True, backend="aot_eager"))
    assert torch.equal(compiled, want)


class _Ops(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.names: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.append(str(func.overloadpacket))
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("grad", [False, True], ids=["no grad", "autograd"])
def test_eager_calls_run_the_kernels_directly_with_the_ops_bits(grad):
    """Eager calls skip the custom op's dispatch (host time before the GPU gets the GEMM) and give the op's
    bits, forward and backward; the op itself stays for torch.compile (test above)."""
    from quantlib.kernels.grouped_mm import _grouped_mm

    x, w = _data()
    offs = torch.tensor(ENDS, dtype=torch.int32)
    results = []
    for fn in (grouped_mm, _grouped_mm):
        a, b = x.clone().requires_grad_(grad), w.clone().requires_grad_(grad)
        rec = _Ops()
        with rec:
            out = fn(a, b.transpose(1, 2), offs)
            if grad:
                out[:12].square().sum().backward()
        results.append((out[:12].detach(), a.grad, b.grad, rec.names))
    eager, op = results
    for got, want in zip(eager[:3], op[:3]):
        assert (got is None and want is None) or torch.equal(got, want)
    assert "quantlib.grouped_mm" in op[3] and not any(n.startswith("quantlib.") for n in eager[3]), eager[3]
    assert "aten._grouped_mm" in eager[3]
