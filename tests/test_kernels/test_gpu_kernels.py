"""Compiled Triton and CUDA kernels on a GPU, bit for bit against the torch reference.

The reference runs on a CPU copy of the input: it is the canonical one (torch's CUDA division by a
Python number is a multiplication by its reciprocal, so the reference itself is not device-independent
where it divides a tensor by a constant). Shapes are large (several waves of the GPU, autotuned
configs) and odd (partial blocks, rank 3, rows that are not a multiple of anything).
"""

from __future__ import annotations

import pytest
import torch

from quantlib.formats import FormatSpec, Kind, Rounding
from quantlib.kernels import reference_impl as R

from ._compare import assert_same, assert_same_all, e2m1_probe  # noqa: E402,F401

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

    fn = implementation(op, backend)
    return _cuda_or_auto(op, fn) if backend == "cuda" else fn


def _cuda_or_auto(op: str, cuda_fn):
    """The cuda kernel for the cases the backend declares; for the others, the explicit choice refused by op and
    backend, and AUTO's result (the next backend's, Triton's) returned to be checked instead."""
    from quantlib.kernels.backends import KernelUnavailable, select, uncovered

    auto = select(op, "auto", torch.device("cuda"))

    def run(*args):
        if uncovered(op, "cuda", *args) is None:
            return cuda_fn(*args)
        with pytest.raises(KernelUnavailable, match=f"op '{op}': .* has no kernel in backend 'cuda'"):
            cuda_fn(*args)
        return auto(*args)

    return run


def _available_impl(op: str, backend: str):
    """``op`` of ``backend``; skips the test where that backend is not built or installed."""
    if backend not in _backends():
        pytest.skip(f"backend {backend} not available")
    return _impl(op, backend)


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
    FormatSpec(Kind.MX, element=(3, 2), block=(32,)),  # MXFP6 and MXINT8: a gap of the cuda backend (AUTO runs Triton)
    FormatSpec(Kind.MX, element=(2, 3), block=(32,), rounding=Rounding.FLOOR),
    FormatSpec(Kind.MX, num_bits=8, block=(32,)),
    FormatSpec(Kind.NVFP4, element=(2, 1), block=(16,)),
]


def _id(spec):
    bits = spec.num_bits if spec.kind == Kind.INT else spec.element
    rounding = Rounding(spec.rounding).value if spec.kind == Kind.MX else ''
    return f"{spec.kind.value}-{bits}-{spec.block}-{'pow2' if spec.pow2 else ''}{rounding}"


@pytest.mark.parametrize("backend", ["triton", "cuda"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("spec", SPECS, ids=_id)
def test_fake_quant(spec, dtype, backend):
    fn = _available_impl("fake_quant", backend)
    for i, shape in enumerate(SHAPES):
        if spec.block and len(spec.block) > len(shape):
            continue
        x = gpu_input(shape, dtype, seed=i)
        assert_same(fn(x.cuda(), spec, None), R.fake_quant(x, spec, None), f"{_id(spec)} {shape}")


@pytest.mark.parametrize("backend", ["triton", "cuda"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_e2m1_rounding_of_every_bf16_value(dtype, backend):
    """MXFP4 and NVFP4 (cast and fake quant) of every bf16 magnitude up to 6, in each input dtype."""
    fq = _available_impl("fake_quant", backend)
    x = e2m1_probe().to(dtype)
    xc = x.cuda()
    assert_same_all(_impl("mx_cast", backend)(xc, "e2m1", 32, Rounding.RCEIL), R.mx_cast(x, "e2m1", 32, Rounding.RCEIL), "mx cast")
    g = torch.tensor(6.0 * 448)  # NVFP4 scales of 1 for the rows holding 6
    assert_same_all(_impl("nvfp4_cast", backend)(xc, g.cuda()), R.nvfp4_cast(x, g), "nvfp4 cast")
    for spec, amax in ((FormatSpec(Kind.MX, element=(2, 1), block=(32,)), None), (FormatSpec(Kind.NVFP4, element=(2, 1), block=(16,)), g)):
        assert_same(fq(xc, spec, None if amax is None else amax.cuda()), R.fake_quant(x, spec, amax), _id(spec))


@pytest.mark.parametrize("backend", ["triton", "cuda"])
def test_fake_quant_static(backend):
    fn = _available_impl("fake_quant", backend)
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
def test_int_per_row(dtype, backend):
    """INT with one group a row, static (per channel) and dynamic, over row lengths that take each of
    the CUDA row kernel's layouts (several rows a CTA; 1, 2, 4, 8 vectors a thread) and one too long for
    it; rows with a NaN or an Inf, and a rank-3 input with a keepdim amax."""
    fn = _available_impl("fake_quant", backend)
    cols = (8, 200, 2048, 2056, 7168, 8192, 16384, 16392)
    for i, c in enumerate(cols):
        if dtype == torch.float32 and c > 8192:
            c //= 2
        x = gpu_input((37, c), dtype, seed=40 + i)
        x[3, c // 2] = NAN
        x[5, 1] = INF
        for bits in (8, 4):
            dyn = FormatSpec(Kind.INT, num_bits=bits, dynamic=True)
            assert_same(fn(x.cuda(), dyn, None), R.fake_quant(x, dyn, None), f"dynamic {c}")
            st = FormatSpec(Kind.INT, num_bits=bits)
            amax = x.float().abs().amax(1, keepdim=True).nan_to_num(2.0) * 0.75
            assert_same(fn(x.cuda(), st, amax.cuda()), R.fake_quant(x, st, amax), f"static {c}")
    x = gpu_input((3, 5, 1024), dtype, seed=49)
    amax = x.float().abs().amax(-1, keepdim=True)
    st = FormatSpec(Kind.INT, num_bits=8)
    assert_same(fn(x.cuda(), st, amax.cuda()), R.fake_quant(x, st, amax), "rank 3")
    assert_same(fn(x.cuda(), st, amax[0].cuda()), R.fake_quant(x, st, amax[0]), "amax broadcast over the batch")


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
                assert_same_all(_impl("fp8_blockwise_cast", backend)(xc, block, 1e-10, pow2), R.fp8_blockwise_cast(x, block, 1e-10, pow2),
                                f"fp8b {block} {shape}")
                static = R.block_amax(x, block) * 1.5  # a stored amax (export): not the block's own
                assert_same_all(_impl("fp8_blockwise_cast", backend)(xc, block, 1e-10, pow2, static.cuda()),
                                R.fp8_blockwise_cast(x, block, 1e-10, pow2, static), f"static fp8b {block} {shape}")
        for elem in ("e4m3", "e2m1", "e3m2", "e2m3", "int8"):
            for rd in (Rounding.RCEIL, Rounding.FLOOR):
                assert_same_all(_impl("mx_cast", backend)(xc, elem, 32, rd), R.mx_cast(x, elem, 32, rd), f"mx {elem} {shape}")
        for g in (None, torch.tensor(30.0)):
            assert_same_all(_impl("nvfp4_cast", backend)(xc, None if g is None else g.cuda()), R.nvfp4_cast(x, g), f"nvfp4 {shape}")
        if backend == "cuda":  # no CUDA kernel for block_amax and fp8_cast: an explicit choice refuses them
            continue
        assert_same(_impl("block_amax", backend)(xc, (32,)), R.block_amax(x, (32,)), "block_amax")
        for element in ((4, 3), (5, 2)):
            for s in (torch.tensor(448.0 / 7.0), 448.0 / x.float().abs().amax(dim=-1, keepdim=True).clamp_min(1e-3)):
                assert_same(_impl("fp8_cast", backend)(xc, s.cuda(), element), R.fp8_cast(x, s, element),
                            f"fp8_cast {element} {tuple(s.shape)} {shape}")


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
        assert_same(ops.fake_quant(x, spec, amax, backend="auto"), R.fake_quant(x.cpu(), spec, None if amax is None else amax.cpu()),
                    _id(spec))


def _division_kernel():
    import triton
    import triton.language as tl

    from quantlib.kernels.triton._numerics import div_exact

    @triton.jit
    def kernel(xs_ptr, NX, EXP, out_ptr, BLOCK: tl.constexpr):
        mant = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        b = ((EXP << 23) | mant).to(tl.float32, bitcast=True)
        y = tl.math.div_rn(1.0, b)
        bad = tl.zeros((BLOCK,), tl.int32)
        for i in range(0, NX):
            x = tl.load(xs_ptr + i)
            got = div_exact(x, b, y).to(tl.int32, bitcast=True)
            bad += (got != tl.math.div_rn(x, b).to(tl.int32, bitcast=True)).to(tl.int32)
        tl.atomic_add(out_ptr, tl.sum(bad, axis=0))

    return kernel


def test_division_is_exact_exhaustively():
    """div_exact == div_rn for every divisor mantissa, against every bf16 and fp16 dividend mantissa,
    every INT code, and 2^12 random fp32 mantissas (exponents only shift a normal quotient)."""
    if "triton" not in _backends():
        pytest.skip("needs Triton")
    g = torch.Generator().manual_seed(0)
    xs = torch.cat([
        1.0 + torch.arange(128) / 128.0,  # bf16 mantissas
        1.0 + torch.arange(1024) / 1024.0,  # fp16
        torch.arange(1.0, 256.0),  # INT codes
        (torch.randint(0, 1 << 23, (4096,), generator=g) | (127 << 23)).to(torch.int32).view(torch.float32),
    ]).float()
    xs = torch.cat([xs, -xs]).cuda()
    kernel = _division_kernel()
    for exp in (127, 127 - 60, 127 + 59):
        out = torch.zeros(1, dtype=torch.int32, device="cuda")
        kernel[((1 << 23) // 1024,)](xs, xs.numel(), exp, out, BLOCK=1024, enable_fp_fusion=False)
        assert out.item() == 0, f"{out.item()} quotients differ at divisor exponent {exp - 127}"


@pytest.mark.parametrize("backend", ["triton", "cuda"])
def test_divisors_outside_the_fast_range(backend):
    """Scales below 2^-60 or above 2^60 take the per-element division (the tile's or block's other path)."""
    fn = _available_impl("fake_quant", backend)
    x = gpu_input((256, 512), torch.float32, seed=23)
    x[:8] *= 1e25  # INT scale 127 / amax < 2^-60
    x[8:16] *= 2.0**-110  # FP8 block scale with the smallest eps below 2^-60
    for spec in (FormatSpec(Kind.INT, num_bits=8, dynamic=True), FormatSpec(Kind.INT, num_bits=4, block=(128,), dynamic=True),
                 FormatSpec(Kind.FP8_BLOCK, element=(4, 3), block=(128,), dynamic=True, eps=2.0**-110),
                 FormatSpec(Kind.FP8_BLOCK, element=(4, 3), block=(128, 128), dynamic=True, eps=2.0**-110),
                 FormatSpec(Kind.NVFP4, element=(2, 1), block=(16,))):
        assert_same(fn(x.cuda(), spec, None), R.fake_quant(x, spec, None), _id(spec))
    amax = x.abs().amax(1, keepdim=True)
    assert_same(fn(x.cuda(), FormatSpec(Kind.INT, num_bits=8), amax.cuda()), R.fake_quant(x, FormatSpec(Kind.INT, num_bits=8), amax),
                "static per-row")
    assert_same_all(_impl("nvfp4_cast", backend)(x.cuda(), torch.tensor(1e30).cuda()), R.nvfp4_cast(x, torch.tensor(1e30)),
                    "nvfp4 huge global")


@pytest.mark.parametrize("backend", ["triton", "cuda"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_nvfp4_global_amax_per_expert(backend, dtype):
    """Stacked expert weights (E, out, in) with one global amax per expert ((E, 1, 1), a gap of the cuda
    backend: AUTO runs Triton) and one per row: fake quant and cast equal the reference (= a call per expert)."""
    fq = _available_impl("fake_quant", backend)
    x = gpu_input((64, 96, 1024), dtype, seed=21)
    x[3] = 0
    spec = FormatSpec(Kind.NVFP4, element=(2, 1), block=(16,), dynamic=True)
    per_expert = x.float().abs().amax(dim=(1, 2), keepdim=True) * torch.linspace(0.5, 1.5, 64).reshape(-1, 1, 1)
    for g in (per_expert, x.float().abs().amax(dim=-1, keepdim=True)):
        assert_same(fq(x.cuda(), spec, g.cuda()), R.fake_quant(x, spec, g), f"fake {tuple(g.shape)}")
        assert_same_all(_impl("nvfp4_cast", backend)(x.cuda(), g.cuda()), R.nvfp4_cast(x, g), f"cast {tuple(g.shape)}")
