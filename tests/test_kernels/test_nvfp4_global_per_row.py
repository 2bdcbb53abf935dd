"""NVFP4 with a global amax per row (one per expert of a stacked (E, out, in) weight): every CPU backend,
bit for bit the call per expert. The Triton kernel's twin is in test_triton_kernels.py (interpreter) and
test_gpu_kernels.py (GPU)."""

from __future__ import annotations

import pytest
import torch

from quantlib import kernels
from quantlib.formats import FormatSpec, Kind
from quantlib.formats.blocks import block_amax
from quantlib.kernels import backends

from ._compare import assert_same

NVFP4 = FormatSpec(Kind.NVFP4, element=(2, 1), block=(16,), dynamic=True)


def _cpu_backends() -> list[str]:
    return ["reference"] + (["cpu"] if backends.native_extension() is not None else [])


def _stack(shape, dtype, seed=0) -> tuple[torch.Tensor, torch.Tensor]:
    """Experts of very different magnitudes (each its own global scale), one all zero, one with amax 0."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g) * torch.logspace(-3, 3, shape[0]).reshape(-1, *([1] * (len(shape) - 1)))
    x[1] = 0.0
    amax = x.float().abs().amax(dim=tuple(range(1, x.dim())), keepdim=True)
    amax[0] *= 0.5  # a calibrated amax below the expert's max: its largest blocks saturate
    return x.to(dtype), amax


@pytest.mark.parametrize("backend", _cpu_backends())
@pytest.mark.parametrize("shape", [(4, 8, 64), (3, 5, 40), (2, 3, 4, 48)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("block", [16, 32])
def test_fake_quant_per_expert_equals_loop(backend, shape, dtype, block):
    x, amax = _stack(shape, dtype)
    spec = FormatSpec(Kind.NVFP4, element=(2, 1), block=(block,), dynamic=True)
    got = kernels.fake_quant(x, spec, amax, backend=backend)
    want = torch.stack([kernels.fake_quant(x[e], spec, amax[e].reshape(()), backend="reference") for e in range(shape[0])])
    assert_same(got, want, f"{backend} {shape} {dtype} block {block}")


@pytest.mark.parametrize("backend", _cpu_backends())
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cast_per_expert_equals_loop(backend, dtype):
    x, amax = _stack((5, 6, 48), dtype)
    codes, sb8, s2 = kernels.nvfp4_cast(x, amax, backend=backend)
    parts = [kernels.nvfp4_cast(x[e], amax[e], backend="reference") for e in range(5)]
    assert_same(codes, torch.stack([p[0] for p in parts]), "codes")
    assert_same(sb8, torch.stack([p[1] for p in parts]), "block scales")
    assert_same(s2, torch.stack([p[2] for p in parts]).reshape(5, 1, 1), "global scale per expert, in the amax's shape")
    back = kernels.dequantize(codes, sb8, "nvfp4", global_scale=s2, n=48)
    assert_same(back.to(dtype), kernels.fake_quant(x, NVFP4, amax, backend="reference"), "dequantize(cast) == fake_quant")


@pytest.mark.parametrize("backend", _cpu_backends())
def test_static_blocks_per_expert(backend):
    """NVFP4 with static blocks (a stored block amax next to the global one), one global amax per expert."""
    spec = FormatSpec(Kind.NVFP4, element=(2, 1), block=(16,), dynamic=False)
    x, amax = _stack((3, 4, 64), torch.float32)
    blocks = block_amax(x, (16,)) * 0.75
    got = kernels.fake_quant(x, spec, amax, backend=backend, block_amax=blocks)
    want = torch.stack([kernels.fake_quant(x[e], spec, amax[e], backend="reference", block_amax=blocks[e]) for e in range(3)])
    assert_same(got, want, backend)


@pytest.mark.parametrize("backend", _cpu_backends())
def test_one_global_amax_per_row(backend):
    """Any shape that broadcasts to one value a row: (out, 1) per row of a 2-D weight, (E, out, 1) of a stack."""
    x, _ = _stack((3, 4, 32), torch.float32, seed=1)
    rows = x.abs().amax(dim=-1, keepdim=True)
    got = kernels.fake_quant(x, NVFP4, rows, backend=backend)
    want = torch.stack([kernels.fake_quant(x[e, r], NVFP4, rows[e, r], backend="reference") for e in range(3)
                        for r in range(4)]).reshape(x.shape)
    assert_same(got, want, backend)
    assert_same(kernels.fake_quant(x[0], NVFP4, rows[0], backend=backend), want[0], f"{backend} 2-D")


@pytest.mark.parametrize("backend", _cpu_backends())
def test_one_value_keeps_its_meaning(backend):
    """A global amax of one element, whatever its shape, is the per-tensor one (0-dim scale)."""
    x, _ = _stack((2, 4, 32), torch.float32)
    one = torch.tensor([[[3.0]]])
    assert_same(kernels.fake_quant(x, NVFP4, one, backend=backend), kernels.fake_quant(x, NVFP4, torch.tensor(3.0), backend="reference"))
    assert kernels.nvfp4_cast(x, one, backend=backend)[2].shape == ()


@pytest.mark.parametrize("backend", _cpu_backends())
@pytest.mark.parametrize("bad", [(2,), (2, 1, 32), (4, 2, 1, 1), (2, 3, 1)])
def test_global_amax_not_per_row_is_refused(backend, bad):
    """(E,) would broadcast along the last dim, (E, 1, in) per column: refused, naming the shapes."""
    x = torch.randn(2, 4, 32)
    with pytest.raises(ValueError, match="neither one value nor one per row"):
        kernels.fake_quant(x, NVFP4, torch.ones(bad), backend=backend)
    with pytest.raises(ValueError, match="neither one value nor one per row"):
        kernels.nvfp4_cast(x, torch.ones(bad), backend=backend)


def test_compiled_cast_has_the_global_amax_shape():
    """The op's fake kernel gives the per-expert global scale its shape (a compiled graph stays whole)."""
    x, amax = _stack((3, 4, 32), torch.float32)
    fn = torch.compile(lambda x, a: kernels.nvfp4_cast(x, a, backend="reference"), fullgraph=True, backend="eager")
    assert_same(fn(x, amax), kernels.nvfp4_cast(x, amax, backend="reference"))
