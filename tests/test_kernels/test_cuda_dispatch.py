"""Which cases the "cuda" backend declares its kernels take, decided from shapes alone (the
GPU tests check the kernels; this runs everywhere)."""

from __future__ import annotations

import pytest

from quantlib.kernels.cuda_impl import is_per_row_amax


@pytest.mark.parametrize(
    "x_shape, amax_shape, per_row",
    [
        ((512, 1024), (512, 1), True),
        ((3, 5, 1024), (3, 5, 1), True),
        ((3, 5, 1024), (1, 3, 5, 1), False),  # more dims than x
        ((1, 5, 1024), (5, 1), True),  # a leading one left out
        ((3, 5, 1024), (5, 1), False),  # broadcast over the batch: not one value a row
        ((512, 1024), (1, 1024), False),  # per column
        ((512, 1024), (), False),  # per tensor
        ((1024,), (), True),  # a 1-D input is one row: per tensor is per row
        ((1024,), (1,), True),
        ((512, 1024), (512,), False),  # not keepdim: would broadcast along the last dim
        ((), (), False),
    ],
)
def test_per_row_amax_shapes(x_shape, amax_shape, per_row):
    assert is_per_row_amax(x_shape, amax_shape) is per_row
