"""Block views: shapes, zero padding of partial blocks, block amax, inverse layout."""

import pytest
import torch

from quantlib.formats.blocks import block_amax, blocked_shape, check_block, from_blocks, to_blocks

from ._helpers import INF, NAN, assert_same, non_contiguous, t32


def test_blocked_shape():
    assert blocked_shape((4, 64), (32,)) == (4, 2)
    assert blocked_shape((4, 65), (32,)) == (4, 3)
    assert blocked_shape((2, 3, 16), (16,)) == (2, 3, 1)
    assert blocked_shape((300, 129), (128, 128)) == (3, 2)
    assert blocked_shape((2, 5, 7), (2, 3)) == (2, 3, 3)
    assert blocked_shape(torch.Size([7]), (4,)) == (2,)


def test_partial_last_block_is_zero_padded():
    x = t32([[1.0, 2.0, 3.0, 4.0, 5.0, 6.0]])
    assert_same(to_blocks(x, (4,)), t32([[[1.0, 2.0, 3.0, 4.0], [5.0, 6.0, 0.0, 0.0]]]))
    assert_same(from_blocks(to_blocks(x, (4,)), (4,), x.shape), x)


def test_2d_block_layout_is_row_major_inside_the_block():
    x = torch.arange(1.0, 13.0).reshape(3, 4)  # 2x2 blocks: 2 x 2 grid, last row padded
    xb = to_blocks(x, (2, 2))
    assert xb.shape == (2, 2, 4)
    expected = t32([[[1, 2, 5, 6], [3, 4, 7, 8]], [[9, 10, 0, 0], [11, 12, 0, 0]]])
    assert_same(xb, expected)
    assert_same(from_blocks(xb, (2, 2), x.shape), x)


def test_partial_last_block_amax_over_real_elements():
    # the padding zeros never win: amax of [-3, -1] is 3; of an all-negative partial block too
    x = t32([[0.5, -0.25, 0.0, 0.125, -3.0, -1.0]])
    assert_same(block_amax(x, (4,)), t32([[0.5, 3.0]]))
    x2 = t32([[-1.0, -2.0, -7.0], [-0.5, -4.0, -9.0], [-6.0, -0.1, -0.2]])
    assert_same(block_amax(x2, (2, 2)), t32([[4.0, 9.0], [6.0, 0.2]]))


def test_all_zero_block():
    assert_same(block_amax(torch.zeros(2, 8), (4,)), torch.zeros(2, 2))
    assert_same(block_amax(-torch.zeros(3, 3), (2, 2)), torch.zeros(2, 2))


def test_nan_block():
    x = t32([[1.0, NAN, 2.0, 3.0, 5.0, 0.0, 0.0, 0.0]])
    assert_same(block_amax(x, (4,)), t32([[NAN, 5.0]]))
    x2 = torch.zeros(4, 4)
    x2[3, 0] = NAN
    assert_same(block_amax(x2, (2, 2)), t32([[0.0, 0.0], [NAN, 0.0]]))


def test_inf_block():
    assert_same(block_amax(t32([[1.0, -INF, 2.0, 3.0]]), (2,)), t32([[INF, 3.0]]))


def test_three_d_input():
    x = torch.zeros(2, 3, 5)
    x[1, 2, 4] = -6.0
    x[0, 1, 0] = 2.0
    expected = torch.zeros(2, 3, 2)
    expected[1, 2, 1], expected[0, 1, 0] = 6.0, 2.0
    assert_same(block_amax(x, (4,)), expected)
    expected2 = torch.zeros(2, 2, 2)
    expected2[1, 1, 1], expected2[0, 0, 0] = 6.0, 2.0
    assert_same(block_amax(x, (2, 4)), expected2)
    assert_same(from_blocks(to_blocks(x, (2, 4)), (2, 4), x.shape), x)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_amax_is_fp32(dtype):
    x = t32([[1.5, -2.5, 0.0, 0.0]]).to(dtype)
    assert_same(block_amax(x, (2,)), t32([[2.5, 0.0]]))


@pytest.mark.parametrize("block", [(4,), (2, 2), (3, 2)])
def test_non_contiguous_matches_contiguous(block):
    x = torch.randn(5, 7, generator=torch.Generator().manual_seed(5))
    assert_same(block_amax(non_contiguous(x), block), block_amax(x, block))
    xt = x.t()
    assert_same(block_amax(xt, block), block_amax(xt.contiguous(), block))
    assert_same(from_blocks(to_blocks(xt, block), block, xt.shape), xt.contiguous())


def test_check_block_errors():
    with pytest.raises(ValueError, match="positive"):
        check_block(torch.zeros(4), (0,))
    with pytest.raises(ValueError, match="positive"):
        check_block(torch.zeros(4, 4), (2, 2, 2))
    with pytest.raises(ValueError, match="rank >= 2"):
        check_block(torch.zeros(4), (2, 2))
