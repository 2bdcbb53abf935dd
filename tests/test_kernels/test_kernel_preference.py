"""The typed kernel choice: :class:`KernelPreference` (or its name) everywhere ``backend=`` is taken, the ops
each backend declares, an explicit choice that cannot run an op refused by name, and AUTO's order."""

from __future__ import annotations

import importlib
import re

import pytest
import torch

import quantlib as ql
from quantlib import kernels
from quantlib.config import ConfigError, QuantizerAttributeConfig
from quantlib.formats import FormatSpec, Kind, Rounding
from quantlib.kernels import backends, reference_impl as R
from quantlib.kernels.backends import COVERS, KernelPreference, KernelUnavailable, resolve

CPU = torch.device("cpu")
X = torch.linspace(-3.0, 3.0, 4 * 64).reshape(4, 64)


@pytest.fixture
def fresh_auto():
    """AUTO's choices are cached per (device type, op): cleared around a test that fakes what is installed."""
    backends._auto.cache_clear()
    backends._SELECTED.clear()
    yield
    backends._auto.cache_clear()
    backends._SELECTED.clear()


@pytest.mark.parametrize("value", ["reference", KernelPreference.REFERENCE])
def test_a_name_and_a_preference_choose_the_same_kernels(value):
    spec = FormatSpec(kind=Kind.FP8, element=(4, 3))
    assert torch.equal(kernels.fake_quant(X, spec, torch.tensor(3.0), backend=value), R.fake_quant(X, spec, torch.tensor(3.0)))
    assert torch.equal(kernels.block_amax(X, (16,), backend=value), R.block_amax(X, (16,)))
    assert resolve(value, CPU) is KernelPreference.REFERENCE


@pytest.mark.parametrize("bad", ["gpu", "CUDA", "", 3, None, ["cuda"]])
def test_an_unknown_backend_is_a_config_error_naming_it(bad):
    with pytest.raises(ConfigError, match=re.escape(f"backend={bad!r}")):
        kernels.block_amax(X, (16,), backend=bad)
    if bad is not None:  # None is ModelOpt's default in a config
        with pytest.raises(ConfigError, match=re.escape(f"backend={bad!r}")):
            QuantizerAttributeConfig(backend=bad)


def test_a_config_keeps_the_name_of_its_preference():
    """Configs are saved in checkpoints and compared with ModelOpt's: the field stays a plain string."""
    attrs = QuantizerAttributeConfig(backend=KernelPreference.REFERENCE)
    assert attrs.backend == "reference" and type(attrs.backend) is str
    assert QuantizerAttributeConfig(backend=None).backend == "auto"
    assert ql.KernelPreference is KernelPreference


@pytest.mark.parametrize("pref", [KernelPreference.REFERENCE, KernelPreference.CPU, KernelPreference.CUDA, KernelPreference.TRITON])
def test_each_backend_registers_exactly_the_ops_it_declares(pref):
    if pref is KernelPreference.TRITON and importlib.util.find_spec("triton") is None:
        pytest.skip("the triton package is not installed")
    backends._load(pref)  # imports the backend's module (the cuda one imports on any machine)
    assert {op for op, b in backends._KERNELS if b is pref} == COVERS[pref]


def test_registering_an_op_the_backend_does_not_declare_raises():
    with pytest.raises(KernelUnavailable, match="'cuda' does not declare op 'fp8_cast'"):
        backends.register("fp8_cast", "cuda")


@pytest.mark.parametrize("op", ["fp8_cast", "block_amax"])
def test_an_explicit_cuda_choice_refuses_the_ops_it_has_no_kernel_for(op):
    """The CUDA extension has no fp8_cast and no block_amax: asked for explicitly, the op and the backend are
    named (it used to run Triton without a word); whatever the tensor's device."""
    if op == "fp8_cast":
        call = lambda b: kernels.fp8_cast(X, torch.tensor(1.0), backend=b)  # noqa: E731
    else:
        call = lambda b: kernels.block_amax(X, (16,), backend=b)  # noqa: E731
    for choice in ("cuda", KernelPreference.CUDA):
        with pytest.raises(KernelUnavailable, match=f"op '{op}' has no kernel in backend 'cuda'"):
            call(choice)


def test_auto_keeps_its_order_and_passes_over_a_backend_that_lacks_the_op(monkeypatch, fresh_auto):
    cuda = torch.device("cuda")
    monkeypatch.setattr(backends, "has_cuda_kernels", lambda: True)
    monkeypatch.setattr(backends, "triton_available", lambda: True)
    assert resolve("auto", cuda, "fake_quant") is KernelPreference.CUDA
    assert resolve("auto", cuda, "fp8_cast") is KernelPreference.TRITON
    assert resolve(KernelPreference.AUTO, cuda, "block_amax") is KernelPreference.TRITON
    backends._auto.cache_clear()
    monkeypatch.setattr(backends, "triton_available", lambda: False)
    assert resolve("auto", cuda, "fp8_cast") is KernelPreference.REFERENCE
    assert resolve("auto", cuda, "nvfp4_cast") is KernelPreference.CUDA


def test_auto_on_the_cpu(fresh_auto):
    expected = KernelPreference.CPU if backends.native_extension() is not None else KernelPreference.REFERENCE
    for op in backends.OPS:
        assert resolve("auto", CPU, op) is expected


@pytest.fixture
def cuda_kernels():
    """A GPU test of the CUDA kernels: skipped where quantlib._C is built without them."""
    if not backends.has_cuda_kernels():
        pytest.skip("quantlib._C is built without CUDA")


def on_a_gpu(test):
    """``test`` as a GPU test of the CUDA kernels: marked ``gpu``, skipped without a GPU or without the kernels."""
    test = pytest.mark.usefixtures("cuda_kernels")(test)
    return pytest.mark.gpu(pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")(test))


@on_a_gpu
def test_on_a_gpu_auto_runs_fp8_cast_and_block_amax_which_cuda_refuses():
    x, s = X.cuda(), torch.tensor(2.0)
    assert torch.equal(kernels.fp8_cast(x, s.cuda()).cpu().view(torch.uint8), R.fp8_cast(X, s, (4, 3)).view(torch.uint8))
    assert torch.equal(kernels.block_amax(x, (16,)).cpu(), R.block_amax(X, (16,)))
    with pytest.raises(KernelUnavailable, match="'fp8_cast'"):
        kernels.fp8_cast(x, s.cuda(), backend="cuda")


# --------------------------------------------------------------------------- what each backend covers, case by case

FP8_TENSOR = FormatSpec(kind=Kind.FP8, element=(4, 3))  # no CUDA kernel: its gap
FP8_BLOCK = FormatSpec(kind=Kind.FP8_BLOCK, element=(4, 3), block=(128,), dynamic=True)  # a CUDA kernel


def test_only_the_cuda_kernels_declare_a_gap():
    """Triton, the C++ CPU kernels and the reference take every case of the ops they cover."""
    for pref in (KernelPreference.REFERENCE, KernelPreference.CPU, KernelPreference.CUDA):
        backends._load(pref)
    gaps = {(op, b) for (op, b), (_, gap) in backends._KERNELS.items() if gap is not None}
    assert gaps == {(op, KernelPreference.CUDA) for op in COVERS[KernelPreference.CUDA]}
    assert backends.uncovered("fp8_cast", "cuda") == "every case"
    assert backends.uncovered("fake_quant", "reference", X, FP8_TENSOR, torch.tensor(3.0)) is None


@pytest.fixture
def fake_cuda(monkeypatch, fresh_auto):
    """A machine with the CUDA kernels and Triton, faked on the CPU: the CUDA backend's real case declarations
    (shapes alone), with its kernel and Triton's replaced by recorders of who ran."""
    from types import SimpleNamespace

    from quantlib.kernels import cuda_impl

    ran = []
    monkeypatch.setattr(cuda_impl, "_vector_ok", lambda x: x.dim() >= 1 and x.numel() > 0 and x.shape[-1] % (16 // x.element_size()) == 0)
    ext = SimpleNamespace(cuda_int_row_max_vectors=2048, cuda_fp8_blockwise_cast_static=None)
    monkeypatch.setattr(cuda_impl, "_ext", lambda: ext)
    monkeypatch.setattr(backends, "has_cuda_kernels", lambda: True)
    monkeypatch.setattr(backends, "triton_available", lambda: True)
    monkeypatch.setattr(backends, "_auto_order", lambda device_type: [KernelPreference.CUDA, KernelPreference.TRITON,
                                                                      KernelPreference.REFERENCE])
    backends._load(KernelPreference.CUDA)
    monkeypatch.setattr(backends, "_load", lambda pref: None)  # a backend imported later would register over the recorders
    for op in COVERS[KernelPreference.CUDA]:
        _, cuda_gap = backends._kernel(op, KernelPreference.CUDA)
        for pref, gap in ((KernelPreference.CUDA, cuda_gap), (KernelPreference.TRITON, None)):
            monkeypatch.setitem(backends._KERNELS, (op, pref), (lambda *a, p=pref: ran.append(p.value) or p.value, gap))
    return ran


def test_auto_picks_per_case_the_first_backend_whose_kernel_takes_it(fake_cuda):
    auto = backends.select("fake_quant", "auto", torch.device("cuda"))
    assert auto(X, FP8_BLOCK, None) == "cuda"
    assert auto(X, FP8_TENSOR, torch.tensor(3.0)) == "triton"  # the CUDA kernels have no FP8 per tensor
    assert auto(X[:, :62], FP8_BLOCK, None) == "triton"  # a last dim that is no whole number of 16-byte vectors
    assert fake_cuda == ["cuda", "triton", "triton"]


def test_an_explicit_cuda_choice_refuses_a_case_it_has_no_kernel_for(fake_cuda):
    """Named: the op, the case and the backend; nothing runs (it used to run Triton without a word)."""
    cuda = backends.select("fake_quant", KernelPreference.CUDA, torch.device("cuda"))
    assert cuda(X, FP8_BLOCK, None) == "cuda"
    with pytest.raises(KernelUnavailable, match=r"op 'fake_quant': kind 'fp8' \(block None, element \(4, 3\), shape \(4, 64\), "
                                                r"float32 on cpu\) has no kernel in backend 'cuda' \(asked for explicitly\)"):
        cuda(X, FP8_TENSOR, torch.tensor(3.0))
    with pytest.raises(KernelUnavailable, match="kind 'fp8_block' .*shape \\(4, 62\\).* backend 'cuda'"):
        cuda(X[:, :62], FP8_BLOCK, None)
    assert fake_cuda == ["cuda"]
    assert backends.select("fake_quant", "triton", torch.device("cuda"))(X, FP8_TENSOR, torch.tensor(3.0)) == "triton"


@pytest.mark.parametrize("spec, amax, covered", [
    (FormatSpec(kind=Kind.INT, num_bits=8, dynamic=True), None, True),  # the per-row INT kernel
    (FormatSpec(kind=Kind.INT, num_bits=8), torch.ones(4, 1), True),  # a static amax per row
    (FormatSpec(kind=Kind.INT, num_bits=8), torch.tensor(3.0), False),  # per tensor
    (FormatSpec(kind=Kind.INT, num_bits=4, block=(32,), dynamic=True), None, True),
    (FormatSpec(kind=Kind.INT, num_bits=4, block=(8,), dynamic=True), None, False),  # a block size it lacks
    (FormatSpec(kind=Kind.FP8_BLOCK, element=(5, 2), block=(128,), dynamic=True), None, False),  # E5M2 blockwise
    (FormatSpec(kind=Kind.NVFP4, element=(2, 1), block=(16,)), torch.ones(4, 1), False),  # a global amax per row
])
def test_the_cuda_gap_of_fake_quant(fake_cuda, spec, amax, covered):
    x = torch.zeros(4, 128)
    assert (backends.uncovered("fake_quant", "cuda", x, spec, amax) is None) is covered
    assert backends.select("fake_quant", "auto", torch.device("cuda"))(x, spec, amax) == ("cuda" if covered else "triton")


@on_a_gpu
def test_on_a_gpu_an_explicit_cuda_choice_refuses_fp8_per_tensor_which_auto_runs():
    x, a = X.cuda(), torch.tensor(2.0)
    assert torch.equal(kernels.fake_quant(x, FP8_TENSOR, a.cuda()).cpu(), R.fake_quant(X, FP8_TENSOR, a))
    assert torch.equal(kernels.fake_quant(x, FP8_BLOCK, None, backend="cuda").cpu(), R.fake_quant(X, FP8_BLOCK, None))
    with pytest.raises(KernelUnavailable, match="op 'fake_quant': kind 'fp8' .* backend 'cuda'"):
        kernels.fake_quant(x, FP8_TENSOR, a.cuda(), backend="cuda")
    with pytest.raises(KernelUnavailable, match="op 'mx_cast': element e3m2, .* backend 'cuda'"):
        kernels.mx_cast(x, "e3m2", backend="cuda")


def test_an_explicit_cuda_choice_names_a_missing_amax_not_a_gap(fake_cuda):
    """A static INT format without an amax is a misuse, not a case the kernels lack: the CUDA kernel raises the
    reference's error, as every other backend does."""
    from quantlib.kernels import cuda_impl

    spec = FormatSpec(kind=Kind.INT, num_bits=8)
    assert backends.uncovered("fake_quant", "cuda", X, spec, None) is None
    with pytest.raises(ValueError, match="static scale needs an amax"):
        cuda_impl.fake_quant(X, spec, None)
    with pytest.raises(ValueError, match="static scale needs an amax"):
        R.fake_quant(X, spec, None)


# --------------------------------------------------------------------------- every case the CUDA kernels lack, one by one

INT8, INT8_ROWS = FormatSpec(kind=Kind.INT, num_bits=8), FormatSpec(kind=Kind.INT, num_bits=8, dynamic=True)
NVFP4_16, NVFP4_32 = FormatSpec(kind=Kind.NVFP4, element=(2, 1), block=(16,)), FormatSpec(kind=Kind.NVFP4, element=(2, 1), block=(32,))
Z = torch.zeros(4, 128)


def _fp8_block(element=(4, 3), block=(128,)):
    return FormatSpec(kind=Kind.FP8_BLOCK, element=element, block=block, dynamic=True)


#: (op, arguments, a piece of the case's words) for each case an op's CUDA kernel does not take
CUDA_GAPS = {
    "fp8 per tensor": ("fake_quant", (Z, FP8_TENSOR, torch.tensor(3.0)), "kind 'fp8'"),
    "fp8 per row": ("fake_quant", (Z, FP8_TENSOR, torch.ones(4, 1)), "kind 'fp8'"),
    "fp8 per token": ("fake_quant", (Z, FormatSpec(kind=Kind.FP8, element=(4, 3), dynamic=True), None), "kind 'fp8'"),
    "int per tensor": ("fake_quant", (Z, INT8, torch.tensor(3.0)), "kind 'int'"),
    "int per column": ("fake_quant", (Z, INT8, torch.ones(1, 128)), "kind 'int'"),
    "int rows too long": ("fake_quant", (torch.zeros(2, 8196), INT8_ROWS, None), "shape (2, 8196)"),
    "int block 8": ("fake_quant", (Z, FormatSpec(kind=Kind.INT, num_bits=4, block=(8,), dynamic=True), None), "block (8,)"),
    "fp8 block e5m2": ("fake_quant", (Z, _fp8_block((5, 2)), None), "element (5, 2)"),
    "fp8 block 64": ("fake_quant", (Z, _fp8_block(block=(64,)), None), "block (64,)"),
    "fp8 block 2-d on 1-d": ("fake_quant", (torch.zeros(256), _fp8_block(block=(128, 128)), None), "shape (256,)"),
    "mxfp6": ("fake_quant", (Z, FormatSpec(kind=Kind.MX, element=(3, 2), block=(32,)), None), "kind 'mx'"),
    "nvfp4 block 32": ("fake_quant", (Z, NVFP4_32, torch.tensor(3.0)), "block (32,)"),
    "nvfp4 static blocks": ("fake_quant", (Z, NVFP4_16, torch.tensor(3.0), torch.ones(4, 8)), "static block amax"),
    "nvfp4 global per row": ("fake_quant", (Z, NVFP4_16, torch.ones(4, 1)), "a global amax per row"),
    "last dim of part vectors": ("fake_quant", (Z[:, :62], _fp8_block(), None), "shape (4, 62)"),
    "bf16 last dim of part vectors": ("fake_quant", (torch.zeros(4, 12, dtype=torch.bfloat16), _fp8_block(), None), "bfloat16"),
    "empty": ("fake_quant", (torch.zeros(0, 128), _fp8_block(), None), "shape (0, 128)"),
    "0-dim": ("fake_quant", (torch.tensor(1.0), INT8_ROWS, None), "shape ()"),
    "cast block 64": ("fp8_blockwise_cast", (Z, (64,), 1e-10, False), "block (64,)"),
    "cast 2-d block on 1-d": ("fp8_blockwise_cast", (torch.zeros(256), (128, 128), 1e-10, False), "shape (256,)"),
    "cast part vectors": ("fp8_blockwise_cast", (Z[:, :62], (128,), 1e-10, False), "shape (4, 62)"),
    "cast empty": ("fp8_blockwise_cast", (torch.zeros(0, 128), (128,), 1e-10, False, torch.ones(0, 1)), "static block"),
    "mx cast e3m2": ("mx_cast", (Z, "e3m2", 32, Rounding.RCEIL), "element e3m2"),
    "mx cast e2m3": ("mx_cast", (Z, "e2m3", 32, Rounding.RCEIL), "element e2m3"),
    "mx cast int8": ("mx_cast", (Z, "int8", 32, Rounding.RCEIL), "element int8"),
    "mx cast block 16": ("mx_cast", (Z, "e4m3", 16, Rounding.RCEIL), "block 16"),
    "mx cast part vectors": ("mx_cast", (torch.zeros(4, 12, dtype=torch.bfloat16), "e4m3", 32, Rounding.RCEIL), "shape (4, 12)"),
    "nvfp4 cast block 32": ("nvfp4_cast", (Z, torch.tensor(3.0), 32), "block 32"),
    "nvfp4 cast static blocks": ("nvfp4_cast", (Z, torch.tensor(3.0), 16, torch.ones(4, 8)), "static blocks True"),
    "nvfp4 cast global per row": ("nvfp4_cast", (Z, torch.ones(4, 1), 16), "global amax per row True"),
    "nvfp4 cast part vectors": ("nvfp4_cast", (Z[:, :62], torch.tensor(3.0), 16), "shape (4, 62)"),
}

#: one case of each op that the CUDA kernels take
CUDA_CASES = {
    "fake_quant": (Z, _fp8_block(), None),
    "fp8_blockwise_cast": (Z, (128, 128), 1e-10, False, torch.ones(1, 1)),
    "mx_cast": (Z, "e2m1", 32, Rounding.FLOOR),
    "nvfp4_cast": (Z, torch.tensor(3.0), 16),
}


@pytest.mark.parametrize("case", list(CUDA_GAPS))
def test_an_explicit_cuda_choice_refuses_every_case_its_kernels_lack(fake_cuda, case):
    """backend='cuda' runs no other backend's kernel for any case of the ops it covers: each one is refused naming
    the op, the case and the backend, nothing runs; AUTO gives it to Triton."""
    op, args, words = CUDA_GAPS[case]
    cuda = torch.device("cuda")
    assert words in backends.uncovered(op, "cuda", *args)
    for explicit in (backends.select(op, "cuda", cuda), backends.implementation(op, KernelPreference.CUDA)):
        with pytest.raises(KernelUnavailable, match=rf"op '{op}': .*{re.escape(words)}.* has no kernel in backend 'cuda' \(asked for"):
            explicit(*args)
    assert fake_cuda == []
    assert backends.select(op, "auto", cuda)(*args) == "triton"


@pytest.mark.parametrize("op", sorted(CUDA_CASES))
def test_an_explicit_cuda_choice_runs_the_cases_its_kernels_take(fake_cuda, op):
    assert backends.uncovered(op, "cuda", *CUDA_CASES[op]) is None
    assert backends.select(op, "cuda", torch.device("cuda"))(*CUDA_CASES[op]) == "cuda"
    assert backends.select(op, "auto", torch.device("cuda"))(*CUDA_CASES[op]) == "cuda"


def test_an_extension_without_the_static_fp8_cast_refuses_it(fake_cuda, monkeypatch):
    """A quantlib._C built before the static FP8 blockwise cast existed: that case is a gap of its own."""
    from types import SimpleNamespace

    from quantlib.kernels import cuda_impl

    monkeypatch.setattr(cuda_impl, "_ext", lambda: SimpleNamespace(cuda_int_row_max_vectors=2048))
    args = CUDA_CASES["fp8_blockwise_cast"]
    with pytest.raises(KernelUnavailable, match=r"op 'fp8_blockwise_cast': static block \(128, 128\).* backend 'cuda'"):
        backends.select("fp8_blockwise_cast", "cuda", torch.device("cuda"))(*args)
    assert backends.select("fp8_blockwise_cast", "cuda", torch.device("cuda"))(*args[:4]) == "cuda"

