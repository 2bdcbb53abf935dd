"""FP8 blockwise (1xB / BxB): eps floor, pow2 scales, partial blocks, NaN / Inf blocks; hand-computed."""

import pytest
import torch

from quantlib.formats.fp8_blockwise import (
    blockwise_scale,
    fp8_blockwise_dequantize,
    fp8_blockwise_fake_quant,
    fp8_blockwise_quantize,
    pow2_ceil,
)

from ._helpers import INF, NAN, assert_bitwise, assert_same, f32, non_contiguous, t32

EPS_D = f32(f32(1e-10) / 448.0)  # the scale of an all-zero block with the default eps


def test_all_zero_block():
    codes, d = fp8_blockwise_quantize(torch.zeros(2, 8), (4,))
    assert_same(d, torch.full((2, 2), EPS_D))
    assert torch.isfinite(d).all() and (d > 0).all()
    assert_same(codes, torch.zeros(2, 8, dtype=torch.float8_e4m3fn))
    assert_same(fp8_blockwise_fake_quant(torch.zeros(2, 8), (4,)), torch.zeros(2, 8))
    _, d2 = fp8_blockwise_quantize(torch.zeros(3, 3), (2, 2))
    assert_same(d2, torch.full((2, 2), EPS_D))


def test_all_zero_block_with_pow2():
    # eps / 448 = 2.2e-13 -> 2^-42
    _, d = fp8_blockwise_quantize(torch.zeros(1, 4), (4,), pow2=True)
    assert_same(d, t32([[2.0**-42]]))


def test_eps_floor_below_eps():
    # block amax 1e-12 < eps: d = eps / 448; 1e-12 / d = 4.48 -> 4.5 (spacing 0.5)
    x = t32([[1e-12, 0.0, 0.0, 0.0]])
    codes, d = fp8_blockwise_quantize(x, (4,))
    assert_same(d, t32([[EPS_D]]))
    assert_same(codes.float(), t32([[4.5, 0.0, 0.0, 0.0]]))
    assert_bitwise(fp8_blockwise_fake_quant(x, (4,)), t32([[f32(4.5 * EPS_D), 0.0, 0.0, 0.0]]))


def test_custom_eps():
    _, d = fp8_blockwise_quantize(torch.zeros(1, 4), (4,), eps=448.0)
    assert_same(d, t32([[1.0]]))


def test_scale_is_amax_over_q():
    # amax 896 -> d = 2: 3 / 2 = 1.5 exact, 2.125 / 2 = 1.0625 ties to 1.0 -> 2.0
    x = t32([[896.0, 3.0, 2.125, -1.0], [1.0, 0.0, 0.0, 0.0]])
    codes, d = fp8_blockwise_quantize(x, (4,))
    assert_same(d, t32([[2.0], [f32(1 / 448)]]))
    assert_same(codes.float(), t32([[448.0, 1.5, 1.0, -0.5], [448.0, 0.0, 0.0, 0.0]]))
    assert_bitwise(fp8_blockwise_fake_quant(x, (4,)), t32([[896.0, 3.0, 2.0, -1.0], [f32(448 * f32(1 / 448)), 0.0, 0.0, 0.0]]))


def test_pow2_exact_powers_of_two_stay():
    amax = t32([448.0 * 2, 448.0, 448.0 * 2.0**-20, 448.0 * 2.0**100])
    assert_same(blockwise_scale(amax, (4, 3), 1e-10, True), t32([2.0, 1.0, 2.0**-20, 2.0**100]))


def test_pow2_others_round_up():
    # d = 3 -> 4 ; d = 1/448 -> 2^-8 ; d = (448 * 1.0000001) / 448 -> 2 ; d = 0.75 -> 1
    amax = t32([448.0 * 3, 1.0, 448.0 * (1 + 2.0**-22), 336.0])
    assert_same(blockwise_scale(amax, (4, 3), 1e-10, True), t32([4.0, 2.0**-8, 2.0, 1.0]))


def test_pow2_elements():
    # amax 1344 -> d = 3 -> 4: 1344 / 4 = 336 ties 320 | 352 -> 320 -> 1280 ; 5 / 4 = 1.25 exact
    x = t32([[1344.0, 5.0, -0.5, 0.0]])
    codes, d = fp8_blockwise_quantize(x, (4,), pow2=True)
    assert_same(d, t32([[4.0]]))
    assert_same(fp8_blockwise_fake_quant(x, (4,), pow2=True), t32([[1280.0, 5.0, -0.5, 0.0]]))


def test_pow2_subnormal_scale_is_exact():
    # with a tiny eps a subnormal d is rounded up to the next power of two, not to 2^-126
    d = t32([2.0**-130, 3 * 2.0**-140, 2.0**-149, 2.0**-126 - 2.0**-149, 0.0])
    assert_same(pow2_ceil(d), t32([2.0**-130, 2.0**-138, 2.0**-149, 2.0**-126, 2.0**-149]))
    amax = t32([448.0 * 2.0**-130])
    assert_same(blockwise_scale(amax, (4, 3), 1e-45, True), t32([2.0**-130]))


def test_pow2_keeps_nan_and_inf():
    assert_same(pow2_ceil(t32([NAN, INF, 1.5, 1.0])), t32([NAN, INF, 2.0, 1.0]))


def test_nan_block():
    x = t32([[1.0, NAN, 2.0, 3.0, 448.0, 1.0, 0.0, 0.0]])
    for pow2 in (False, True):
        codes, d = fp8_blockwise_quantize(x, (4,), pow2=pow2)
        assert_same(d, t32([[NAN, 1.0]]))
        assert_same(fp8_blockwise_fake_quant(x, (4,), pow2=pow2), t32([[NAN] * 4 + [448.0, 1.0, 0.0, 0.0]]))


def test_inf_block():
    x = t32([[1.0, -INF, 2.0, 3.0, 448.0, 1.0, 0.0, 0.0]])
    _, d = fp8_blockwise_quantize(x, (4,))
    assert_same(d, t32([[INF, 1.0]]))
    assert_same(fp8_blockwise_fake_quant(x, (4,)), t32([[NAN] * 4 + [448.0, 1.0, 0.0, 0.0]]))


def test_partial_last_block_1d():
    # 6 elements, blocks of 4: block 1 has 2 real elements, amax 224 -> d = 0.5
    x = t32([[448.0, 1.0, 0.0, 0.0, -224.0, 0.3]])
    codes, d = fp8_blockwise_quantize(x, (4,))
    assert codes.shape == (1, 6)
    assert_same(d, t32([[1.0, 0.5]]))
    # 0.3 / 0.5 = 0.6 -> 0.625 (spacing 2^-4 in [0.5, 1)) -> 0.3125
    assert_same(fp8_blockwise_fake_quant(x, (4,)), t32([[448.0, 1.0, 0.0, 0.0, -224.0, 0.3125]]))


def test_partial_last_block_2d():
    # 3x3 with 2x2 blocks: blocks (0,0) (0,1) (1,0) (1,1) hold 4, 2, 2, 1 real elements
    x = t32([[448.0, 1.0, 896.0], [2.0, -3.0, 1.0], [224.0, 100.0, -44.8]])
    codes, d = fp8_blockwise_quantize(x, (2, 2))
    assert codes.shape == (3, 3)
    assert_same(d, t32([[1.0, 2.0], [0.5, f32(f32(44.8) / 448.0)]]))
    out = fp8_blockwise_fake_quant(x, (2, 2))
    # (1,0): 100 / 0.5 = 200 ties 192 | 208 -> 192 -> 96; (0,1): 1 / 2 = 0.5 exact; (1,1): -448 * d
    assert_same(out[:2, :2], x[:2, :2])
    assert_same(out[:2, 2], t32([896.0, 1.0]))
    assert_same(out[2, :2], t32([224.0, 96.0]))
    assert_bitwise(out[2, 2:], t32([f32(-448.0 * d[1, 1].item())]))


def test_128_blocks_on_small_inputs():
    x = torch.zeros(3, 130)
    x[2, 129] = 7.0  # second 1x128 block of row 2: d = 7/448 = 2^-6
    codes, d = fp8_blockwise_quantize(x, (128,))
    expected_d = torch.full((3, 2), EPS_D)
    expected_d[2, 1] = 2.0**-6
    assert_same(d, expected_d)
    _, d2 = fp8_blockwise_quantize(x, (128, 128))
    assert_same(d2, t32([[EPS_D, 2.0**-6]]))


def test_static_amax():
    x = t32([[1.0, 2.0, 3.0, 4.0]])
    codes, d = fp8_blockwise_quantize(x, (4,), amax=t32([[896.0]]))
    assert_same(d, t32([[2.0]]))
    assert_same(codes.float(), t32([[0.5, 1.0, 1.5, 2.0]]))


def test_e5m2_elements():
    # amax 57344 -> d = 1: 1.125 ties to 1.0, 1.375 to 1.5
    x = t32([[57344.0, 1.125, 1.375, 3.0]])
    codes, d = fp8_blockwise_quantize(x, (4,), element=(5, 2))
    assert codes.dtype == torch.float8_e5m2
    assert_same(d, t32([[1.0]]))
    assert_same(codes.float(), t32([[57344.0, 1.0, 1.5, 3.0]]))


def test_three_d_input():
    x = torch.zeros(2, 4, 4)
    x[1, 2:, 2:] = t32([[896.0, 3.0], [-1.0, 2.125]])
    codes, d = fp8_blockwise_quantize(x, (2, 2))
    assert d.shape == (2, 2, 2)
    assert_same(d[1, 1, 1], torch.tensor(2.0))
    assert_same(d[0], torch.full((2, 2), EPS_D))
    assert_same(fp8_blockwise_fake_quant(x, (2, 2))[1, 2:, 2:], t32([[896.0, 3.0], [-1.0, 2.0]]))


@pytest.mark.parametrize("block", [(4,), (2, 2), (2, 3)])
@pytest.mark.parametrize("pow2", [False, True])
def test_non_contiguous_matches_contiguous(block, pow2):
    x = torch.randn(5, 7, generator=torch.Generator().manual_seed(4)) * 10
    xt = x.t()
    c1, d1 = fp8_blockwise_quantize(xt, block, pow2=pow2)
    c2, d2 = fp8_blockwise_quantize(xt.contiguous(), block, pow2=pow2)
    assert_bitwise(c1, c2)
    assert_bitwise(d1, d2)
    assert_bitwise(fp8_blockwise_fake_quant(non_contiguous(x), block, pow2=pow2), fp8_blockwise_fake_quant(x, block, pow2=pow2))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_input_dtypes_compute_in_fp32(dtype):
    x = t32([[896.0, 3.0, 2.125, -1.0]]).to(dtype)
    codes, d = fp8_blockwise_quantize(x, (4,))
    assert_same(d, t32([[2.0]]))
    assert_same(fp8_blockwise_dequantize(codes, d, (4,)), t32([[896.0, 3.0, 2.0, -1.0]]))


def test_subnormal_amax():
    # an fp32-subnormal block amax is below eps: d = eps / 448, the block quantizes to 0
    x = t32([[2.0**-140, -(2.0**-145), 0.0, 0.0]])
    _, d = fp8_blockwise_quantize(x, (4,))
    assert_same(d, t32([[EPS_D]]))
    assert_same(fp8_blockwise_fake_quant(x, (4,)), torch.zeros(1, 4))
