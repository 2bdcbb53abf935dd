"""SequentialQuantizer and GroupedQuantizer: broadcast of lifecycle calls, reads from the first member,
chained calibration (member i on the output of members < i), independent grouped members."""

from __future__ import annotations

import pytest
import torch

from quantlib import GroupedQuantizer, SequentialQuantizer, TensorQuantizer
from quantlib.nn.containers import build_quantizer

INT4_BLOCK = {"num_bits": 4, "block_sizes": {-1: 8}}
FP8 = {"num_bits": (4, 3)}
MXFP4 = {"num_bits": (2, 1), "block_sizes": {-1: 32, "type": "dynamic", "scale_bits": (8, 0)}}
INT8_CH = {"num_bits": 8, "axis": 0}


def t(values) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float32)


def w4a8() -> SequentialQuantizer:
    return SequentialQuantizer.from_configs([INT4_BLOCK, FP8])


def weight() -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    return torch.randn(6, 20, generator=g)


# ------------------------------------------------------------------------------------ common base

LIFECYCLE = [
    ("disable", lambda m: not m.is_enabled),
    ("enable", lambda m: m.is_enabled),
    ("disable_quant", lambda m: not m._if_quant),
    ("enable_quant", lambda m: m._if_quant),
    ("enable_calib", lambda m: m._if_calib),
    ("disable_calib", lambda m: not m._if_calib),
]


@pytest.mark.parametrize("kind", ["sequential", "grouped"])
def test_lifecycle_calls_reach_every_member(kind):
    c = w4a8() if kind == "sequential" else GroupedQuantizer.from_config(INT8_CH, 3)
    for method, holds in LIFECYCLE:
        getattr(c, method)()
        assert all(holds(m) for m in c), method
    c.amax = t([[1.0]] * 6)
    assert all(m.amax is not None for m in c)
    c.reset_amax()
    assert all(m.amax is None for m in c)


@pytest.mark.parametrize("kind", ["sequential", "grouped"])
def test_amax_reads_the_first_member_is_enabled_any(kind):
    c = w4a8() if kind == "sequential" else GroupedQuantizer.from_config(INT8_CH, 2)
    c[0].amax = t(3.0)
    c[1].amax = t(5.0)
    assert torch.equal(c.amax, t(3.0))
    c[1].disable()
    assert c.is_enabled
    c[0].disable()
    assert not c.is_enabled
    c[1].enable()
    assert c.is_enabled  # the second member still quantizes


def test_set_from_attribute_config_broadcasts_one_config_and_spreads_a_list():
    c = w4a8()
    c.set_from_attribute_config({"enable": False})
    assert [m.is_enabled for m in c] == [False, False]
    c.set_from_attribute_config([{"num_bits": 8, "axis": 0}, {"num_bits": (5, 2)}])
    assert [m.num_bits for m in c] == [8, (5, 2)] and [m.is_enabled for m in c] == [True, True]
    with pytest.raises(ValueError, match="2 members given 3"):
        c.set_from_attribute_config([FP8, FP8, FP8])
    g = GroupedQuantizer.from_config(INT8_CH, 3)
    g.set_from_attribute_config(FP8)
    assert [m.num_bits for m in g] == [(4, 3)] * 3


def test_leaves_and_needs_calibration():
    c = SequentialQuantizer.from_configs([{"num_bits": (4, 3), "block_sizes": {-1: 32, "type": "dynamic", "scale_bits": (8, 0)}}, FP8])
    assert list(c.leaves()) == [c[0], c[1]]
    assert c.needs_calibration  # the FP8 member needs an amax
    assert not SequentialQuantizer.from_configs([{"num_bits": (4, 3), "block_sizes": {-1: 128, "type": "dynamic"}}]).needs_calibration
    g = GroupedQuantizer([w4a8(), w4a8()])
    assert len(list(g.leaves())) == 4


def test_build_quantizer():
    assert type(build_quantizer(FP8)) is TensorQuantizer
    seq = build_quantizer([INT4_BLOCK, FP8])
    assert type(seq) is SequentialQuantizer and len(seq) == 2


# ------------------------------------------------------------------------------------ SequentialQuantizer


def test_sequential_forward_chains_members():
    c = w4a8()
    w = weight()
    c.calibrate(w)
    assert torch.equal(c(w), c[1](c[0](w)))
    assert not torch.equal(c(w), c[0](w))


def test_sequential_calibrate_member_1_on_the_output_of_member_0():
    c = w4a8()
    w = weight()
    c.calibrate(w)
    # member 0: INT4 per block of 8 along the last dim (20 columns -> 3 blocks, the last partial)
    expected0 = torch.stack([w[:, :8].abs().amax(1), w[:, 8:16].abs().amax(1), w[:, 16:].abs().amax(1)], dim=1)
    assert torch.equal(c[0].amax, expected0)
    # member 1: FP8 per tensor, calibrated on member 0's output, not on w
    out0 = TensorQuantizer(INT4_BLOCK, amax=expected0)(w)
    assert torch.equal(c[1].amax, out0.abs().amax())


def test_sequential_member_1_sees_what_member_0_changed():
    # MXFP4 moves the largest element onto its grid (rceil: e = 0 here, 3.41 -> 3), so the chain's amax differs from w's
    c = SequentialQuantizer.from_configs([MXFP4, FP8])
    w = weight()
    c.calibrate(w)
    assert c[0].amax is None  # dynamic
    assert torch.equal(c[1].amax, c[0](w).abs().amax())
    assert torch.equal(c[1].amax, t(3.0)) and w.abs().amax().item() == pytest.approx(3.4105, abs=1e-4)


def test_sequential_calibrate_by_forward_chains_too():
    c = w4a8()
    w = weight()
    c.enable_calib()
    c(w)
    c.disable_calib()
    c.load_calib_amax()
    ref = w4a8()
    ref.calibrate(w)
    assert torch.equal(c[0].amax, ref[0].amax)
    assert torch.equal(c[1].amax, ref[1].amax)


def test_sequential_three_members_each_on_the_chain_so_far():
    c = SequentialQuantizer.from_configs([{"num_bits": 4, "block_sizes": {-1: 8}}, {"num_bits": 3, "axis": 0}, FP8])
    w = weight()
    c.calibrate(w)
    out0 = c[0](w)
    assert torch.equal(c[1].amax, out0.abs().amax(dim=1, keepdim=True))
    assert torch.equal(c[2].amax, c[1](out0).abs().amax())


def test_sequential_disabled_member_is_skipped_in_the_chain():
    c = w4a8()
    c[0].disable()
    w = weight()
    c.calibrate(w)
    assert torch.equal(c[1].amax, w.abs().amax())
    assert torch.equal(c(w), c[1](w))


def test_sequential_takes_tensor_quantizers_only():
    with pytest.raises(TypeError):
        SequentialQuantizer()
    with pytest.raises(TypeError):
        SequentialQuantizer(w4a8())


# ------------------------------------------------------------------------------------ GroupedQuantizer


def test_grouped_members_calibrate_on_their_own_tensor():
    g = GroupedQuantizer.from_config(INT8_CH, 3)
    tensors = [torch.full((2, 4), 1.0), torch.full((2, 4), -2.0), t([[3.0, 0.0, 0.0, 0.0], [0.0, 0.0, 0.0, 0.5]])]
    g.calibrate(tensors)
    assert torch.equal(g[0].amax, t([[1.0], [1.0]]))
    assert torch.equal(g[1].amax, t([[2.0], [2.0]]))
    assert torch.equal(g[2].amax, t([[3.0], [0.5]]))


def test_grouped_members_are_independent():
    g = GroupedQuantizer.from_config(FP8, 2)
    assert g[0] is not g[1]
    g[0].amax = t(4.0)
    assert g[1].amax is None
    g[1].disable()
    assert g[0].is_enabled
    g[0].reset_amax()
    g[1].amax = t(2.0)
    assert g[0].amax is None and torch.equal(g[1].amax, t(2.0))


def test_grouped_load_calib_amax_keeps_each_members_statistics():
    g = GroupedQuantizer.from_config(FP8, 2)
    g.enable_calib()
    g.disable_quant()
    g[0](t([1.0, -6.0]))
    g[1](t([0.5]))
    g.load_calib_amax()
    assert torch.equal(g[0].amax, t(6.0)) and torch.equal(g[1].amax, t(0.5))


def test_grouped_sequential_members():
    g = GroupedQuantizer.from_config([INT4_BLOCK, FP8], 2)
    assert all(isinstance(m, SequentialQuantizer) for m in g)
    w0, w1 = weight(), 4 * weight()
    g.calibrate([w0, w1])
    ref = w4a8()
    ref.calibrate(w1)
    assert torch.equal(g[1][1].amax, ref[1].amax)
    assert not torch.equal(g[0][1].amax, g[1][1].amax)


def test_grouped_has_no_forward():
    g = GroupedQuantizer.from_config(FP8, 2)
    with pytest.raises(TypeError, match="no forward"):
        g(torch.ones(2))


def test_grouped_checks_its_arguments():
    g = GroupedQuantizer.from_config(FP8, 2)
    with pytest.raises(ValueError, match="2 members given 3 tensors"):
        g.calibrate([torch.ones(1)] * 3)
    with pytest.raises(ValueError):
        GroupedQuantizer([])
    with pytest.raises(TypeError, match="GroupedQuantizer"):
        GroupedQuantizer([GroupedQuantizer.from_config(FP8, 1)])


def test_sequential_calibration_with_quant_off_passes_the_input_through():
    c = w4a8()
    w = weight()
    c.enable_calib()
    c.disable_quant()
    assert c(w) is w  # downstream quantizers calibrate on the unquantized tensor
    c.disable_calib()
    c.load_calib_amax()
    ref = w4a8()
    ref.calibrate(w)
    assert torch.equal(c[1].amax, ref[1].amax)  # yet member 1 saw member 0's output


def test_grouped_takes_modelopts_varargs_form():
    """``GroupedQuantizer(q0, q1)`` (ModelOpt's form) builds the same group as ``GroupedQuantizer([q0, q1])``,
    also when the members are chains, and still refuses what the list form refuses."""
    q0, q1 = TensorQuantizer(INT8_CH), TensorQuantizer(INT8_CH)
    g = GroupedQuantizer(q0, q1)
    assert len(g) == 2 and g[0] is q0 and g[1] is q1
    chains = [w4a8(), w4a8()]
    assert list(GroupedQuantizer(*chains)) == list(GroupedQuantizer(chains)) == chains
    one = w4a8()  # a single chain is one member, not a list of its own members
    assert list(GroupedQuantizer(one)) == [one]
    w = [weight(), 2 * weight()]
    g.calibrate(w)
    assert torch.equal(g[1].amax.flatten(), w[1].abs().amax(dim=1))  # member i calibrated on tensor i alone
    with pytest.raises(ValueError):
        GroupedQuantizer()
    with pytest.raises(TypeError, match="GroupedQuantizer"):
        GroupedQuantizer(q0, GroupedQuantizer.from_config(FP8, 1))
