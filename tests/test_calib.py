"""Max calibration's amax: exactly max |x| (sign of zero included, NaN propagating) on every path."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings, strategies as st

from quantlib.nn.max_collector import abs_max

VALUES = st.one_of(st.floats(width=32, allow_nan=False), st.sampled_from([0.0, -0.0, float("inf"), float("-inf")]))


def _expected(x: torch.Tensor, dims) -> torch.Tensor:
    a = x.float().abs()
    return a.amax() if dims is None else a.amax(dim=dims, keepdim=True)


def _same(got: torch.Tensor, ref: torch.Tensor) -> None:
    assert got.dtype == torch.float32 and got.shape == ref.shape
    assert torch.equal(got.isnan(), ref.isnan())
    keep = ~ref.isnan()
    assert torch.equal(got[keep].view(torch.int32), ref[keep].view(torch.int32))  # bits: +0.0, never -0.0


DEVICES = ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(),
                                                                                  reason="needs a CUDA GPU")])]


@pytest.mark.parametrize("device", DEVICES)
@settings(max_examples=200, deadline=None)
@given(st.lists(VALUES, min_size=6, max_size=6 * 8).filter(lambda v: len(v) % 6 == 0), st.sampled_from([None, (0,), (1,), (0, 1)]),
       st.sampled_from([torch.float32, torch.bfloat16]), st.booleans())  # fmt: skip
def test_abs_max_is_max_of_abs(device, values, dims, dtype, nan):
    x = torch.tensor(values).reshape(-1, 6).to(dtype).to(device)
    if nan:
        x[0, 0] = float("nan")
    _same(abs_max(x, dims), _expected(x, dims))


@pytest.mark.parametrize("device", DEVICES)
def test_all_negative_zeros_give_positive_zero(device):
    x = torch.full((3, 4), -0.0, device=device)
    for dims in (None, (1,)):
        assert not torch.signbit(abs_max(x, dims)).any()


def test_empty_raises_like_the_inf_norm():
    with pytest.raises(RuntimeError, match="empty"):
        abs_max(torch.empty(0))
