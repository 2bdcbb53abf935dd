"""Quantizer checkpoints: save -> restore into a fresh model for every preset, weights-only files, atomic
writes, and every refused checkpoint (truncated, other model, wrong amax shape, newer schema...) leaving
the model untouched; model.state_dict() round trips between quantized models."""

from __future__ import annotations

import copy
import os

import pytest
import torch
from torch import nn

import quantlib as ql
from quantlib import CheckpointError
from quantlib.checkpoint import SCHEMA_VERSION
from quantlib.model_quant import iter_leaf_quantizers

KINDS = ["mlp", "conv"]


def snapshot(model: nn.Module) -> tuple:
    """Everything a failed restore must leave as it was: module classes and the full state_dict."""
    types = [(n, type(m)) for n, m in model.named_modules()]
    state = {k: v.clone() for k, v in model.state_dict().items()}
    return types, state


def assert_untouched(model: nn.Module, snap: tuple) -> None:
    types, state = snapshot(model)
    assert types == snap[0]
    assert list(state) == list(snap[1])
    assert all(torch.equal(state[k], snap[1][k]) for k in state)


def assert_same_quantizers(a: nn.Module, b: nn.Module) -> None:
    la, lb = list(iter_leaf_quantizers(a)), list(iter_leaf_quantizers(b))
    assert [n for n, _ in la] == [n for n, _ in lb]
    for (name, qa), (_, qb) in zip(la, lb):
        attrs_a, attrs_b = qa.attrs.to_dict(), qb.attrs.to_dict()
        del attrs_a["enable"], attrs_b["enable"]  # a toggled quantizer saves its state, not its config's
        assert (qa.is_enabled, attrs_a, qa.spec) == (qb.is_enabled, attrs_b, qb.spec), name
        assert (qa.amax is None) == (qb.amax is None), name
        if qa.amax is not None:
            assert torch.equal(qa.amax, qb.amax), name


@pytest.fixture
def quantized(make_model, make_data, make_loop):
    """``quantized(kind, preset_name)``: a model quantized with a preset on the shared data."""

    def build(kind: str = "mlp", name: str = "INT8_DEFAULT_CFG"):
        return ql.quantize(make_model(kind), ql.PRESETS[name], make_loop(make_data(kind)))

    return build


# ------------------------------------------------------------------------------------ round trips


@pytest.mark.parametrize("kind", KINDS)
def test_save_restore_into_a_fresh_model_gives_identical_outputs(kind, preset_name, quantized, make_model, make_data, tmp_path):
    model = quantized(kind, preset_name)
    path = tmp_path / "q.pt"
    ql.save(model, path)
    fresh = make_model(kind)
    weights = dict(fresh.named_parameters())
    restored = ql.restore(fresh, path)
    assert restored is fresh
    assert all(dict(restored.named_parameters())[n] is p for n, p in weights.items())
    assert_same_quantizers(model, restored)
    x = make_data(kind, 1, seed=11)[0]
    with torch.no_grad():
        assert torch.equal(restored(x), model(x))
        assert not torch.equal(restored(x), make_model(kind)(x))
    assert ql.quantizer_state(restored)["config"] == ql.quantizer_state(model)["config"]


def test_restore_into_a_root_module(tmp_path):
    torch.manual_seed(0)
    lin = ql.quantize(nn.Linear(64, 16), ql.NVFP4_DEFAULT_CFG, lambda m: m(torch.randn(4, 64)))
    ql.save(lin, tmp_path / "q.pt")
    torch.manual_seed(0)
    restored = ql.restore(nn.Linear(64, 16), tmp_path / "q.pt")
    x = torch.randn(3, 64)
    assert isinstance(restored, ql.QuantModule) and torch.equal(restored(x), lin(x))


def test_restore_into_an_already_quantized_model(quantized, make_data, tmp_path):
    src = quantized("conv", "W4A8_AWQ_BETA_CFG")
    ql.save(src, tmp_path / "q.pt")
    dst = quantized("conv", "MXFP4_DEFAULT_CFG")
    ql.restore(dst, tmp_path / "q.pt")
    assert_same_quantizers(src, dst)
    x = make_data("conv", 1, seed=4)[0]
    assert torch.equal(dst(x), src(x))


def test_restored_model_can_be_recalibrated(quantized, make_model, make_data, make_loop, tmp_path):
    src = quantized("mlp", "FP8_DEFAULT_CFG")
    ql.save(src, tmp_path / "q.pt")
    restored = ql.restore(make_model("mlp"), tmp_path / "q.pt")
    new_data = make_data("mlp", seed=8, scale=0.25)
    ql.calibrate(restored, "max", make_loop(new_data))
    assert torch.equal(restored.fc1.input_quantizer.amax, torch.stack([d.abs().amax() for d in new_data]).amax())


def test_grouped_quantizer_round_trip(two_experts, tmp_path):
    model = ql.quantize(nn.Sequential(two_experts()), ql.INT8_DEFAULT_CFG, lambda m: m(torch.randn(2, 8)))
    ql.save(model, tmp_path / "q.pt")
    state = torch.load(tmp_path / "q.pt", weights_only=True)
    assert state["quantizers"]["0.weight_quantizer"]["type"] == "grouped"
    restored = ql.restore(nn.Sequential(two_experts()), tmp_path / "q.pt")
    assert isinstance(restored[0].weight_quantizer, ql.GroupedQuantizer)
    assert_same_quantizers(model, restored)
    x = torch.randn(3, 8)
    assert torch.equal(restored[0](x, 1), model[0](x, 1)) and torch.equal(restored[0](x, 0), model[0](x, 0))


def test_grouped_quantizer_with_the_wrong_number_of_members_is_refused(two_experts):
    model = ql.quantize(nn.Sequential(two_experts()), ql.INT8_WEIGHT_ONLY_CFG, None)
    state = ql.quantizer_state(model)
    state["quantizers"]["0.weight_quantizer"]["members"].append(copy.deepcopy(state["quantizers"]["0.weight_quantizer"]["members"][0]))
    fresh = nn.Sequential(two_experts())
    snap = snapshot(fresh)
    with pytest.raises(CheckpointError, match=r"0\.weight_quantizer: checkpoint has 3 weight quantizer member\(s\), the module has 2"):
        ql.restore_state(fresh, state)
    assert_untouched(fresh, snap)


def test_checkpoint_file_is_weights_only_loadable(quantized, tmp_path):
    model = quantized("conv", "W4A8_AWQ_BETA_CFG")
    ql.save(model, tmp_path / "q.pt")
    state = torch.load(tmp_path / "q.pt", weights_only=True)
    assert state["schema"] == SCHEMA_VERSION
    assert set(state) == {"schema", "config", "quantizers"}
    assert sorted(state["quantizers"]) == sorted(n for n, _, _, _ in ql.model_quant.iter_quantizers(model))
    w = state["quantizers"]["conv1.weight_quantizer"]
    assert w["type"] == "sequential" and [m["attrs"]["num_bits"] for m in w["members"]] == [4, (4, 3)]
    assert torch.equal(w["members"][1]["_amax"], model.conv1.weight_quantizer[1].amax)


def test_save_is_atomic(quantized, tmp_path, monkeypatch):
    path = tmp_path / "q.pt"
    good = quantized("mlp", "INT8_DEFAULT_CFG")
    ql.save(good, path)
    before = path.read_bytes()

    def failing_save(obj, f, *args, **kwargs):
        f.write(b"partial garbage")
        raise OSError("disk full")

    monkeypatch.setattr(torch, "save", failing_save)
    with pytest.raises(OSError, match="disk full"):
        ql.save(quantized("mlp", "FP8_DEFAULT_CFG"), path)
    assert path.read_bytes() == before
    assert os.listdir(tmp_path) == ["q.pt"]  # no temporary file left behind


def test_saved_file_mode_follows_the_umask_like_torch_save(quantized, tmp_path):
    model = quantized("mlp", "FP8_DEFAULT_CFG")
    ql.save(model, tmp_path / "q.pt")
    torch.save({}, tmp_path / "plain.pt")
    assert os.stat(tmp_path / "q.pt").st_mode & 0o777 == os.stat(tmp_path / "plain.pt").st_mode & 0o777


def test_save_overwrites(quantized, make_model, tmp_path):
    path = tmp_path / "q.pt"
    ql.save(quantized("mlp", "INT8_DEFAULT_CFG"), path)
    fp8 = quantized("mlp", "FP8_DEFAULT_CFG")
    ql.save(fp8, path)
    assert_same_quantizers(fp8, ql.restore(make_model("mlp"), path))
    assert os.listdir(tmp_path) == ["q.pt"]


# ------------------------------------------------------------------------------------ refused checkpoints


@pytest.mark.parametrize("keep", [0, 10, 0.5, -20])
def test_truncated_file_is_refused_and_the_model_untouched(keep, quantized, make_model, tmp_path):
    path = tmp_path / "q.pt"
    ql.save(quantized("mlp", "NVFP4_DEFAULT_CFG"), path)
    data = path.read_bytes()
    n = int(len(data) * keep) if isinstance(keep, float) else (keep if keep >= 0 else len(data) + keep)
    path.write_bytes(data[:n])
    fresh = make_model("mlp")
    snap = snapshot(fresh)
    with pytest.raises(CheckpointError, match="truncated or corrupt"):
        ql.restore(fresh, path)
    assert_untouched(fresh, snap)


def test_a_file_that_is_not_a_checkpoint_is_refused(make_model, tmp_path):
    path = tmp_path / "weights.pt"
    torch.save(make_model("mlp").state_dict(), path)
    fresh = make_model("mlp")
    snap = snapshot(fresh)
    with pytest.raises(CheckpointError, match="'schema' and 'quantizers'"):
        ql.restore(fresh, path)
    assert_untouched(fresh, snap)


def test_missing_file_raises_file_not_found(make_model, tmp_path):
    with pytest.raises(FileNotFoundError):
        ql.restore(make_model("mlp"), tmp_path / "nope.pt")


def test_other_architecture_is_refused_and_the_model_untouched(quantized, make_model, tmp_path):
    path = tmp_path / "q.pt"
    ql.save(quantized("mlp", "INT8_DEFAULT_CFG"), path)
    fresh = make_model("conv")
    snap = snapshot(fresh)
    with pytest.raises(CheckpointError, match=r"does not match the model: 9 quantizer\(s\) missing .*6 unknown to the model.*fc1\."):
        ql.restore(fresh, path)
    assert_untouched(fresh, snap)


def test_other_width_is_refused_by_the_amax_shape(quantized, model_classes):
    state = ql.quantizer_state(quantized("mlp", "INT8_DEFAULT_CFG"))
    torch.manual_seed(0)
    wider = model_classes["mlp"](hidden=40).eval()
    snap = snapshot(wider)
    with pytest.raises(CheckpointError, match=r"fc1\.weight_quantizer: amax of shape \(48, 1\) does not fit weight \(40, 64\) \(expected "
                                              r"\(40, 1\)\)"):
        ql.restore_state(wider, state)
    assert_untouched(wider, snap)


def _tamper(state: dict, name: str, member=None, amax=None) -> dict:
    state = copy.deepcopy(state)
    entry = state["quantizers"][name]
    if member is not None:
        entry = entry["members"][member]
    entry["_amax"] = amax
    return state


TAMPERED_AMAX = {
    "per_channel_weight": ("INT8_DEFAULT_CFG", "fc2.weight_quantizer", None, torch.ones(48, 1), r"fc2\.weight_quantizer: amax of shape "
                                                                                                r"\(48, 1\)"),
    "per_channel_weight_transposed": ("INT8_DEFAULT_CFG", "fc1.weight_quantizer", None, torch.ones(1, 64),
                                      r"fc1\.weight_quantizer: amax of shape \(1, 64\)"),
    "block_weight": ("INT4_BLOCKWISE_WEIGHT_ONLY_CFG", "fc1.weight_quantizer", None, torch.ones(48, 2),
                     r"fc1\.weight_quantizer: amax of shape \(48, 2\)"),
    "sequential_member_0": ("W4A8_AWQ_BETA_CFG", "fc1.weight_quantizer", 0, torch.ones(48),
                            r"fc1\.weight_quantizer.*amax of shape \(48,\)"),
    "sequential_member_1": ("W4A8_AWQ_BETA_CFG", "fc1.weight_quantizer", 1, torch.ones(48, 1), r"fc1\.weight_quantizer.*amax of shape "
                                                                                               r"\(48, 1\)"),
    "per_tensor_input": ("INT8_DEFAULT_CFG", "fc1.input_quantizer", None, torch.ones(5), r"fc1\.input_quantizer: .*amax of shape \(5,\)"),
    "nvfp4_global": ("NVFP4_DEFAULT_CFG", "fc2.weight_quantizer", None, torch.ones(16, 3),
                     r"fc2\.weight_quantizer: amax of shape \(16, 3\)"),
    "not_a_tensor": ("INT8_DEFAULT_CFG", "fc1.input_quantizer", None, [1.0], r"fc1\.input_quantizer: _amax must be a tensor"),
}


@pytest.mark.parametrize("case", sorted(TAMPERED_AMAX))
def test_wrong_amax_shape_is_refused_and_the_model_untouched(case, quantized, make_model):
    name, qname, member, amax, message = TAMPERED_AMAX[case]
    state = _tamper(ql.quantizer_state(quantized("mlp", name)), qname, member, amax)
    fresh = make_model("mlp")
    snap = snapshot(fresh)
    with pytest.raises(CheckpointError, match=message):
        ql.restore_state(fresh, state)
    assert_untouched(fresh, snap)


def test_refused_restore_leaves_an_already_quantized_model_untouched(quantized):
    target = quantized("mlp", "FP8_DEFAULT_CFG")
    state = _tamper(ql.quantizer_state(quantized("mlp", "INT8_DEFAULT_CFG")), "fc2.weight_quantizer", None, torch.ones(3, 1))
    snap = snapshot(target)
    summary = ql.quant_summary(target)
    with pytest.raises(CheckpointError):
        ql.restore_state(target, state)
    assert_untouched(target, snap)
    assert ql.quant_summary(target) == summary


def _edit(state: dict, how: str) -> dict:
    state = copy.deepcopy(state)
    if how == "newer_schema":
        state["schema"] = SCHEMA_VERSION + 1
    elif how == "schema_zero":
        state["schema"] = 0
    elif how == "schema_string":
        state["schema"] = "1"
    elif how == "no_quantizers":
        del state["quantizers"]
    elif how == "quantizers_list":
        state["quantizers"] = list(state["quantizers"].values())
    elif how == "unknown_type":
        state["quantizers"]["fc1.input_quantizer"]["type"] = "rotating"
    elif how == "invalid_attrs":
        state["quantizers"]["fc2.input_quantizer"]["attrs"]["num_bits"] = 99
    elif how == "unknown_attr":
        state["quantizers"]["fc2.input_quantizer"]["attrs"]["learn_scale"] = True
    elif how == "empty_sequential":
        state["quantizers"]["fc1.weight_quantizer"] = {"type": "sequential", "members": []}
    elif how == "extra_quantizer":
        state["quantizers"]["fc3.weight_quantizer"] = copy.deepcopy(state["quantizers"]["fc1.weight_quantizer"])
    elif how == "missing_quantizer":
        del state["quantizers"]["fc2.output_quantizer"]
    elif how == "invalid_config":
        state["config"]["algorithm"] = "local_hessian"
    return state


EDITS = {
    "newer_schema": f"schema {SCHEMA_VERSION + 1} is newer than this quantlib",
    "schema_zero": "invalid schema version 0",
    "schema_string": "invalid schema version '1'",
    "no_quantizers": "'schema' and 'quantizers'",
    "quantizers_list": "'quantizers' must be a dict",
    "unknown_type": r"fc1\.input_quantizer: malformed quantizer state",
    "invalid_attrs": r"fc2\.input_quantizer: invalid attribute config: num_bits=99",
    "unknown_attr": r"fc2\.input_quantizer: invalid attribute config: unknown quantizer attribute 'learn_scale'",
    "empty_sequential": r"fc1\.weight_quantizer: a sequential quantizer with no members",
    "extra_quantizer": r"1 unknown to the model \['fc3\.weight_quantizer'\]",
    "missing_quantizer": r"1 quantizer\(s\) missing from it \['fc2\.output_quantizer'\]",
    "invalid_config": r"invalid config in the checkpoint: algorithm='local_hessian'",
}


@pytest.mark.parametrize("how", sorted(EDITS))
def test_mismatched_state_is_refused_and_the_model_untouched(how, quantized, make_model):
    state = _edit(ql.quantizer_state(quantized("mlp", "INT8_DEFAULT_CFG")), how)
    fresh = make_model("mlp")
    snap = snapshot(fresh)
    with pytest.raises(CheckpointError, match=EDITS[how]):
        ql.restore_state(fresh, state)
    assert_untouched(fresh, snap)


def test_missing_quantizer_is_accepted_when_not_strict(quantized, make_model):
    src = quantized("mlp", "INT8_DEFAULT_CFG")
    state = _edit(ql.quantizer_state(src), "missing_quantizer")
    restored = ql.restore_state(make_model("mlp"), state, strict=False)
    assert torch.equal(restored.fc1.input_quantizer.amax, src.fc1.input_quantizer.amax)


# ------------------------------------------------------------------------------------ model.state_dict()


@pytest.mark.parametrize("name", sorted(ql.PRESETS))
def test_model_state_dict_loads_into_another_quantized_model(name, make_model, make_data, make_loop):
    src = ql.quantize(make_model("mlp"), ql.PRESETS[name], make_loop(make_data("mlp")))
    other = ql.quantize(make_model("mlp", seed=5), ql.PRESETS[name], make_loop(make_data("mlp", seed=6, scale=3.0)))
    x = make_data("mlp", 1, seed=12)[0]
    other.load_state_dict(src.state_dict())
    assert torch.equal(other(x), src(x))
    # also into a converted and configured model that was never calibrated: the amax buffers appear
    blank = ql.convert(make_model("mlp", seed=5))
    ql.set_quantizer_by_cfg(blank, ql.PRESETS[name])
    blank.load_state_dict(src.state_dict())
    assert_same_quantizers(src, blank)
    assert torch.equal(blank(x), src(x))


def test_model_state_dict_holds_the_amax_buffers(quantized):
    sd = quantized("mlp", "W4A8_AWQ_BETA_CFG").state_dict()
    amax_keys = sorted(k for k in sd if k.endswith("_amax"))
    assert amax_keys == [
        "fc1.input_quantizer._amax",
        "fc1.weight_quantizer.0._amax",
        "fc1.weight_quantizer.1._amax",
        "fc2.input_quantizer._amax",
        "fc2.weight_quantizer.0._amax",
        "fc2.weight_quantizer.1._amax",
    ]
    assert tuple(sd["fc1.weight_quantizer.0._amax"].shape) == (48, 1)
