"""The combine of the grouped MoE forward (:func:`quantlib.plugins.expert_dispatch.combine`): its output and
its backward against transformers' eager loop (``index_add_`` expert by expert), and the size of what its
backward writes (no (tokens, k, H) tensors: one gather of the output's gradient)."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from quantlib.kernels import backends
from quantlib.plugins.expert_dispatch import combine, combine_torch, dispatch

from ..test_kernels._combine_cases import CASES, routed, same_bits


class _Outputs(TorchDispatchMode):
    """Records the shape of every tensor an op returns."""

    def __init__(self) -> None:
        super().__init__()
        self.shapes: list[tuple] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor):
                self.shapes.append((func.__name__, tuple(t.shape)))
        return out


def _loop(rows: torch.Tensor, d, idx: torch.Tensor, dtype: torch.dtype, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(output, gradient of ``rows``) of transformers' eager combine: expert by expert, ``index_add_`` of its
    weighted rows (a tensor of their own, as each expert's GEMM output is) into zeros."""
    out = torch.zeros(idx.shape[0], rows.shape[1], dtype=dtype)
    slot_of = torch.argsort(torch.argsort(idx, dim=1, stable=True), dim=1)  # each slot's place in ascending expert order
    leaves = []
    for e in range(int(idx.max()) + 1):
        token, slot = torch.where(idx == e)
        sorted_rows = d.combine_index[token, slot_of[token, slot]]
        h = rows[sorted_rows].detach().requires_grad_()
        leaves.append((sorted_rows, h))
        out.index_add_(0, token, (h * d.weight[sorted_rows, None]).to(dtype))
    out.backward(grad)
    gr = torch.empty_like(rows)
    for sorted_rows, h in leaves:
        gr[sorted_rows] = h.grad
    return out.detach(), gr


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_combine_gradient_is_the_loops_index_add_backward_bit_for_bit(dtype):
    """Signed zeros included: autograd over the adds turned a -0 gradient into +0 (0 + -0), the loop keeps it."""
    g = torch.Generator().manual_seed(0)
    tokens, k, experts, hidden = 10, 3, 5, 8
    idx = torch.stack([torch.randperm(experts, generator=g)[:k] for _ in range(tokens)])
    d = dispatch(idx, torch.rand(tokens, k, generator=g), experts, False)
    rows = torch.randn(tokens * k, hidden, generator=g).to(dtype)
    grad = torch.randn(tokens, hidden, generator=g).to(dtype)
    grad[::2, ::3] = -0.0
    r = rows.clone().requires_grad_()
    out = combine(d, r, dtype)
    out.backward(grad)
    out_loop, gr_loop = _loop(rows, d, idx, dtype, grad)
    bits = torch.int32 if dtype == torch.float32 else torch.int16
    assert torch.equal(out.detach().view(bits), out_loop.view(bits))
    assert torch.equal(r.grad.view(bits), gr_loop.view(bits))
    assert ((gr_loop == 0) & torch.signbit(gr_loop)).any()  # -0 among them, kept


def test_combine_backward_writes_nothing_of_tokens_by_k_by_hidden():
    tokens, k, experts, hidden = 6, 4, 8, 16
    g = torch.Generator().manual_seed(1)
    idx = torch.stack([torch.randperm(experts, generator=g)[:k] for _ in range(tokens)])
    d = dispatch(idx, torch.rand(tokens, k, generator=g), experts, False)
    rows = torch.randn(tokens * k, hidden, generator=g, requires_grad=True)
    out = combine(d, rows, torch.float32)
    rec = _Outputs()
    with rec:
        out.backward(torch.ones_like(out))
    assert rec.shapes and all(shape != (tokens, k, hidden) for _, shape in rec.shapes), rec.shapes
    assert torch.equal(rows.grad, d.weight.unsqueeze(-1).expand(-1, hidden))


def test_combine_compiles_whole_with_its_backward():
    tokens, k, experts, hidden = 6, 2, 4, 8
    g = torch.Generator().manual_seed(2)
    idx = torch.stack([torch.randperm(experts, generator=g)[:k] for _ in range(tokens)])
    weights, rows = torch.rand(tokens, k, generator=g), torch.randn(tokens * k, hidden, generator=g)
    grad = torch.randn(tokens, hidden, generator=g)

    def step(i, w, r):
        return combine(dispatch(i, w, experts, False), r, torch.float32)

    results = []
    for fn in (step, torch.compile(step, fullgraph=True, backend="aot_eager")):
        r = rows.clone().requires_grad_()
        out = fn(idx, weights, r)
        out.backward(grad)
        results.append((out.detach(), r.grad))
    assert torch.equal(results[0][0], results[1][0]) and torch.equal(results[0][1], results[1][1])


_CUDA_TRITON = torch.cuda.is_available() and backends.triton_available()
_COMBINE_ROWS = None
if _CUDA_TRITON:
    from quantlib.kernels.triton.combine import combine_rows as _COMBINE_ROWS


@pytest.mark.gpu
@pytest.mark.skipif(not _CUDA_TRITON, reason="the fused combine runs on CUDA tensors with triton installed")
@pytest.mark.parametrize("sentinels", [False, True], ids=["local", "sentinels"])
@pytest.mark.parametrize("dtypes", CASES, ids=lambda c: "-".join(str(t).removeprefix("torch.") for t in c))
def test_cuda_combine_is_fused_and_the_torch_combine_bit_for_bit(dtypes, sentinels, monkeypatch):
    """Compiled (no interpreter), with FMA contraction off: the eval combine and the autograd combine's forward."""
    import quantlib.kernels.triton.combine as fused

    calls = []
    monkeypatch.setattr(fused, "combine_rows", lambda *a: calls.append(a) or _COMBINE_ROWS(*a))
    for seed, (tokens, k, experts, hidden) in enumerate([(300, 8, 64, 2048), (5, 1, 3, 7), (37, 4, 16, 200)]):
        d, rows = routed(tokens, k, experts, hidden, dtypes, sentinels, seed, "cuda")
        want = combine_torch(d, rows, dtypes[2])
        assert same_bits(combine(d, rows, dtypes[2]), want), seed
        r = rows.clone().requires_grad_()
        got = combine(d, r, dtypes[2])  # autograd: the torch weighting, then _Combine (fused adds forward)
        assert same_bits(got.detach(), want), seed
        got.float().sum().backward()
    assert len(calls) == 6


_DEVICES = ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")])]


@pytest.mark.parametrize("device", _DEVICES)
@pytest.mark.parametrize("num_experts", [8, 254, 255, 256, 300, 32767, 32768])
@pytest.mark.parametrize("sentinels", [False, True])
def test_dispatch_sorts_by_expert_then_slot_then_token_whatever_the_key_width(num_experts, sentinels, device):
    """The sort key narrows to uint8 / int16 by the number of experts (the sentinel, E itself, must fit): the
    sorted rows, groups and combine indices are the int64 sort's, at each width's edges (CUDA's radix sort
    included)."""
    g = torch.Generator().manual_seed(num_experts)
    tokens, k = 37, 4
    idx = torch.stack([torch.randperm(num_experts, generator=g)[:k] for _ in range(tokens)])
    idx[:, 0] = num_experts - 1  # the largest expert id, the one the key must still hold
    if sentinels:
        idx[::3, 1] = num_experts  # remote experts: sort last, belong to no group
    d = dispatch(idx.to(device), torch.rand(tokens, k, generator=g).to(device), num_experts, sentinels)
    flat = idx.t().reshape(-1)
    rows = sorted(range(flat.numel()), key=lambda r: (int(flat[r]), r))  # by expert, then slot-major row
    assert d.token.tolist() == [r % tokens for r in rows]  # (tolist: from the device too)
    assert d.expert.dtype == torch.int64
    assert d.expert.tolist() == [min(int(flat[r]), num_experts - 1) for r in rows]
    counts = torch.bincount(flat, minlength=num_experts + 1)[:num_experts]
    assert torch.equal(d.offs.long().cpu(), counts.cumsum(0))
    place = {r: i for i, r in enumerate(rows)}
    for t in range(tokens):
        assert d.combine_index[t].tolist() == sorted(place[j * tokens + t] for j in range(k))
    if sentinels:
        assert d.valid.squeeze(-1).tolist() == [int(flat[r]) < num_experts for r in rows]
