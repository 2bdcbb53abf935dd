"""pre_quant_scale: the input times the scale before quantizing, as quantizer state (state_dict,
save / restore) and the schema 2 -> 3 migration against the frozen golden file tests/data/v2_mlp.pt."""

from __future__ import annotations

import copy
import os

import pytest
import torch

import quantlib as ql
from quantlib import checkpoint as ckpt
from quantlib.kernels import fake_quant
from quantlib.nn import TensorQuantizer
from tests._scripts import load_golden_writer

DATA = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "data")
golden_v2 = load_golden_writer(2)

INT8 = {"num_bits": 8, "axis": None}


def _scale(n: int = 8) -> torch.Tensor:
    return torch.linspace(0.25, 4.0, n)


def test_input_is_scaled_before_quantizing():
    q = TensorQuantizer(INT8, amax=torch.tensor(3.0))
    q.pre_quant_scale = _scale()
    x = torch.randn(5, 8)
    assert torch.equal(q(x), fake_quant(x * _scale(), q.attrs, torch.tensor(3.0)))


def test_calibration_sees_the_scaled_input():
    q = TensorQuantizer(INT8)
    q.pre_quant_scale = _scale()
    x = torch.randn(5, 8)
    q.enable_calib()
    q(x)
    q.disable_calib()
    q.load_calib_amax()
    assert torch.equal(q.amax, (x * _scale()).abs().amax())


def test_scale_applies_with_quantization_disabled():
    q = TensorQuantizer(dict(INT8, enable=False))
    q.pre_quant_scale = _scale()
    x = torch.randn(5, 8)
    assert torch.equal(q(x), x * _scale())


@pytest.mark.parametrize("bad", [torch.ones(2, 2, 2), torch.tensor([1.0, float("nan")]), torch.tensor([1.0, 0.0]), torch.tensor([1, 2])])
def test_invalid_scale_is_refused_naming_the_quantizer(bad):
    q = TensorQuantizer(INT8)
    q._qname = "fc1.input_quantizer"
    with pytest.raises(ValueError, match="fc1.input_quantizer: pre_quant_scale"):
        q.pre_quant_scale = bad
    assert q.pre_quant_scale is None


def test_row_of_a_per_expert_scale_scales_that_experts_tokens():
    q = TensorQuantizer(INT8, amax=torch.tensor(3.0))
    table = torch.stack([_scale(), _scale().flip(0), torch.ones(8)])
    q.pre_quant_scale = table
    x = torch.randn(5, 8)
    for e in range(3):
        assert torch.equal(q(x, row=e), fake_quant(x * table[e], q.spec, torch.tensor(3.0)))
    assert not torch.equal(q(x, row=0), q(x, row=1))


def test_channel_mismatch_names_the_quantizer():
    q = TensorQuantizer(INT8)
    q._qname = "fc1.input_quantizer"
    q.pre_quant_scale = _scale(8)
    with pytest.raises(ValueError, match="fc1.input_quantizer: pre_quant_scale has 8 channels, the input's last dim is 6"):
        q(torch.randn(2, 6))


def test_state_dict_round_trip_into_a_fresh_quantizer():
    q = TensorQuantizer(INT8, amax=torch.tensor(2.0))
    q.pre_quant_scale = _scale()
    sd = q.state_dict()
    assert set(sd) == {"_amax", "_pre_quant_scale"}
    fresh = TensorQuantizer(INT8)
    fresh.load_state_dict(sd)
    assert torch.equal(fresh.pre_quant_scale, _scale())
    x = torch.randn(3, 8)
    assert torch.equal(fresh(x), q(x))
    q.pre_quant_scale = None
    assert "_pre_quant_scale" not in q.state_dict()


def _quantized_mlp():
    g = torch.Generator().manual_seed(3)
    data = [torch.randn(4, 16, generator=g) for _ in range(2)]
    model = ql.quantize(golden_v2.build(), golden_v2.CONFIG, lambda m: [m(x) for x in data])
    model.fc1.input_quantizer.pre_quant_scale = torch.linspace(0.5, 2.0, 16)
    return model


def test_save_restore_round_trip_keeps_the_scale(tmp_path):
    model = _quantized_mlp()
    ql.save(model, tmp_path / "q.pt")
    state = ckpt.load_state(tmp_path / "q.pt")
    assert state["schema"] == ckpt.SCHEMA_VERSION and state["quantizers"]["fc2.input_quantizer"]["_pre_quant_scale"] is None
    fresh = ql.restore(golden_v2.build(), tmp_path / "q.pt")
    assert torch.equal(fresh.fc1.input_quantizer.pre_quant_scale, torch.linspace(0.5, 2.0, 16))
    assert fresh.fc2.input_quantizer.pre_quant_scale is None
    x = torch.randn(4, 16)
    with torch.no_grad():
        assert torch.equal(fresh(x), model(x))


def test_restore_refuses_a_bad_scale_naming_the_quantizer():
    state = ql.quantizer_state(_quantized_mlp())
    state["quantizers"]["fc1.input_quantizer"]["_pre_quant_scale"] = torch.tensor([1.0, -1.0])
    with pytest.raises(ql.CheckpointError, match="fc1.input_quantizer: invalid _pre_quant_scale"):
        ql.restore_state(golden_v2.build(), state)


# ------------------------------------------------------------------------------ schema 2 -> 3


def _golden() -> dict:
    return torch.load(os.path.join(DATA, "v2_mlp.pt"), weights_only=True)


def test_golden_file_is_schema_2_without_scales():
    state = _golden()
    assert state["schema"] == 2
    assert all("_pre_quant_scale" not in q for q in state["quantizers"].values() if q["type"] == "tensor")


def test_migration_is_named_and_registered():
    assert ckpt.MIGRATIONS[2] is ckpt.migrate_v2_to_v3


def test_migrate_v2_to_v3_adds_no_scale_everywhere_and_keeps_the_input():
    v2 = _golden()
    before = copy.deepcopy(v2)
    v3 = ckpt.migrate_v2_to_v3(v2)
    assert v3["schema"] == 3 and v3["config"] == v2["config"]
    seq = v3["quantizers"]["fc1.weight_quantizer"]
    assert seq["type"] == "sequential" and [m["_pre_quant_scale"] for m in seq["members"]] == [None, None]
    for name, q in v3["quantizers"].items():
        if q["type"] == "tensor":
            assert q["_pre_quant_scale"] is None
            assert q["attrs"] == v2["quantizers"][name]["attrs"]
            assert (q["_amax"] is None) == (v2["quantizers"][name]["_amax"] is None)
    assert v2["schema"] == 2 and "_pre_quant_scale" not in v2["quantizers"]["fc2.input_quantizer"]
    assert torch.equal(v2["quantizers"]["fc2.weight_quantizer"]["_amax"], before["quantizers"]["fc2.weight_quantizer"]["_amax"])


def test_golden_v2_restores_its_amax_and_matches_a_fresh_calibration():
    v2 = _golden()["quantizers"]
    model = ql.restore(golden_v2.build(), os.path.join(DATA, "v2_mlp.pt"))
    assert torch.equal(model.fc2.weight_quantizer.amax, v2["fc2.weight_quantizer"]["_amax"])
    assert torch.equal(model.fc1.input_quantizer.amax, v2["fc1.input_quantizer"]["_amax"])
    for i in range(2):
        assert torch.equal(model.fc1.weight_quantizer[i].amax, v2["fc1.weight_quantizer"]["members"][i]["_amax"])
    assert all(leaf.pre_quant_scale is None for _, leaf in ql.model_quant.iter_leaf_quantizers(model))
    # the weights' amax are those of the weights (what the schema-2 code computed)
    fresh = ql.quantize(golden_v2.build(), golden_v2.CONFIG, None)
    assert torch.equal(fresh.fc2.weight_quantizer.amax, model.fc2.weight_quantizer.amax)
    assert torch.equal(fresh.fc1.weight_quantizer[0].amax, model.fc1.weight_quantizer[0].amax)
