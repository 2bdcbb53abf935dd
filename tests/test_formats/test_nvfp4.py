"""NVFP4: E2M1 elements, E4M3 block scales over 16 elements, fp32 global scale; hand-computed."""

import pytest
import torch

from quantlib.formats.nvfp4 import nvfp4_dequantize, nvfp4_fake_quant, nvfp4_quantize

from ._helpers import INF, NAN, assert_bitwise, assert_same, f32, non_contiguous, t32

E4M3 = torch.float8_e4m3fn
A_UNIT = 2688.0  # 6 * 448: global amax that gives s2 = 1


def block(head, n=16) -> list[float]:
    return list(head) + [0.0] * (n - len(head))


def e4m3(values) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float32).to(E4M3)


@pytest.mark.parametrize("global_amax", [None, 0.0, 2.0**-24])
def test_global_amax_zero_gives_zeros_not_nan(global_amax):
    x = torch.zeros(2, 16)
    ga = None if global_amax is None else torch.tensor(global_amax)
    packed, sb8, s2 = nvfp4_quantize(x, ga)
    assert_same(s2, torch.tensor(1.0))
    assert_same(sb8, e4m3([[1.0], [1.0]]))  # sb == 0 -> 1
    assert_same(packed, torch.zeros(2, 8, dtype=torch.uint8))
    assert_same(nvfp4_fake_quant(x, ga), torch.zeros(2, 16))


def test_tiny_global_amax_uses_unit_global_scale():
    # A <= 2^-24 -> s2 = 1: block amax 3 -> sb 0.5 -> y = 6, 1.5 -> 3
    x = t32(block([3.0, -1.5]))
    packed, sb8, s2 = nvfp4_quantize(x, torch.tensor(2.0**-24))
    assert_same(s2, torch.tensor(1.0))
    assert_same(sb8, e4m3([0.5]))
    assert_same(nvfp4_fake_quant(x, torch.tensor(2.0**-24)), x)
    _, _, s2 = nvfp4_quantize(x, torch.tensor(2.0**-23))
    assert_same(s2, torch.tensor(f32(2.0**-23 / 2688.0)))


def test_all_zero_block():
    # a zero block next to a live one: its sb is 1, its outputs 0
    x = t32(block([]) + block([6.0, 1.0]))
    packed, sb8, s2 = nvfp4_quantize(x, torch.tensor(A_UNIT))
    assert_same(sb8, e4m3([1.0, 1.0]))
    assert_same(nvfp4_fake_quant(x, torch.tensor(A_UNIT)), x)


def test_e2m1_ties_to_even_at_unit_scale():
    # s2 = 1 and block amax 6 -> sb8 = 1 -> y = x
    y = [6.0, 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, -0.25, -0.75, -5.0, 0.3, 2.9, 4.9, 5.1, 0.0]
    expected = [6.0, 0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0, 0.0, -1.0, -4.0, 0.5, 3.0, 4.0, 6.0, 0.0]
    out = nvfp4_fake_quant(t32(y), torch.tensor(A_UNIT))
    assert_same(out, t32(expected))


def test_saturation_above_6():
    # block amax 12 -> sb 2 -> y = x / 2: 12 -> 6, 11 -> 5.5 -> 6
    x = t32(block([12.0, 11.0, -13.0]))  # -13 sets amax 13 -> sb 13/6 = 2.1667 -> e4m3 2.25
    out = nvfp4_fake_quant(x, torch.tensor(A_UNIT))
    # y = 12/2.25 = 5.33 -> 6, 11/2.25 = 4.89 -> 4, -13/2.25 = -5.78 -> -6; times 2.25
    assert_same(out, t32(block([13.5, 9.0, -13.5])))


def test_sb_clamp_to_2_pow_minus_9():
    # block amax 6 * 2^-12 -> sb = 2^-12 -> clamp 2^-9; y = x * 2^9 = 0.75 -> 1 (tie to even) -> 2^-9
    x = t32(block([6 * 2.0**-12, 2.0**-12]))  # second: y = 2^-3 -> 0
    packed, sb8, _ = nvfp4_quantize(x, torch.tensor(A_UNIT))
    assert_same(sb8, e4m3([2.0**-9]))
    assert_same(nvfp4_fake_quant(x, torch.tensor(A_UNIT)), t32(block([2.0**-9, 0.0])))


def test_sb_clamp_to_448():
    # block amax above the global amax: sb = 1000 -> 448, y = 6000 / 448 -> 6, x_hat = 6 * 448
    x = t32(block([6000.0, -448.0]))
    _, sb8, _ = nvfp4_quantize(x, torch.tensor(A_UNIT))
    assert_same(sb8, e4m3([448.0]))
    assert_same(nvfp4_fake_quant(x, torch.tensor(A_UNIT)), t32(block([2688.0, -448.0])))


def test_block_scale_rounds_half_even_in_e4m3():
    # sb = 1.0625 ties to 1.0 ; sb = 1.1875 ties to 1.25
    x = t32(block([6.375]) + block([7.125, 1.0]))
    _, sb8, _ = nvfp4_quantize(x, torch.tensor(A_UNIT))
    assert_same(sb8, e4m3([1.0, 1.25]))
    # y = 6.375 -> 6 ; y = 7.125 / 1.25 = 5.7 -> 6 -> 7.5, 1.0 / 1.25 = 0.8 -> 1 -> 1.25
    assert_same(nvfp4_fake_quant(x, torch.tensor(A_UNIT)), t32(block([6.0]) + block([7.5, 1.25])))


def test_global_scale_product_taken_first_in_fp32():
    # A = 1: s2 = fp32(1/2688); sb = fp32(1 / fp32(6 * s2)) rounds to 448 in E4M3;
    # the dequant scale is fp32(448 * s2), then value * that scale
    s2 = f32(1.0 / 2688.0)
    sb = f32(1.0 / f32(6.0 * s2))
    assert abs(sb - 448.0) < 1e-3
    d = f32(448.0 * s2)
    x = t32(block([1.0, 0.5, -0.25]))
    packed, sb8, s2_out = nvfp4_quantize(x, torch.tensor(1.0))
    assert_same(s2_out, torch.tensor(s2))
    assert_same(sb8, e4m3([448.0]))
    # y = x / d: 6.0000x -> 6, 3.0000x -> 3, -1.5000x -> -1.5
    expected = t32(block([f32(6.0 * d), f32(3.0 * d), f32(-1.5 * d)]))
    assert_bitwise(nvfp4_fake_quant(x, torch.tensor(1.0)), expected)


def test_dynamic_global_amax_is_the_tensor_amax():
    x = t32(block([3.0]) + block([-12.0, 1.0]))
    _, sb8, s2 = nvfp4_quantize(x, None)
    assert_same(s2, torch.tensor(f32(12.0 / 2688.0)))
    _, sb8_static, s2_static = nvfp4_quantize(x, torch.tensor(12.0))
    assert_same(s2, s2_static)
    assert_same(sb8, sb8_static)


def test_nan_block():
    # static global amax: only the block holding NaN is NaN (its E4M3 scale is NaN)
    x = t32(block([1.0, NAN]) + block([6.0, 3.0]))
    _, sb8, _ = nvfp4_quantize(x, torch.tensor(A_UNIT))
    assert torch.isnan(sb8.float()[0]) and sb8.float()[1].item() == 1.0
    assert_same(nvfp4_fake_quant(x, torch.tensor(A_UNIT)), t32([NAN] * 16 + block([6.0, 3.0])))


@pytest.mark.parametrize("bad", [NAN, INF])
def test_nan_with_dynamic_global_amax_makes_everything_nan(bad):
    x = t32(block([1.0, bad]) + block([6.0, 3.0]))
    _, _, s2 = nvfp4_quantize(x, None)
    assert_same(s2, torch.tensor(bad / 2688.0))  # NaN or Inf: either way no finite output survives
    assert torch.isnan(nvfp4_fake_quant(x, None)).all()


def test_nan_global_amax():
    x = t32(block([1.0]))
    assert torch.isnan(nvfp4_fake_quant(x, torch.tensor(NAN))).all()


def test_packing_low_nibble_is_even_index():
    x = t32(block([6.0, 1.0, -0.5, 3.0, 0.0, -6.0]))
    packed, _, _ = nvfp4_quantize(x, torch.tensor(A_UNIT))
    # codes 7, 2, 9, 5, 0, 15, 0...
    expected = torch.tensor([0x27, 0x59, 0xF0, 0, 0, 0, 0, 0], dtype=torch.uint8)
    assert_same(packed, expected)


def test_partial_last_block():
    # 20 elements: block 1 has 4 real ones with amax 3 -> sb 0.5
    x = t32(block([6.0, 1.0]) + [3.0, -1.5, 0.75, 0.4])
    packed, sb8, _ = nvfp4_quantize(x, torch.tensor(A_UNIT))
    assert packed.shape == (10,)
    assert_same(sb8, e4m3([1.0, 0.5]))
    # block 1: y = 6, -3, 1.5, 0.8 -> 1 ; times 0.5
    assert_same(nvfp4_fake_quant(x, torch.tensor(A_UNIT)), t32(block([6.0, 1.0]) + [3.0, -1.5, 0.75, 0.5]))
    assert_same(nvfp4_dequantize(packed, sb8, torch.tensor(1.0), 20), t32(block([6.0, 1.0]) + [3.0, -1.5, 0.75, 0.5]))


def test_three_d_input():
    x = torch.zeros(2, 3, 16)
    x[1, 2, 0], x[1, 2, 1] = 6.0, 2.5  # 2.5 ties to 2
    x[0, 0, 15] = -0.75  # amax 0.75 -> sb 0.125 -> y = -6
    packed, sb8, _ = nvfp4_quantize(x, torch.tensor(A_UNIT))
    assert packed.shape == (2, 3, 8) and sb8.shape == (2, 3, 1)
    expected = torch.zeros(2, 3, 16)
    expected[1, 2, 0], expected[1, 2, 1], expected[0, 0, 15] = 6.0, 2.0, -0.75
    assert_same(nvfp4_fake_quant(x, torch.tensor(A_UNIT)), expected)


def test_non_contiguous_matches_contiguous():
    x = torch.randn(32, 6, generator=torch.Generator().manual_seed(1)).t()
    assert not x.is_contiguous()
    for ga in (None, torch.tensor(3.0)):
        p1, s1, g1 = nvfp4_quantize(x, ga)
        p2, s2, g2 = nvfp4_quantize(x.contiguous(), ga)
        assert_same(p1, p2)
        assert_bitwise(s1, s2)
        assert_bitwise(g1, g2)
        assert_bitwise(nvfp4_fake_quant(non_contiguous(x.contiguous()), ga), nvfp4_fake_quant(x.contiguous(), ga))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_input_dtypes_compute_in_fp32(dtype):
    x = t32(block([6.0, 1.25, -2.5, 0.3125])).to(dtype)
    out = nvfp4_fake_quant(x, torch.tensor(A_UNIT))
    assert out.dtype == torch.float32
    assert_same(out, t32(block([6.0, 1.0, -2.0, 0.5])))


def test_subnormal_amax():
    # fp32-subnormal block amax with s2 = 1: sb = a / 6 -> clamp 2^-9; y = x * 2^9 underflows E2M1 -> 0
    x = t32(block([2.0**-140, -(2.0**-145)]))
    _, sb8, _ = nvfp4_quantize(x, torch.tensor(A_UNIT))
    assert_same(sb8, e4m3([2.0**-9]))
    assert_same(nvfp4_fake_quant(x, torch.tensor(A_UNIT)), torch.zeros(16))
    # dynamic: A = 2^-140 <= 2^-24 -> s2 = 1, same result, no NaN
    assert_same(nvfp4_fake_quant(x, None), torch.zeros(16))
