"""NVFP4 with static block amax and NVFP4 in blocks of 32, every backend bit for bit against the torch
reference: the C++ CPU kernels here; Triton and AUTO (whose CUDA backend passes both to Triton) on a GPU,
where an explicit CUDA choice refuses them. A static
block amax equal to each block's max |x| gives dynamic NVFP4 exactly; any other block amax is what
fake quant and the cast use, NaN blocks included."""

from __future__ import annotations

import pytest
import torch

from quantlib import kernels
from quantlib.formats import FormatSpec, Kind, block_amax
from quantlib.kernels import ops

from ._compare import assert_same, assert_same_all

NAN = float("nan")
DTYPES = (torch.float32, torch.bfloat16, torch.float16)
SHAPES = ((7, 100), (3, 5, 64), (1, 31), (16, 1024))


def _spec(block: int, dynamic: bool) -> FormatSpec:
    return FormatSpec(Kind.NVFP4, element=(2, 1), block=(block,), dynamic=dynamic)


def _x(shape, dtype, seed=0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g) * torch.logspace(-3, 1, shape[-1])
    return x.to(dtype)


def _cpu_backends() -> list[str]:
    from quantlib.kernels.backends import native_extension

    return ["cpu"] if native_extension() is not None else []


def _gpu_backends() -> list[str]:
    from quantlib.kernels.backends import has_cuda_kernels, triton_available

    if not torch.cuda.is_available():
        return []
    return (["triton"] if triton_available() else []) + (["auto"] if has_cuda_kernels() else [])


def _on(t: torch.Tensor, backend: str) -> torch.Tensor:
    return t.cuda() if backend in ("triton", "auto") else t


def _scrambled_block_amax(x: torch.Tensor, block: int, seed: int = 1) -> torch.Tensor:
    """Block amax that are not the blocks' max: some smaller (clipping), some larger, one zero."""
    g = torch.Generator().manual_seed(seed)
    a = block_amax(x.float(), (block,))
    a = a * (0.2 + 1.6 * torch.rand(a.shape, generator=g))
    a.view(-1)[0] = 0.0
    return a


BACKENDS = pytest.mark.parametrize("backend", _cpu_backends() + [pytest.param(b, marks=pytest.mark.gpu) for b in _gpu_backends()])


@BACKENDS
@pytest.mark.parametrize("block", [16, 32])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_fake_quant_matches_reference(backend, block, dtype, shape):
    x = _x(shape, dtype)
    g = x.float().abs().amax() * 0.7  # a static global amax below the max: some blocks saturate
    for spec, a in ((_spec(block, True), None), (_spec(block, False), _scrambled_block_amax(x, block))):
        ref = ops.fake_quant(x, spec, g, "reference", block_amax=a)
        got = ops.fake_quant(_on(x, backend), spec, _on(g, backend), backend, block_amax=None if a is None else _on(a, backend))
        assert_same(got.cpu(), ref, f"{backend} block {block} static {a is not None}")


@BACKENDS
@pytest.mark.parametrize("block", [16, 32])
@pytest.mark.parametrize("dtype", DTYPES)
def test_cast_matches_reference_and_dequantizes_to_fake_quant(backend, block, dtype):
    x = _x((9, 96), dtype, seed=2)
    g = x.float().abs().amax()
    for a in (None, _scrambled_block_amax(x, block, seed=3)):
        ref = kernels.nvfp4_cast(x, g, "reference", block, a)
        got = kernels.nvfp4_cast(_on(x, backend), _on(g, backend), backend, block, None if a is None else _on(a, backend))
        assert_same_all(tuple(t.cpu() for t in got), ref)
        deq = kernels.dequantize(got[0].cpu(), got[1].cpu(), "nvfp4", global_scale=got[2].cpu(), block=block, n=96, dtype=dtype)
        spec = _spec(block, a is None)
        assert_same(deq, ops.fake_quant(x, spec, g, "reference", block_amax=a))


@BACKENDS
@pytest.mark.parametrize("block", [16, 32])
def test_static_block_amax_of_the_blocks_max_is_dynamic_nvfp4(backend, block):
    x = _x((12, 200), torch.bfloat16, seed=4)
    g = x.float().abs().amax()
    dynamic = ops.fake_quant(x, _spec(block, True), g, "reference")
    static = ops.fake_quant(_on(x, backend), _spec(block, False), _on(g, backend), backend,
                            block_amax=_on(block_amax(x.float(), (block,)), backend))
    assert_same(static.cpu(), dynamic)


@BACKENDS
def test_nan_block_with_static_amax_is_nan_and_leaves_the_others(backend):
    x = _x((2, 64), torch.float32, seed=5)
    x[1, 20] = NAN
    a = block_amax(torch.nan_to_num(x), (16,))
    out = ops.fake_quant(_on(x, backend), _spec(16, False), _on(torch.tensor(4.0), backend), backend, block_amax=_on(a, backend)).cpu()
    assert bool(out[1, 16:32].isnan().all())
    assert not bool(out[1, :16].isnan().any() or out[1, 32:].isnan().any() or out[0].isnan().any())
    assert_same(out, ops.fake_quant(x, _spec(16, False), torch.tensor(4.0), "reference", block_amax=a))


@BACKENDS
def test_non_contiguous_matches_contiguous(backend):
    x = _x((64, 48), torch.float32, seed=6).t()  # (48, 64), non-contiguous
    a = _scrambled_block_amax(x.contiguous(), 32)
    g = x.abs().amax()
    got = ops.fake_quant(_on(x, backend), _spec(32, False), _on(g, backend), backend, block_amax=_on(a, backend)).cpu()
    assert_same(got, ops.fake_quant(x.contiguous(), _spec(32, False), g, "reference", block_amax=a))


@pytest.mark.parametrize("backend", ["reference"] + _cpu_backends())
def test_bad_block_amax_is_refused(backend):
    x = _x((4, 64), torch.float32)
    with pytest.raises(ValueError, match="does not fit|expected"):
        ops.fake_quant(x, _spec(16, False), torch.tensor(1.0), backend, block_amax=torch.ones(4, 3))
    with pytest.raises(ValueError, match="global amax"):
        ops.fake_quant(x, _spec(16, False), None, backend, block_amax=torch.ones(4, 4))
    with pytest.raises(ValueError, match="static blocks"):
        ops.fake_quant(x, _spec(16, True), torch.tensor(1.0), backend, block_amax=torch.ones(4, 4))
    with pytest.raises(ValueError, match="16 or 32"):
        kernels.nvfp4_cast(x, None, backend, block=64)


def test_compiled_fake_quant_with_block_amax_matches_eager():
    x = _x((8, 64), torch.float32, seed=7).requires_grad_(True)
    a = _scrambled_block_amax(x.detach(), 32)
    g = torch.tensor(3.0)
    fn = torch.compile(lambda t: ops.fake_quant(t, _spec(32, False), g, "reference", block_amax=a), fullgraph=True, backend="eager")
    assert_same(fn(x).detach(), ops.fake_quant(x.detach(), _spec(32, False), g, "reference", block_amax=a))


@pytest.mark.parametrize("block, static", [(32, False), (16, True), (32, True)])
def test_the_cuda_backend_declares_blocks_of_32_and_static_blocks_a_gap(monkeypatch, block, static):
    """Its kernels take NVFP4 in blocks of 16 with dynamic blocks: the rest is a declared gap (AUTO passes it
    on, an explicit choice refuses it), decided from shapes alone."""
    from quantlib.kernels import backends, cuda_impl

    monkeypatch.setattr(cuda_impl, "_vector_ok", lambda x: True)
    x = _x((4, 64), torch.float32)
    g, a = torch.tensor(3.0), _scrambled_block_amax(x, block) if static else None
    assert f"block {block}, static blocks {static}" in backends.uncovered("nvfp4_cast", "cuda", x, g, block, a)
    assert "kind 'nvfp4'" in backends.uncovered("fake_quant", "cuda", x, _spec(block, not static), g, a)
    assert backends.uncovered("nvfp4_cast", "cuda", x, g, 16, None) is None
    assert backends.uncovered("fake_quant", "cuda", x, _spec(16, True), g, None) is None


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_an_explicit_cuda_choice_refuses_blocks_of_32_and_static_blocks():
    from quantlib.kernels.backends import KernelUnavailable, has_cuda_kernels

    if not has_cuda_kernels():
        pytest.skip("quantlib._C is built without CUDA")
    x = _x((4, 64), torch.float32).cuda()
    g = x.float().abs().amax()
    with pytest.raises(KernelUnavailable, match="op 'nvfp4_cast': block 32, .* has no kernel in backend 'cuda'"):
        kernels.nvfp4_cast(x, g, "cuda", 32)
    with pytest.raises(KernelUnavailable, match="op 'fake_quant': kind 'nvfp4' .*static block amax.* backend 'cuda'"):
        ops.fake_quant(x, _spec(16, False), g, "cuda", block_amax=block_amax(x.float(), (16,)))
