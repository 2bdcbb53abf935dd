"""What export does with its output directory (permissions, symlinks), its arguments, and a model whose
layers wait in an offload folder: nothing refused that the README's flows produce, nothing half-written."""

from __future__ import annotations

import copy
import os
import stat

import pytest
import torch
from torch import nn

import quantlib as ql
from quantlib.export import ExportError, export_checkpoint

FP8_BLOCK_W = {"quant_cfg": {"*weight_quantizer": {"num_bits": (4, 3), "block_sizes": {-1: 128, -2: 128}}, "default": {"enable": False}},
               "algorithm": "max"}


def mlp() -> nn.Module:
    torch.manual_seed(0)
    return ql.quantize(nn.Sequential(nn.Linear(256, 256), nn.GELU(), nn.Linear(256, 256)), FP8_BLOCK_W)


def _files(path) -> dict[str, bytes]:
    return {f: open(os.path.join(path, f), "rb").read() for f in sorted(os.listdir(path))}


@pytest.mark.parametrize("umask", [0o022, 0o002, 0o077])
def test_directory_mode_follows_the_umask(tmp_path, umask):
    old = os.umask(umask)
    try:
        export_checkpoint(mlp(), tmp_path / "out", "hf_fp8_block")
    finally:
        os.umask(old)
    assert stat.S_IMODE(os.stat(tmp_path / "out").st_mode) == 0o777 & ~umask  # mkdtemp alone gives 0o700
    for f in os.listdir(tmp_path / "out"):
        assert stat.S_IMODE(os.stat(tmp_path / "out" / f).st_mode) == 0o666 & ~umask, f


def test_overwrite_through_a_symlink_replaces_its_target(tmp_path):
    target = tmp_path / "exports" / "v1"
    target.parent.mkdir()
    export_checkpoint(mlp(), target, "hf_fp8_block")
    (tmp_path / "current").symlink_to(target, target_is_directory=True)
    model = mlp()
    with torch.no_grad():
        model[0].weight.mul_(2)
    ql.calibrate(model)
    man = export_checkpoint(model, tmp_path / "current", "hf_fp8_block", overwrite=True)
    assert os.path.islink(tmp_path / "current") and os.readlink(tmp_path / "current") == str(target)
    assert sorted(os.listdir(tmp_path)) == ["current", "exports"] and os.listdir(tmp_path / "exports") == ["v1"]  # no .old, no .tmp left
    fresh = tmp_path / "fresh"
    export_checkpoint(model, fresh, "hf_fp8_block")
    assert _files(target) == _files(fresh)  # the new export sits in the link's target
    assert man.out_dir == str(tmp_path / "current")


def test_symlink_to_nothing_gets_its_target(tmp_path):
    (tmp_path / "link").symlink_to(tmp_path / "gone", target_is_directory=True)
    export_checkpoint(mlp(), tmp_path / "link", "hf_fp8_block")
    assert os.path.islink(tmp_path / "link") and sorted(os.listdir(tmp_path / "gone")) == ["config.json", "model.safetensors"]


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"max_shard_size": 1e9}, r"max_shard_size=1000000000\.0 \(float\): expected an int of bytes or a size such as '5GB'"),
        ({"max_shard_size": "lots"}, r"max_shard_size='lots': expected an int"),
        ({"max_shard_size": "GB"}, r"max_shard_size='GB': expected an int"),
        ({"max_shard_size": 0}, r"max_shard_size=0: must be positive"),
        ({"max_shard_size": "-1GB"}, r"max_shard_size='-1GB': must be positive"),
        ({"max_shard_size": True}, r"max_shard_size=True \(bool\)"),
        ({"tp": "2"}, r"tp='2': expected a tensor-parallel degree, an int >= 1"),
        ({"tp": 0}, r"tp=0: expected a tensor-parallel degree"),
        ({"tp": 2.0}, r"tp=2\.0: expected"),
        ({"hf_config": "llama"}, r"hf_config='llama' \(str\): expected a transformers PretrainedConfig or a dict"),
        ({"overwrite": "yes"}, r"overwrite='yes': expected True or False"),
        ({"unify_siblings": 1}, r"unify_siblings=1: expected True or False"),
        ({"progress": "auto"}, r"progress='auto': expected None"),
        ({"layout": "llama"}, r"layout='llama': expected a quantlib.export.ModelLayout"),
    ],
)
def test_bad_arguments_refused_by_name(tmp_path, kwargs, match):
    with pytest.raises(ExportError, match=match):
        export_checkpoint(mlp(), tmp_path / "out", "hf_fp8_block", **kwargs)
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize(
    "fn, kwargs, match",
    [
        ("iter_packed", {"tp": "2"}, r"tp='2': expected a tensor-parallel degree, an int >= 1"),
        ("iter_packed", {"tp": 0}, r"tp=0: expected a tensor-parallel degree"),
        ("iter_packed", {"tp": 2, "tp_rank": 5}, r"tp_rank=5: expected None or a rank of tp=2, an int in \[0, 2\)"),
        ("iter_packed", {"tp": 2, "tp_rank": "0"}, r"tp_rank='0': expected None or a rank"),
        ("iter_packed", {"layout": "llama"}, r"layout='llama': expected a quantlib.export.ModelLayout"),
        ("iter_packed", {"unify_siblings": "yes"}, r"unify_siblings='yes': expected True or False"),
        ("sync_pairs", {"tp": "2"}, r"tp='2': expected a tensor-parallel degree"),
        ("serialize_weight", {"global_amax": "1"}, r"^0.weight: global_amax='1' \(str\): expected a tensor"),
    ],
)
def test_bad_arguments_of_the_iterators_refused_by_name(fn, kwargs, match):
    # the in-memory paths take the same arguments as export_checkpoint and refuse them alike (before: raw TypeError /
    # AttributeError, or accepted: tp=0, tp=2.0, a tp_rank outside the degree)
    import quantlib.export as qe

    model = mlp()
    with pytest.raises(ExportError, match=match):
        if fn == "serialize_weight":
            list(qe.serialize_weight("0.weight", model[0].weight, model[0], "hf_fp8_block", **kwargs))
        else:
            list(getattr(qe, fn)(model, "hf_fp8_block", **kwargs))


def _llama():
    pytest.importorskip("transformers")
    from tests.test_export._export_models import llama

    return llama()


def test_offloaded_model_exports_layer_by_layer(tmp_path):
    """The README's large-model flow (offload_to_disk, then sequential calibration) leaves the layers on
    meta; export reads them back from the folder one at a time and writes what the in-memory model gives."""
    from quantlib.calib.sequential import SequentialOptions, offload_to_disk
    from tests.test_export._export_models import tokens

    base = _llama()
    ids = tokens(5)
    cfg = copy.deepcopy(ql.FP8_2D_BLOCKWISE_WEIGHT_ONLY_CFG)
    cfg["quant_cfg"]["*lm_head*"] = {"enable": False}
    in_memory = ql.quantize(copy.deepcopy(base), cfg, lambda m: m(ids))
    export_checkpoint(in_memory, tmp_path / "ref", "hf_fp8_block")

    model = copy.deepcopy(base)
    offload_to_disk(model, str(tmp_path / "layers"))
    ql.quantize(model, cfg, lambda m: m(ids), sequential=SequentialOptions(offload_folder=str(tmp_path / "layers")))
    assert model.model.layers[0].self_attn.q_proj.weight.is_meta
    with pytest.raises(ExportError, match=r"^model\.layers\.0\.self_attn\.q_proj \(and \d+ more module\(s\)\) hold tensors on the meta "
                                          r"device; pass offload_folder="):
        export_checkpoint(model, tmp_path / "out", "hf_fp8_block")
    assert not (tmp_path / "out").exists()
    loads = []
    real = torch.load
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(torch, "load", lambda *a, **k: loads.append(os.path.basename(a[0])) or real(*a, **k))
        export_checkpoint(model, tmp_path / "out", "hf_fp8_block", offload_folder=str(tmp_path / "layers"))
    assert loads == ["model.layers.0.pt", "model.layers.1.pt"]  # each layer read once, in turn
    assert _files(tmp_path / "out") == _files(tmp_path / "ref")
    assert all(p.is_meta for p in model.model.layers.parameters())  # back where they were


def test_offloaded_model_with_a_missing_layer_file(tmp_path):
    from quantlib.calib.sequential import SequentialOptions, offload_to_disk
    from tests.test_export._export_models import tokens

    model = _llama()
    ids = tokens(5)
    offload_to_disk(model, str(tmp_path / "layers"))
    ql.quantize(model, ql.FP8_2D_BLOCKWISE_WEIGHT_ONLY_CFG, lambda m: m(ids),
                sequential=SequentialOptions(offload_folder=str(tmp_path / "layers")))
    ql.disable_quantizer(model, "*lm_head*")
    os.remove(tmp_path / "layers" / "model.layers.1.pt")
    with pytest.raises(ExportError, match=r"^model\.layers\.1: cannot read it from the offload folder .*layers"):
        export_checkpoint(model, tmp_path / "out", "hf_fp8_block", offload_folder=str(tmp_path / "layers"))
    assert sorted(os.listdir(tmp_path)) == ["layers"]  # nothing half-written
    assert all(p.is_meta for p in model.model.layers.parameters())


def test_config_names_the_architecture(tmp_path):
    """A model built from its config has ``architectures: None``; vLLM then loads a pooling model (no lm_head)."""
    import json

    model = _llama()
    assert not model.config.architectures
    cfg = copy.deepcopy(ql.FP8_2D_BLOCKWISE_WEIGHT_ONLY_CFG)
    cfg["quant_cfg"]["*lm_head*"] = {"enable": False}
    export_checkpoint(ql.quantize(model, cfg), tmp_path / "c", "hf_fp8_block")
    assert json.loads((tmp_path / "c" / "config.json").read_text())["architectures"] == ["LlamaForCausalLM"]
    assert model.config.architectures is None  # the model's own config is left as it was
