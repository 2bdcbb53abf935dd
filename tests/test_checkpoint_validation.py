"""Checkpoints that restore must refuse, naming the quantizer, the key and the value, leaving the model
untouched: NaN / Inf / negative amax, a changed bit anywhere in the file (CRC-32), an axis that does not
fit the weight; and what must still load (zero amax, files without checksums, the golden files). Saving
through a symlink writes the link's target and keeps the link."""

from __future__ import annotations

import copy
import os
import struct
import zipfile

import pytest
import torch
from torch.utils.serialization import config as serialization_config

import quantlib as ql
from quantlib import CheckpointError
from quantlib.checkpoint import load_state, verify_checksums
from quantlib.model_quant import iter_leaf_quantizers

DATA = os.path.join(os.path.dirname(__file__), "data")


def snapshot(model):
    return [(n, type(m)) for n, m in model.named_modules()], {k: v.clone() for k, v in model.state_dict().items()}


def assert_untouched(model, snap) -> None:
    types, state = snapshot(model)
    assert types == snap[0] and list(state) == list(snap[1])
    assert all(torch.equal(state[k], snap[1][k]) for k in state)


@pytest.fixture
def int8_model(make_model, make_data, make_loop):
    return ql.quantize(make_model("mlp"), ql.INT8_DEFAULT_CFG, make_loop(make_data("mlp")))


def with_amax(state: dict, qname: str, amax: torch.Tensor) -> dict:
    state = copy.deepcopy(state)
    state["quantizers"][qname]["_amax"] = amax
    return state


# ------------------------------------------------------------------------------------ amax values

BAD_AMAX = {
    "nan": (float("nan"), "nan"),
    "inf": (float("inf"), "inf"),
    "minus_inf": (float("-inf"), "-inf"),
    "negative": (-1.5, "-1.5"),
    "float64_overflowing_fp32": (1e300, "inf"),
}


@pytest.mark.parametrize("case", sorted(BAD_AMAX))
def test_bad_per_tensor_amax_is_refused_naming_quantizer_key_and_value(case, int8_model, make_model):
    value, shown = BAD_AMAX[case]
    dtype = torch.float64 if case.startswith("float64") else torch.float32
    state = with_amax(ql.quantizer_state(int8_model), "fc2.input_quantizer", torch.tensor(value, dtype=dtype))
    fresh = make_model("mlp")
    snap = snapshot(fresh)
    with pytest.raises(CheckpointError, match=rf"fc2\.input_quantizer: _amax = {shown} \(1 of 1 value"):
        ql.checkpoint.restore_state(fresh, state)
    assert_untouched(fresh, snap)


def test_one_bad_channel_of_a_per_channel_amax_is_refused_with_its_index(int8_model, make_model):
    amax = int8_model.fc1.weight_quantizer.amax.clone()
    amax[7, 0] = float("nan")
    amax[9, 0] = -2.0
    state = with_amax(ql.quantizer_state(int8_model), "fc1.weight_quantizer", amax)
    with pytest.raises(CheckpointError, match=r"fc1\.weight_quantizer: _amax\[7, 0\] = nan \(2 of 48 value"):
        ql.checkpoint.restore_state(make_model("mlp"), state)


def test_bad_amax_of_a_sequential_member_names_the_member(make_model, make_data, make_loop):
    model = ql.quantize(make_model("mlp"), ql.W4A8_AWQ_BETA_CFG, make_loop(make_data("mlp")))
    state = copy.deepcopy(ql.quantizer_state(model))
    state["quantizers"]["fc2.weight_quantizer"]["members"][1]["_amax"] = torch.tensor(float("inf"))
    with pytest.raises(CheckpointError, match=r"fc2\.weight_quantizer\.1: _amax = inf"):
        ql.checkpoint.restore_state(make_model("mlp"), state)


NO_VALUES = [torch.tensor(1, dtype=torch.int32), torch.tensor(True), torch.empty((), device="meta")]


@pytest.mark.parametrize("amax", NO_VALUES, ids=["int", "bool", "meta"])
def test_amax_that_is_no_float_with_values_is_refused(amax, int8_model, make_model):
    state = with_amax(ql.quantizer_state(int8_model), "fc1.input_quantizer", amax)
    with pytest.raises(CheckpointError, match=r"fc1\.input_quantizer: _amax must be a floating-point tensor with values"):
        ql.checkpoint.restore_state(make_model("mlp"), state)


def test_zero_amax_restores_for_every_format_and_never_gives_nan(preset_name, make_model, make_data, make_loop):
    """Zero is what calibration gives for all-zero data (a pruned channel, a zero-initialised weight);
    docs/design.md §3 defines it for every format, never as NaN."""
    model = ql.quantize(make_model("mlp"), ql.PRESETS[preset_name], make_loop(make_data("mlp")))
    state = copy.deepcopy(ql.quantizer_state(model))

    def zero(qs):
        if qs["type"] == "tensor":
            if qs["_amax"] is not None:
                qs["_amax"] = torch.zeros_like(qs["_amax"])
        else:
            for m in qs["members"]:
                zero(m)

    for qs in state["quantizers"].values():
        zero(qs)
    restored = ql.checkpoint.restore_state(make_model("mlp"), state)
    assert all(bool((q.amax == 0).all()) for _, q in iter_leaf_quantizers(restored) if q.amax is not None)
    with torch.no_grad():
        assert bool(torch.isfinite(restored(make_data("mlp", 1, seed=11)[0])).all())


# ------------------------------------------------------------------------------------ checksums


def flip_bit(path, record_suffix: str, byte: int, bit: int) -> None:
    """Flip one bit of the data of the zip record whose name ends with ``record_suffix``."""
    with zipfile.ZipFile(path) as archive:
        info = next(i for i in archive.infolist() if i.filename.endswith(record_suffix))
    with open(path, "r+b") as f:
        f.seek(info.header_offset + 26)
        name_len, extra_len = struct.unpack("<HH", f.read(4))
        f.seek(info.header_offset + 30 + name_len + extra_len + byte)
        value = f.read(1)[0]
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([value ^ (1 << bit)]))


def amax_record(path, amax: torch.Tensor) -> str:
    """Name of the record holding the bytes of ``amax`` (a scalar) in a saved checkpoint."""
    raw = amax.numpy().tobytes()
    with zipfile.ZipFile(path) as archive:
        return next(i.filename for i in archive.infolist() if "/data/" in i.filename and archive.read(i.filename) == raw)


def test_flipped_bit_in_an_amax_is_refused_by_its_crc(int8_model, make_model, tmp_path):
    path = tmp_path / "q.pt"
    ql.save(int8_model, path)
    record = amax_record(path, int8_model.fc2.input_quantizer.amax)
    flip_bit(path, record, byte=3, bit=1)  # the exponent: amax x 4 or / 4, still finite and positive
    assert torch.load(path, weights_only=True)["quantizers"]["fc2.input_quantizer"]["_amax"] != int8_model.fc2.input_quantizer.amax
    fresh = make_model("mlp")
    snap = snapshot(fresh)
    with pytest.raises(CheckpointError, match=rf"record '{record}' does not match its CRC-32 checksum"):
        ql.restore(fresh, path)
    assert_untouched(fresh, snap)


def test_flipped_bit_in_the_pickled_config_is_refused(int8_model, tmp_path):
    path = tmp_path / "q.pt"
    ql.save(int8_model, path)
    flip_bit(path, "data.pkl", byte=200, bit=0)
    with pytest.raises(CheckpointError, match=r"data\.pkl' does not match its CRC-32"):
        load_state(path)


def test_save_writes_checksums_even_when_torch_is_told_not_to(int8_model, tmp_path):
    with serialization_config.patch({"save.compute_crc32": False}):
        ql.save(int8_model, tmp_path / "q.pt")
    with zipfile.ZipFile(tmp_path / "q.pt") as archive:
        assert all(i.CRC != 0 for i in archive.infolist())


def test_file_without_checksums_still_loads(int8_model, make_model, tmp_path):
    path = tmp_path / "q.pt"
    with serialization_config.patch({"save.compute_crc32": False}):
        torch.save(ql.quantizer_state(int8_model), path)
    verify_checksums(path)  # all CRC fields zero: nothing to check
    restored = ql.restore(make_model("mlp"), path)
    assert torch.equal(restored.fc1.input_quantizer.amax, int8_model.fc1.input_quantizer.amax)


def test_legacy_non_zip_file_still_loads(int8_model, make_model, tmp_path):
    path = tmp_path / "q.pt"
    torch.save(ql.quantizer_state(int8_model), path, _use_new_zipfile_serialization=False)
    restored = ql.restore(make_model("mlp"), path)
    assert torch.equal(restored.fc2.weight_quantizer.amax, int8_model.fc2.weight_quantizer.amax)


@pytest.mark.parametrize("name", ["v1_anchor_shared.pt", "v1_grouped_members.pt", "v1_toy_weights.pt"])
def test_golden_files_pass_the_checksum_check(name):
    verify_checksums(os.path.join(DATA, name))


# ------------------------------------------------------------------------------------ axis


def test_out_of_range_axis_is_refused_naming_quantizer_key_and_value(int8_model, make_model):
    state = copy.deepcopy(ql.quantizer_state(int8_model))
    entry = state["quantizers"]["fc1.weight_quantizer"]
    entry["attrs"]["axis"], entry["_amax"] = 5, None
    fresh = make_model("mlp")
    snap = snapshot(fresh)
    with pytest.raises(CheckpointError, match=r"fc1\.weight_quantizer: axis=\(5,\) does not fit a tensor of shape \(48, 64\)"):
        ql.checkpoint.restore_state(fresh, state)
    assert_untouched(fresh, snap)


def test_out_of_range_axis_of_a_disabled_quantizer_restores(int8_model, make_model):
    state = copy.deepcopy(ql.quantizer_state(int8_model))
    entry = state["quantizers"]["fc1.weight_quantizer"]
    entry["attrs"]["axis"], entry["attrs"]["enable"], entry["_amax"] = 5, False, None
    restored = ql.checkpoint.restore_state(make_model("mlp"), state)
    assert not restored.fc1.weight_quantizer.is_enabled


# ------------------------------------------------------------------------------------ symlinks


def test_save_through_a_symlink_writes_its_target_and_keeps_the_link(int8_model, make_model, tmp_path):
    (tmp_path / "store").mkdir()
    target = tmp_path / "store" / "q.pt"
    target.write_bytes(b"old")
    link = tmp_path / "latest.pt"
    link.symlink_to(os.path.join("store", "q.pt"))
    ql.save(int8_model, link)
    assert link.is_symlink() and os.readlink(link) == os.path.join("store", "q.pt")
    assert sorted(p.name for p in (tmp_path / "store").iterdir()) == ["q.pt"]  # no temp file left
    restored = ql.restore(make_model("mlp"), target)
    assert torch.equal(restored.fc1.input_quantizer.amax, int8_model.fc1.input_quantizer.amax)


def test_save_through_a_dangling_symlink_creates_its_target(int8_model, tmp_path):
    link = tmp_path / "latest.pt"
    link.symlink_to(tmp_path / "new.pt")
    ql.save(int8_model, link)
    assert link.is_symlink() and (tmp_path / "new.pt").is_file()
