"""TensorQuantizer: standalone use on a tensor, STE backward, switches, calibration and its amax
shapes, NaN/Inf refusal, state_dict round trips. Expected values are computed by hand."""

from __future__ import annotations

import math

import pytest
import torch

import quantlib as ql
from quantlib import CalibrationError, QuantizerAttributeConfig, TensorQuantizer

NVFP4 = {"num_bits": (2, 1), "block_sizes": {-1: 16, "type": "dynamic", "scale_bits": (4, 3)}}
MXFP8 = {"num_bits": (4, 3), "block_sizes": {-1: 32, "type": "dynamic", "scale_bits": (8, 0)}}


def t(values, dtype=torch.float32) -> torch.Tensor:
    return torch.tensor(values, dtype=dtype)


# ------------------------------------------------------------------------------------ standalone


def test_standalone_int8_per_channel_like_modelopt():
    # row amax 127 -> scale 1 (round half to even); row amax 63.5 -> scale 2
    x = t([[127.0, 0.5, 1.5, -2.5], [63.5, 0.25, 0.75, -0.3]])
    y = ql.TensorQuantizer(ql.QuantizerAttributeConfig(num_bits=8, axis=0))(x)
    assert torch.equal(y, t([[127.0, 0.0, 2.0, -2.0], [63.5, 0.0, 1.0, -0.5]]))


def test_standalone_int8_per_tensor_uses_the_tensor_amax():
    x = t([[63.5, 0.25], [0.75, -0.3]])  # amax 63.5 -> scale 2
    assert torch.equal(TensorQuantizer(QuantizerAttributeConfig(num_bits=8))(x), t([[63.5, 0.0], [1.0, -0.5]]))


def test_standalone_int4_narrow_range():
    x = t([7.0, 3.5, 2.5, -7.5, 0.4])  # amax 7.5 -> scale 7 / 7.5; q = round(x * scale) in [-7, 7]
    scale = t(7.0) / t(7.5)
    expected = torch.round(x * scale).clamp(-7, 7) / scale
    assert torch.equal(TensorQuantizer(QuantizerAttributeConfig(num_bits=4))(x), expected)
    assert torch.equal(torch.round(x * scale).clamp(-7, 7), t([7.0, 3.0, 2.0, -7.0, 0.0]))


def test_standalone_fp8_e4m3_rounds_to_nearest_even():
    # amax 448 -> scale 1: the output is the E4M3 value nearest to x (ties to even mantissa)
    x = t([448.0, 1.0625, 17.0, -300.0, 2.0**-9, 0.0])
    y = TensorQuantizer(QuantizerAttributeConfig(num_bits=(4, 3)))(x)
    assert torch.equal(y, t([448.0, 1.0, 16.0, -288.0, 2.0**-9, 0.0]))


def test_standalone_accepts_a_dict_config():
    x = t([[127.0, 0.5, 1.5, -2.5]])
    assert torch.equal(TensorQuantizer({"num_bits": 8, "axis": 0})(x), t([[127.0, 0.0, 2.0, -2.0]]))


def test_calibrated_amax_is_used_instead_of_the_tensor_amax():
    q = TensorQuantizer(QuantizerAttributeConfig(num_bits=8), amax=torch.tensor(127.0))
    # values beyond amax saturate at 127 and, full range by default as in ModelOpt, at -128
    assert torch.equal(q(t([300.0, -1000.0, 1.5])), t([127.0, -128.0, 2.0]))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_output_keeps_the_input_dtype(dtype):
    x = t([[127.0, 0.5, 1.5, -2.5]], dtype)
    y = TensorQuantizer(QuantizerAttributeConfig(num_bits=8, axis=0))(x)
    assert y.dtype == dtype
    assert torch.equal(y, t([[127.0, 0.0, 2.0, -2.0]], dtype))


def test_standalone_nvfp4_dynamic_equals_calibrated_on_the_same_tensor():
    x = torch.linspace(-3.0, 5.0, 64).reshape(2, 32)
    dynamic = TensorQuantizer(NVFP4)
    static = TensorQuantizer(NVFP4)
    static.calibrate(x)
    assert torch.equal(static.amax, t(5.0))
    assert torch.equal(dynamic(x), static(x))
    assert not torch.equal(dynamic(x), x)


# ------------------------------------------------------------------------------------ STE backward
# pass_through_bwd=False: the clipped estimator (the default, True, is tested in test_pass_through_bwd.py)


def test_ste_gradient_zero_outside_amax_passes_inside():
    q = TensorQuantizer(QuantizerAttributeConfig(num_bits=8, pass_through_bwd=False), amax=torch.tensor(1.0))
    x = t([-2.0, -1.0, -0.5, 0.0, 0.5, 1.0, 1.0001, 2.0]).requires_grad_()
    q(x).backward(t([1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0]))
    assert torch.equal(x.grad, t([0.0, 2.0, 3.0, 4.0, 5.0, 6.0, 0.0, 0.0]))


def test_ste_bf16_input_compares_with_the_fp32_amax_unrounded():
    # amax 1.006 rounds to bf16 1.0078125: a comparison in bf16 would let that value's gradient through
    q = TensorQuantizer(QuantizerAttributeConfig(num_bits=8, pass_through_bwd=False), amax=torch.tensor(1.006))
    x = t([1.0, 1.0078125, -1.0078125, 0.5], torch.bfloat16).requires_grad_()
    q(x).backward(torch.ones(4, dtype=torch.bfloat16))
    assert torch.equal(x.grad, t([1.0, 0.0, 0.0, 1.0], torch.bfloat16))


def test_ste_zeroes_non_finite_gradients_outside_amax():
    q = TensorQuantizer(QuantizerAttributeConfig(num_bits=8, pass_through_bwd=False), amax=torch.tensor(1.0))
    x = t([0.5, 3.0]).requires_grad_()
    q(x).backward(t([2.0, float("nan")]))
    assert torch.equal(x.grad, t([2.0, 0.0]))


def test_ste_per_channel_amax():
    q = TensorQuantizer(QuantizerAttributeConfig(num_bits=8, axis=0, pass_through_bwd=False), amax=t([[1.0], [3.0]]))
    x = t([[0.5, -2.0, 1.0], [2.5, -3.5, 4.0]]).requires_grad_()
    q(x).sum().backward()
    assert torch.equal(x.grad, t([[1.0, 0.0, 1.0], [1.0, 0.0, 0.0]]))


def test_ste_per_block_amax():
    q = TensorQuantizer({"num_bits": 4, "block_sizes": {-1: 4}, "pass_through_bwd": False}, amax=t([[1.0, 2.0]]))
    x = t([[0.5, 1.5, -1.0, -0.1, 2.5, 1.9, -2.1, 0.0]]).requires_grad_()
    q(x).sum().backward()
    assert torch.equal(x.grad, t([[1.0, 0.0, 1.0, 1.0, 0.0, 1.0, 0.0, 1.0]]))


def test_ste_without_calibration_passes_everywhere():
    q = TensorQuantizer(QuantizerAttributeConfig(num_bits=4, axis=0))
    x = torch.randn(3, 5).requires_grad_()
    q(x).sum().backward()
    assert torch.equal(x.grad, torch.ones(3, 5))


def test_ste_dynamic_formats_pass_everywhere():
    x = torch.randn(2, 32).requires_grad_()
    TensorQuantizer(MXFP8)(x).sum().backward()
    assert torch.equal(x.grad, torch.ones(2, 32))


# ------------------------------------------------------------------------------------ switches


def test_disable_returns_the_input_and_enable_quantizes_again():
    x = t([[127.0, 0.5, 1.5, -2.5]])
    q = TensorQuantizer(QuantizerAttributeConfig(num_bits=8, axis=0))
    q.disable()
    assert not q.is_enabled
    assert q(x) is x
    q.enable()
    assert q.is_enabled and torch.equal(q(x), t([[127.0, 0.0, 2.0, -2.0]]))


def test_config_enable_false_builds_a_disabled_quantizer():
    q = TensorQuantizer(QuantizerAttributeConfig(enable=False))
    x = torch.randn(3)
    assert not q.is_enabled and q(x) is x


def test_disable_quant_passes_through_while_calibrating():
    x = t([[1.0, -3.0], [0.3, 0.2]])
    q = TensorQuantizer(QuantizerAttributeConfig(num_bits=8))
    q.disable_quant()
    q.enable_calib()
    assert q(x) is x
    q.load_calib_amax()
    assert torch.equal(q.amax, t(3.0))


def test_disabled_quantizer_does_not_calibrate():
    q = TensorQuantizer(QuantizerAttributeConfig(num_bits=8))
    q.enable_calib()
    q.disable()
    q(t([5.0]))
    q.load_calib_amax()
    assert q.amax is None and q.num_calib_batches == 0


# ------------------------------------------------------------------------------------ calibration

AMAX_CASES = {
    "per_tensor": ({"num_bits": 8}, (3, 5), ()),
    "per_channel_axis0": ({"num_bits": 8, "axis": 0}, (4, 6), (4, 1)),
    "per_channel_last_axis": ({"num_bits": 8, "axis": -1}, (2, 3, 5), (1, 1, 5)),
    "two_kept_axes": ({"num_bits": 8, "axis": (0, 2)}, (2, 3, 5), (2, 1, 5)),
    "fp8_per_channel": ({"num_bits": (4, 3), "axis": 0}, (4, 6), (4, 1)),
    "every_axis_kept": ({"num_bits": 8, "axis": (0, 1)}, (3, 4), (3, 4)),
    "axis0_of_1d": ({"num_bits": 8, "axis": 0}, (5,), (5,)),
    "int4_block_partial": ({"num_bits": 4, "block_sizes": {-1: 4}}, (3, 10), (3, 3)),
    "int4_block_3d": ({"num_bits": 4, "block_sizes": {-1: 4}}, (2, 3, 8), (2, 3, 2)),
    "fp8_2d_block_partial": ({"num_bits": (4, 3), "block_sizes": {-1: 4, -2: 2}}, (5, 6), (3, 2)),
    "fp8_2d_block_128": ({"num_bits": (4, 3), "block_sizes": {-1: 128, -2: 128}}, (48, 64), (1, 1)),
    "nvfp4_global": (NVFP4, (4, 32), ()),
}


@pytest.mark.parametrize("case", sorted(AMAX_CASES))
def test_calibrated_amax_shape(case):
    cfg, shape, expected = AMAX_CASES[case]
    x = torch.randn(*shape)
    q = TensorQuantizer(cfg)
    q.calibrate(x)
    assert tuple(q.amax.shape) == expected == q.amax_shape(shape)
    assert q.amax.dtype == torch.float32
    assert torch.equal(q.amax.max(), x.abs().max())


def test_per_channel_amax_values_keepdim():
    x = t([[1.0, -4.0, 2.0], [0.5, 0.25, -0.125]])
    q = TensorQuantizer({"num_bits": 8, "axis": 0})
    q.calibrate(x)
    assert torch.equal(q.amax, t([[4.0], [0.5]]))
    q = TensorQuantizer({"num_bits": 8, "axis": 1})
    q.calibrate(x)
    assert torch.equal(q.amax, t([[1.0, 4.0, 2.0]]))


def test_every_axis_kept_gives_one_amax_per_element():
    x = t([[1.0, -4.0], [0.5, -0.25]])
    q = TensorQuantizer({"num_bits": 8, "axis": (0, 1)})
    q.calibrate(x)
    assert torch.equal(q.amax, x.abs())
    assert torch.equal(q(x), x)  # every element is its own amax: exact


def test_block_amax_values_over_real_elements_of_partial_block():
    x = t([[1.0, -2.0, 0.5, 0.0, 3.0, -0.25, 0.0, 1.0, -7.0, 0.5], [-1.0] * 10])
    q = TensorQuantizer({"num_bits": 4, "block_sizes": {-1: 4}})
    q.calibrate(x)
    assert torch.equal(q.amax, t([[2.0, 3.0, 7.0], [1.0, 1.0, 1.0]]))


def test_2d_block_amax_values():
    x = torch.zeros(3, 5)
    x[0, 0], x[1, 3], x[2, 1], x[2, 4] = 1.0, -2.0, 3.0, -4.0
    q = TensorQuantizer({"num_bits": (4, 3), "block_sizes": {-1: 4, -2: 2}})
    q.calibrate(x)
    # rows {0,1} x cols {0..3}, rows {0,1} x col {4}, row {2} x cols {0..3}, row {2} x col {4}
    assert torch.equal(q.amax, t([[2.0, 0.0], [3.0, 4.0]]))


@pytest.mark.parametrize("cfg", [MXFP8, {"num_bits": (4, 3), "block_sizes": {-1: 128, "type": "dynamic"}},
                                 {"num_bits": (4, 3), "block_sizes": {-1: None, "type": "dynamic"}}])
def test_dynamic_formats_keep_no_amax(cfg):
    q = TensorQuantizer(cfg)
    assert not q.needs_calibration
    q.calibrate(torch.randn(2, 64))
    assert q.amax is None and "_amax" not in q.state_dict()


def test_calibration_over_batches_keeps_the_running_max():
    q = TensorQuantizer({"num_bits": 8, "axis": 0})
    q.enable_calib()
    q.disable_quant()
    q(t([[1.0, -2.0], [0.5, 0.0]]))
    q(t([[0.5, 1.5], [-3.0, 0.25]]))
    q(t([[0.0, 0.0], [0.0, 0.0]]))
    assert q.num_calib_batches == 3
    q.load_calib_amax()
    assert torch.equal(q.amax, t([[2.0], [3.0]]))


def test_calibrating_a_second_time_replaces_the_amax():
    q = TensorQuantizer({"num_bits": 8})
    q.calibrate(t([10.0]))
    q.calibrate(t([2.0]))
    assert torch.equal(q.amax, t(2.0))


def test_per_channel_calibration_refuses_a_changing_shape():
    q = TensorQuantizer({"num_bits": 8, "axis": 0})
    q.enable_calib()
    q.disable_quant()
    q(torch.randn(3, 4))
    with pytest.raises(ValueError, match=r"\(2, 1\).*\(3, 1\)"):
        q(torch.randn(2, 4))


@pytest.mark.parametrize("bad, word", [(math.nan, "NaN"), (math.inf, "Inf"), (-math.inf, "Inf")])
def test_nan_inf_during_calibration_raises_naming_the_quantizer(bad, word):
    q = TensorQuantizer({"num_bits": 8})
    q._qname = "decoder.layers.3.mlp.fc1.input_quantizer"
    q.enable_calib()
    q.disable_quant()
    q(t([1.0, 2.0]))
    q(t([bad, 0.5]))
    with pytest.raises(CalibrationError, match=word) as err:
        q.load_calib_amax()
    assert "decoder.layers.3.mlp.fc1.input_quantizer" in str(err.value)
    assert q.amax is None


@pytest.mark.parametrize("cfg", [{"num_bits": 8, "axis": 0}, {"num_bits": 4, "block_sizes": {-1: 4}}, NVFP4])
def test_nan_weight_calibration_raises(cfg):
    w = torch.ones(2, 16)
    w[1, 5] = math.nan
    q = TensorQuantizer(cfg)
    with pytest.raises(CalibrationError, match="^TensorQuantizer: .*NaN"):
        q.calibrate(w)
    assert q.amax is None


def test_calibration_error_is_a_value_error():
    assert issubclass(CalibrationError, ValueError)


# ------------------------------------------------------------------------------------ amax and state


def test_amax_setter_registers_a_float32_buffer_and_reset_removes_it():
    q = TensorQuantizer({"num_bits": 8})
    assert q.amax is None and dict(q.state_dict()) == {}
    q.amax = 2
    assert q.amax.dtype == torch.float32 and torch.equal(q.amax, t(2.0))
    assert list(q.state_dict()) == ["_amax"]
    q.amax = None
    assert q.amax is None and dict(q.state_dict()) == {}


def test_amax_setter_copies_the_value():
    src = t([[1.0], [2.0]])
    q = TensorQuantizer({"num_bits": 8, "axis": 0}, amax=src)
    src.mul_(10)
    assert torch.equal(q.amax, t([[1.0], [2.0]]))


def test_state_dict_round_trip_creates_the_amax_buffer():
    x = torch.randn(4, 6)
    src = TensorQuantizer({"num_bits": 4, "axis": 0})
    src.calibrate(x)
    dst = TensorQuantizer({"num_bits": 4, "axis": 0})
    assert dst.amax is None
    dst.load_state_dict(src.state_dict())
    assert torch.equal(dst.amax, src.amax) and tuple(dst.amax.shape) == (4, 1)
    probe = 3 * torch.randn(4, 6)  # beyond the calibrated range: the amax matters
    assert torch.equal(dst(probe), src(probe))


def test_state_dict_of_an_uncalibrated_quantizer_is_empty_and_loads():
    q = TensorQuantizer({"num_bits": 8})
    q.load_state_dict(TensorQuantizer({"num_bits": 8}).state_dict())
    assert q.amax is None


def test_state_dict_amax_of_the_wrong_shape_is_refused():
    src = TensorQuantizer({"num_bits": 8, "axis": 0}, amax=torch.ones(4, 1))
    dst = TensorQuantizer({"num_bits": 8, "axis": 0}, amax=torch.ones(3, 1))
    with pytest.raises(RuntimeError, match="_amax"):
        dst.load_state_dict(src.state_dict())


def test_set_from_attribute_config():
    q = TensorQuantizer({"num_bits": 8, "axis": 0}, amax=torch.ones(2, 1))
    q.set_from_attribute_config({"enable": False})
    assert not q.is_enabled and q.amax is not None  # a toggle keeps the config and the amax
    q.set_from_attribute_config({"num_bits": 8, "axis": 0})
    assert q.is_enabled and q.amax is not None  # same format: the amax still fits
    q.set_from_attribute_config({"num_bits": 8, "axis": None})
    assert q.amax is None and q.axis is None  # another granularity: the amax would not fit
    q.amax = 1.0
    q.set_from_attribute_config(QuantizerAttributeConfig(num_bits=(4, 3)))
    assert q.amax is None and q.num_bits == (4, 3)


def test_extra_repr_names_format_granularity_and_amax():
    q = TensorQuantizer({"num_bits": 8, "axis": 0}, amax=torch.ones(4, 1))
    assert repr(q) == "TensorQuantizer(int8 axis=(0,) amax=[(4, 1)])"
    assert repr(TensorQuantizer(NVFP4)) == "TensorQuantizer(nvfp4e2m1 block=(16,) dynamic)"
    assert repr(TensorQuantizer({"enable": False})) == "TensorQuantizer(disabled)"
