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
from quantlib.formats import FormatSpec, Kind
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
    assert {op for op, b in backends._IMPLS if b is pref} == COVERS[pref]


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


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_on_a_gpu_auto_runs_fp8_cast_and_block_amax_which_cuda_refuses():
    if not backends.has_cuda_kernels():
        pytest.skip("quantlib._C is built without CUDA")
    x, s = X.cuda(), torch.tensor(2.0)
    assert torch.equal(kernels.fp8_cast(x, s.cuda()).cpu().view(torch.uint8), R.fp8_cast(X, s, (4, 3)).view(torch.uint8))
    assert torch.equal(kernels.block_amax(x, (16,)).cpu(), R.block_amax(X, (16,)))
    with pytest.raises(KernelUnavailable, match="'fp8_cast'"):
        kernels.fp8_cast(x, s.cuda(), backend="cuda")
