"""Checkpoint schema migrations against the frozen golden files of tests/data (see its README), and
per-member restore of grouped weight quantizers (one member per GEMM / expert)."""

from __future__ import annotations

import copy
import os

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import quantlib as ql
from quantlib import checkpoint as ckpt
from quantlib.nn import GroupedQuantizer, QuantModuleRegistry, TensorQuantizer
from quantlib.plugins.te_adapters import QuantTEGroupedLinearBase

DATA = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data")
GROUPED = {"experts.weight_quantizer": 4, "experts_int8.weight_quantizer": 3}


class ToyGroupedLinear(nn.Module):
    """A grouped linear shaped like te.GroupedLinear: ``num_gemms`` weights ``weight0..``, rows split by m_splits."""

    def __init__(self, num_gemms: int, in_features: int = 16, out_features: int = 8) -> None:
        super().__init__()
        self.num_gemms = num_gemms
        for i in range(num_gemms):
            self.register_parameter(f"weight{i}", nn.Parameter(torch.empty(out_features, in_features)))

    def forward(self, inp, m_splits):
        return torch.cat([F.linear(x, getattr(self, f"weight{i}")) for i, x in enumerate(torch.split(inp, m_splits))])


class _QuantToyGroupedLinear(QuantTEGroupedLinearBase):
    """The plugin's grouped mixin (quantizers, weight groups) with a plain torch forward."""

    def forward(self, inp, m_splits):
        x = self.input_quantizer(inp)
        outs = [F.linear(xs, self.quantize_weight(getattr(self, f"weight{i}"), "weight_quantizer", i))
                for i, xs in enumerate(torch.split(x, m_splits))]
        return self.output_quantizer(torch.cat(outs))


class ToyMoE(nn.Module):
    """The toy model of tests/data/write_v1_golden.py."""

    def __init__(self, int8_out: int = 8, int8_gemms: int = 3) -> None:
        super().__init__()
        self.experts = ToyGroupedLinear(4)
        self.experts_int8 = ToyGroupedLinear(int8_gemms, out_features=int8_out)
        self.proj = nn.Linear(8, 8)

    def forward(self, x):
        y = self.experts(x, [2, 2, 1, 3]) + self.experts_int8(x, [3, 3, 2])[:, :8]
        return self.proj(y)


@pytest.fixture(autouse=True)
def _toy_registered():
    QuantModuleRegistry.register(ToyGroupedLinear, "ToyGroupedLinear")(_QuantToyGroupedLinear)
    yield
    QuantModuleRegistry.unregister(ToyGroupedLinear)


def golden(name: str) -> dict:
    return torch.load(os.path.join(DATA, name), map_location="cpu", weights_only=True)


def toy_model(**kw) -> ToyMoE:
    model = ToyMoE(**kw)
    if not kw:
        model.load_state_dict(golden("v1_toy_weights.pt"))
    else:
        torch.manual_seed(0)
        for p in model.parameters():
            nn.init.normal_(p)
    return model.eval()


def members(model: nn.Module, attr: str) -> list[torch.Tensor]:
    q = getattr(model, attr).weight_quantizer
    assert isinstance(q, GroupedQuantizer)
    return [m.amax for m in q]


def own_amax(model: nn.Module, attr: str, per_channel: bool) -> list[torch.Tensor]:
    mod = getattr(model, attr)
    ws = [getattr(mod, f"weight{i}").detach() for i in range(mod.num_gemms)]
    return [w.abs().amax(dim=1, keepdim=True) if per_channel else w.abs().amax() for w in ws]


# ------------------------------------------------------------------------------ the migration


def test_golden_files_are_schema_1():
    for name in ("v1_anchor_shared.pt", "v1_grouped_members.pt"):
        assert golden(name)["schema"] == 1
    assert golden("v1_anchor_shared.pt")["quantizers"]["experts.weight_quantizer"]["type"] == "tensor"


def test_migration_is_named_and_registered():
    # one named migration per version step, none missing
    assert sorted(ckpt.MIGRATIONS) == list(range(1, ckpt.SCHEMA_VERSION))
    assert ckpt.MIGRATIONS[1] is ckpt.migrate_v1_to_v2


def test_migrate_v1_to_v2_copies_the_shared_amax_to_every_member():
    v1 = golden("v1_anchor_shared.pt")
    before = copy.deepcopy(v1)
    v2 = ckpt.migrate_v1_to_v2(v1, ckpt.QuantizerGroups(GROUPED))
    assert v2["schema"] == 2 and v2["config"] == v1["config"]
    for name, num in GROUPED.items():
        shared = v1["quantizers"][name]
        entry = v2["quantizers"][name]
        assert entry["type"] == "grouped" and len(entry["members"]) == num
        for m in entry["members"]:  # weight_quantizer.{i}._amax, a copy each
            assert m["type"] == "tensor" and m["attrs"] == shared["attrs"]
            assert torch.equal(m["_amax"], shared["_amax"]) and m["_amax"].data_ptr() != shared["_amax"].data_ptr()
        assert len({m["_amax"].data_ptr() for m in entry["members"]}) == num
    untouched = set(v1["quantizers"]) - set(GROUPED)
    assert all(v2["quantizers"][n] is v1["quantizers"][n] for n in untouched)
    assert v1["schema"] == 1 and v1["quantizers"]["experts.weight_quantizer"]["type"] == "tensor"  # input unchanged
    assert torch.equal(v1["quantizers"]["experts.weight_quantizer"]["_amax"], before["quantizers"]["experts.weight_quantizer"]["_amax"])
    assert ckpt.migrate(v1, ckpt.QuantizerGroups(GROUPED))["quantizers"].keys() == v2["quantizers"].keys()


def test_migrate_v1_keeps_per_member_entries():
    v1 = golden("v1_grouped_members.pt")
    v2 = ckpt.migrate_v1_to_v2(v1, ckpt.QuantizerGroups(GROUPED))
    assert v2["schema"] == 2 and all(v2["quantizers"][n] is v1["quantizers"][n] for n in v1["quantizers"])


def test_model_layout_of_fresh_and_converted_models():
    assert dict(ckpt.quantizer_groups(toy_model()).grouped) == GROUPED
    quantized = ql.quantize(toy_model(), golden("v1_anchor_shared.pt")["config"], None)
    assert dict(ckpt.quantizer_groups(quantized).grouped) == GROUPED


# ------------------------------------------------------------------------------ golden files restore


def test_golden_v1_shared_restores_the_copy_into_every_member():
    v1 = golden("v1_anchor_shared.pt")["quantizers"]
    model = ql.restore(toy_model(), os.path.join(DATA, "v1_anchor_shared.pt"))
    for attr in ("experts", "experts_int8"):
        assert all(torch.equal(a, v1[f"{attr}.weight_quantizer"]["_amax"]) for a in members(model, attr))
    assert torch.equal(model.experts.input_quantizer.amax, v1["experts.input_quantizer"]["_amax"])
    assert torch.equal(model.proj.weight_quantizer.amax, v1["proj.weight_quantizer"]["_amax"])
    assert isinstance(ql.model_quant.applied_config(model), ql.QuantizeConfig)
    with torch.no_grad():
        assert torch.isfinite(model(torch.randn(8, 16))).all()


def test_golden_v1_shared_recalibrated_from_each_expert_weight():
    """Regression (the anchor): restoring per expert ran a broadcast reset_amax before the per-expert
    loop, so experts 1..N-1 lost their amax. Each member must end with its own weight's amax."""
    model = ql.restore(toy_model(), os.path.join(DATA, "v1_anchor_shared.pt"), recalibrate_experts=True)
    for attr, per_channel in (("experts", False), ("experts_int8", True)):
        got, want = members(model, attr), own_amax(model, attr, per_channel)
        assert all(a is not None and torch.equal(a, w) for a, w in zip(got, want))
        assert all(not torch.equal(got[i], got[0]) for i in range(1, len(got)))  # weight i ~ 2**i
    v1 = golden("v1_anchor_shared.pt")["quantizers"]
    assert torch.equal(model.proj.weight_quantizer.amax, v1["proj.weight_quantizer"]["_amax"])  # only grouped ones


def test_golden_v1_members_restore_each_member_its_own_amax():
    v1 = golden("v1_grouped_members.pt")["quantizers"]
    model = ql.restore(toy_model(), os.path.join(DATA, "v1_grouped_members.pt"))
    for attr, per_channel in (("experts", False), ("experts_int8", True)):
        saved = [m["_amax"] for m in v1[f"{attr}.weight_quantizer"]["members"]]
        assert all(torch.equal(a, s) for a, s in zip(members(model, attr), saved))
        assert all(torch.equal(a, w) for a, w in zip(members(model, attr), own_amax(model, attr, per_channel)))


@pytest.mark.parametrize("name", ["v1_anchor_shared.pt", "v1_grouped_members.pt"])
def test_golden_v1_int_quantizers_keep_the_narrow_range_they_were_saved_with(name):
    """Old quantlib defaulted INT to narrow range (ModelOpt's default, False, is the default now): the
    files store the field explicitly, and a restored INT8 quantizer still clips at code -127."""
    model = ql.restore(toy_model(), os.path.join(DATA, name))
    int8 = [model.proj.weight_quantizer, model.proj.input_quantizer, *model.experts_int8.weight_quantizer]
    assert all(q.attrs.narrow_range is True and q.spec.narrow_range is True for q in int8)
    q = model.proj.input_quantizer
    a = q.amax.reshape(1)
    assert torch.equal(q(-2 * a), torch.tensor([-127.0]) / (torch.tensor([127.0]) / a))  # code -127
    applied = ql.model_quant.applied_config(model)
    config_attrs = [e.attrs for e in applied.quant_cfg if e.attrs is not None and not isinstance(e.attrs, list)]
    assert all(a.narrow_range is True for a in config_attrs if isinstance(a.num_bits, int))


def test_v1_migrated_without_the_model_layout_is_refused_at_restore():
    state = ckpt.migrate(golden("v1_anchor_shared.pt"))  # no layout: shared entries cannot be recognised
    assert state["schema"] == ckpt.SCHEMA_VERSION and state["quantizers"]["experts.weight_quantizer"]["type"] == "tensor"
    model = toy_model()
    with pytest.raises(ql.CheckpointError, match="experts.weight_quantizer: saved as a single quantizer"):
        ql.restore_state(model, state)
    assert not any(isinstance(m, ql.QuantModule) for m in model.modules())


# ------------------------------------------------------------------------------ schema 2 round trips


def _calibrated(**kw) -> ToyMoE:
    g = torch.Generator().manual_seed(5)
    data = [torch.randn(8, 16, generator=g) for _ in range(2)]
    return ql.quantize(toy_model(**kw), golden("v1_anchor_shared.pt")["config"], lambda m: [m(x) for x in data])


def test_save_restore_round_trip_gives_identical_per_member_amax(tmp_path):
    model = _calibrated()
    ql.save(model, tmp_path / "q.pt")
    assert ckpt.load_state(tmp_path / "q.pt")["schema"] == ckpt.SCHEMA_VERSION
    fresh = ql.restore(toy_model(), tmp_path / "q.pt")
    for attr in ("experts", "experts_int8"):
        saved, restored = members(model, attr), members(fresh, attr)
        assert all(torch.equal(a, b) for a, b in zip(saved, restored))
        assert len({tuple(a.flatten().tolist()) for a in restored}) == len(restored)  # all distinct
    x = torch.randn(8, 16)
    with torch.no_grad():
        assert torch.equal(fresh(x), model(x))


def test_restore_never_broadcasts_a_reset_over_a_group(tmp_path, monkeypatch):
    model = _calibrated()
    state = ql.quantizer_state(model)
    target = ql.quantize(toy_model(), golden("v1_anchor_shared.pt")["config"], None)  # already converted, calibrated
    calls = []
    monkeypatch.setattr(GroupedQuantizer, "reset_amax", lambda self: calls.append(self))
    ql.restore_state(target, state, recalibrate_experts=True)
    ql.restore_state(target, state)
    assert calls == []
    assert all(torch.equal(a, b) for a, b in zip(members(target, "experts"), members(model, "experts")))


def test_restored_amax_that_does_not_fit_the_weights_raises(tmp_path):
    ql.save(_calibrated(), tmp_path / "q.pt")
    wider = toy_model(int8_out=12)
    with pytest.raises(ql.CheckpointError,
                       match=r"experts_int8\.weight_quantizer\.0: amax of shape \(8, 1\) does not fit weight \(12, 16\)"):
        ql.restore(wider, tmp_path / "q.pt")
    assert not any(isinstance(m, ql.QuantModule) for m in wider.modules())
    fewer = toy_model(int8_gemms=2)
    with pytest.raises(ql.CheckpointError, match="3 weight quantizer member"):
        ql.restore(fewer, tmp_path / "q.pt")
    with pytest.raises(ql.CheckpointError, match=r"experts_int8\.weight_quantizer\.0: amax of shape \(8, 1\)"):
        ql.restore(toy_model(int8_out=12), os.path.join(DATA, "v1_anchor_shared.pt"))  # a migrated v1 copy too


def test_grouped_state_into_a_plain_quantizer_raises():
    state = ql.quantizer_state(_calibrated())
    state["quantizers"]["experts.input_quantizer"] = {"type": "grouped", "members": [state["quantizers"]["experts.input_quantizer"]]}
    model = toy_model()
    with pytest.raises(ql.CheckpointError, match="experts.input_quantizer: saved as a grouped quantizer"):
        ql.restore_state(model, state)
    assert not any(isinstance(m, (ql.QuantModule, TensorQuantizer)) for m in model.modules())
