"""Compiled Triton and CUDA kernels on a GPU, bit for bit against the torch reference.

The reference runs on a CPU copy of the input: it is the canonical one (torch's CUDA division by a
Python number is a multiplication by its reciprocal, so the reference itself is not device-independent
where it divides a tensor by a constant). Shapes are large (several waves of the GPU, autotuned
configs) and odd (partial blocks, rank 3, rows that are not a multiple of anything).
"""

from __future__ import annotations

import pytest
import torch

from ._compare import assert_same, assert_same_all  # noqa: E402,F401
from quantlib.formats import FormatSpec, Kind, Rounding
from quantlib.kernels import reference_impl as R

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

NAN, INF = float("nan"), float("inf")
DTYPES = (torch.float32, torch.bfloat16, torch.float16)
SHAPES = ((1000, 4096), (37, 1000), (3, 130, 264), (129, 136), (2, 9000), (5, 333))


def _backends() -> list[str]:
    from quantlib.kernels.backends import has_cuda_kernels, triton_available

    out = ["triton"] if triton_available() else []
    if has_cuda_kernels():
        out.append("cuda")
    return out


def _impl(op: str, backend: str):
    from quantlib.kernels.backends import implementation

    return implementation(op, backend)





def gpu_input(shape, dtype, seed=0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g) * torch.exp2(torch.randint(-8, 8, shape, generator=g).float())
    flat = x.view(-1)
    specials = torch.tensor([0.0, -0.0, 2.0**-130, 2.0**-9, 448.0, -448.0, 124.0, 127.9, 6.0, 5.0, 0.25, 0.75, 2.0**-24])
    flat[: specials.numel()] = specials[: flat.numel()]
    x = x.to(dtype)
    if x.shape[-1] >= 256:
        x[..., 128:256] = 0  # all-zero blocks
    return x


SPECS = [
    FormatSpec(Kind.INT, num_bits=8, dynamic=True),
    FormatSpec(Kind.INT, num_bits=4, block=(128,), dynamic=True),
    FormatSpec(Kind.INT, num_bits=4, block=(16,), dynamic=True),
    FormatSpec(Kind.INT, num_bits=8, block=(128, 128), dynamic=True),
    FormatSpec(Kind.FP8, element=(4, 3), dynamic=True),
    FormatSpec(Kind.FP8_BLOCK, element=(4, 3), block=(128,), dynamic=True),
    FormatSpec(Kind.FP8_BLOCK, element=(4, 3), block=(1, 128), dynamic=True, pow2=True),
    FormatSpec(Kind.FP8_BLOCK, element=(4, 3), block=(128, 128), dynamic=True),
    FormatSpec(Kind.FP8_BLOCK, element=(4, 3), block=(128, 128), dynamic=True, pow2=True),
    FormatSpec(Kind.FP8_BLOCK, element=(5, 2), block=(128,), dynamic=True),
    FormatSpec(Kind.MX, element=(4, 3), block=(32,)),
    FormatSpec(Kind.MX, element=(2, 1), block=(32,), rounding=Rounding.FLOOR),
    FormatSpec(Kind.NVFP4, element=(2, 1), block=(16,)),
]


def _id(spec):
    return f"{spec.kind.value}-{spec.num_bits if spec.kind == Kind.INT else spec.element}-{spec.block}-{'pow2' if spec.pow2 else ''}{Rounding(spec.rounding).value if spec.kind == Kind.MX else ''}"


@pytest.mark.parametrize("backend", ["triton", "cuda"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("spec", SPECS, ids=_id)
def test_fake_quant(spec, dtype, backend):
    if backend not in _backends():
        pytest.skip(f"backend {backend} not available")
    fn = _impl("fake_quant", backend)
    for i, shape in enumerate(SHAPES):
        if spec.block and len(spec.block) > len(shape):
            continue
        x = gpu_input(shape, dtype, seed=i)
        assert_same(fn(x.cuda(), spec, None), R.fake_quant(x, spec, None), f"{_id(spec)} {shape}")


@pytest.mark.parametrize("backend", ["triton", "cuda"])
def test_fake_quant_static(backend):
    if backend not in _backends():
        pytest.skip(f"backend {backend} not available")
    fn = _impl("fake_quant", backend)
    x = gpu_input((512, 1024), torch.bfloat16, seed=7)
    x[3, 5] = NAN
    x[9, 9] = INF
    cases = [
        (FormatSpec(Kind.INT, num_bits=8), torch.tensor(3.0)),
        (FormatSpec(Kind.INT, num_bits=8), x.float().abs().amax(1, keepdim=True).nan_to_num(1.0)),
        (FormatSpec(Kind.FP8, element=(4, 3)), x.float().abs().amax(0, keepdim=True)),
        (FormatSpec(Kind.FP8, element=(4, 3)), torch.tensor(100.0)),
        (FormatSpec(Kind.NVFP4, element=(2, 1), block=(16,)), torch.tensor(50.0)),
        (FormatSpec(Kind.FP8_BLOCK, element=(4, 3), block=(128,)), torch.full((512, 8), 7.0)),
        (FormatSpec(Kind.FP8_BLOCK, element=(4, 3), block=(128, 128)), torch.full((4, 8), 7.0)),
        (FormatSpec(Kind.INT, num_bits=4, block=(32,)), torch.full((512, 32), 2.0)),
    ]
    for spec, amax in cases:
        assert_same(fn(x.cuda(), spec, amax.cuda()), R.fake_quant(x, spec, amax), _id(spec))


@pytest.mark.parametrize("backend", ["triton", "cuda"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_casts(dtype, backend):
    if backend not in _backends():
        pytest.skip(f"backend {backend} not available")
    for i, shape in enumerate(SHAPES):
        x = gpu_input(shape, dtype, seed=10 + i)
        xc = x.cuda()
        for block in ((128,), (128, 128)):
            for pow2 in (False, True):
                if len(block) > len(shape):
                    continue
                assert_same_all(_impl("fp8_blockwise_cast", backend)(xc, block, 1e-10, pow2), R.fp8_blockwise_cast(x, block, 1e-10, pow2), f"fp8b {block} {shape}")
        for elem in ("e4m3", "e2m1"):
            for rd in (Rounding.RCEIL, Rounding.FLOOR):
                assert_same_all(_impl("mx_cast", backend)(xc, elem, 32, rd), R.mx_cast(x, elem, 32, rd), f"mx {elem} {shape}")
        for g in (None, torch.tensor(30.0)):
            assert_same_all(_impl("nvfp4_cast", backend)(xc, None if g is None else g.cuda()), R.nvfp4_cast(x, g), f"nvfp4 {shape}")
        assert_same(_impl("block_amax", backend)(xc, (32,)), R.block_amax(x, (32,)), "block_amax")


@pytest.mark.parametrize("backend", ["triton", "cuda"])
def test_nan_inf_blocks(backend):
    if backend not in _backends():
        pytest.skip(f"backend {backend} not available")
    x = gpu_input((256, 512), torch.bfloat16, seed=20)
    x[1, 40] = NAN
    x[200, 300] = -INF
    fn = _impl("fake_quant", backend)
    for spec in SPECS:
        assert_same(fn(x.cuda(), spec, None), R.fake_quant(x, spec, None), _id(spec))
    assert_same_all(_impl("nvfp4_cast", backend)(x.cuda(), None), R.nvfp4_cast(x, None), "nvfp4 NaN")


@pytest.mark.parametrize("backend", ["triton", "cuda"])
def test_non_contiguous_matches_contiguous(backend):
    if backend not in _backends():
        pytest.skip(f"backend {backend} not available")
    base = gpu_input((1024, 512), torch.bfloat16, seed=21)
    x = base.cuda().t()[::2]  # (256, 1024), strided
    xc = x.contiguous()
    for spec in SPECS:
        assert_same(_impl("fake_quant", backend)(x, spec, None), _impl("fake_quant", backend)(xc, spec, None).cpu(), _id(spec))
    assert_same_all(_impl("mx_cast", backend)(x, "e2m1", 32, Rounding.RCEIL), R.mx_cast(xc.cpu(), "e2m1", 32, Rounding.RCEIL))


def test_auto_backend_runs_every_op_on_cuda():
    from quantlib.kernels import ops

    x = gpu_input((64, 256), torch.float32, seed=22).cuda()
    for spec in SPECS + [FormatSpec(Kind.INT, num_bits=8)]:
        amax = None if spec.dynamic or spec.kind in (Kind.MX, Kind.NVFP4) else torch.tensor(2.0, device="cuda")
        assert_same(ops.fake_quant(x, spec, amax, backend="auto"), R.fake_quant(x.cpu(), spec, None if amax is None else amax.cpu()), _id(spec))
