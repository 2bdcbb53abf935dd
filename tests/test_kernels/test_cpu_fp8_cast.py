"""The C++ CPU ``fp8_cast`` (FP8 codes of a per-tensor or per-row quantization scale, what the FP8 export
and the RL weight sync pack with) bit for bit against the reference formula ``formats.fp8.fp8_codes``.

16-bit inputs with one scale go through a table of the code of every input value once the call holds
at least 4 x 65536 elements; both that path and the arithmetic one are checked on every bf16 and fp16
bit pattern (NaN, Inf, subnormals), with scales that saturate, underflow to subnormals, are 0, Inf or NaN,
in E4M3 and E5M2, on each compiled instruction set.
"""

from __future__ import annotations

import pytest
import torch

C = pytest.importorskip("quantlib._C", reason="the C++ extension quantlib._C is not built")

from quantlib import kernels  # noqa: E402
from quantlib.formats.fp8 import fp8_codes  # noqa: E402
from quantlib.kernels import cpu_impl as CPU  # noqa: E402

from ._compare import assert_same  # noqa: E402

pytestmark = pytest.mark.skipif(not hasattr(C, "cpu_fp8_cast"), reason="quantlib._C was built before its fp8_cast kernel")

ISAS = tuple(C.cpu_available_isas())
TABLE_MIN = 4 << 16  # elements from which one scale and 16-bit inputs take the table
SCALES = (1.0, 448.0 / 3.5, 2.0**-20, 3e30, 0.0, float("inf"), float("nan"), -2.5)


@pytest.fixture(params=ISAS)
def isa(request):
    C.cpu_set_isa(request.param)
    yield request.param
    C.cpu_set_isa(ISAS[0])


def every_value(dtype: torch.dtype, repeat: int) -> torch.Tensor:
    """Every bit pattern of a 16-bit float, ``repeat`` times, as rows of 1024."""
    x = torch.arange(-32768, 32768, dtype=torch.int32).to(torch.int16).view(dtype)
    return x.repeat(repeat).reshape(-1, 1024)


@pytest.mark.parametrize("element", [(4, 3), (5, 2)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("repeat", [1, 4], ids=["arithmetic", "table"])
def test_every_16_bit_value_with_one_scale(dtype, element, repeat, isa):
    x = every_value(dtype, repeat)
    assert (x.numel() >= TABLE_MIN) == (repeat == 4)
    for s in SCALES:
        scale = torch.tensor(s)
        assert_same(CPU.fp8_cast(x, scale, element), fp8_codes(x, scale, element), f"{dtype} {element} scale {s} {isa}")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_a_scale_per_row(dtype, isa):
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(96, 130, generator=g) * torch.logspace(-12, 6, 96).unsqueeze(1)).to(dtype)
    x[3, 7], x[5, 1], x[8, 2] = float("nan"), float("inf"), -float("inf")
    scale = 448.0 / x.float().abs().amax(1, keepdim=True).clamp(min=1e-30)
    scale[0], scale[1], scale[2] = 0.0, float("nan"), float("inf")
    for element in ((4, 3), (5, 2)):
        assert_same(CPU.fp8_cast(x, scale, element), fp8_codes(x, scale, element), f"{dtype} {element} {isa}")


def test_fp32_input_with_one_scale_is_not_tabled(isa):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(512, 1024, generator=g) * 100
    for s in (1.0, 2.0**-14, 7.3):
        scale = torch.tensor(s)
        assert_same(CPU.fp8_cast(x, scale, (4, 3)), fp8_codes(x, scale, (4, 3)), f"fp32 scale {s} {isa}")


def test_shapes_layouts_and_threads():
    x = every_value(torch.bfloat16, 8)  # 2^19 elements: table per thread chunk
    scale = torch.tensor(3.0)
    ref = fp8_codes(x, scale, (4, 3))
    threads = torch.get_num_threads()
    try:
        for n in (1, 2, 3):
            torch.set_num_threads(n)
            assert_same(CPU.fp8_cast(x, scale, (4, 3)), ref, f"{n} threads")
    finally:
        torch.set_num_threads(threads)
    t = x[:, :512].t()  # non-contiguous
    assert_same(CPU.fp8_cast(t, scale, (4, 3)), fp8_codes(t.contiguous(), scale, (4, 3)), "transposed")
    stack = x.reshape(8, -1, 1024)  # stacked experts with a scale per (expert, row)
    rows = torch.rand(8, stack.shape[1], 1, generator=torch.Generator().manual_seed(2)) * 100
    assert_same(CPU.fp8_cast(stack, rows, (4, 3)), fp8_codes(stack, rows, (4, 3)), "3-D, per row")
    for shape in ((), (0, 16), (5,)):
        y = torch.full(shape, 1.5, dtype=torch.bfloat16)
        assert_same(CPU.fp8_cast(y, scale, (4, 3)), fp8_codes(y, scale, (4, 3)), f"shape {shape}")


def test_the_op_runs_the_kernel_and_checks_the_scale():
    x = torch.randn(4, 8)
    with pytest.raises(ValueError, match="one per row"):
        C.cpu_fp8_cast(x, torch.ones(3), [4, 3])
    with pytest.raises(ValueError, match=r"\(4, 3\) or \(5, 2\)"):
        C.cpu_fp8_cast(x, torch.ones(()), [3, 4])
    got = kernels.fp8_cast(x, torch.tensor(2.0), backend="cpu")
    assert_same(got, C.cpu_fp8_cast(x, torch.tensor(2.0), [4, 3]), "kernels.fp8_cast on the cpu backend")


def test_an_extension_without_the_kernel_takes_the_reference_formula(monkeypatch):
    class Old:  # a quantlib._C built before cpu_fp8_cast
        pass

    monkeypatch.setattr(CPU, "_ext", lambda: Old())
    x, scale = every_value(torch.bfloat16, 1), torch.tensor(0.75)
    assert_same(CPU.fp8_cast(x, scale, (4, 3)), fp8_codes(x, scale, (4, 3)), "fallback")
