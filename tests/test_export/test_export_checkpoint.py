"""export_checkpoint: shards and index, config.json from the model's config, manifest, atomic writes,
overwrite; iter_packed: module by module, chunks by byte budget, shard ids and expert ids."""

from __future__ import annotations

import json
import os

import pytest
import torch
from torch import nn

import quantlib as ql
from quantlib.export import ExportError, export_checkpoint, iter_packed

FP8_BLOCK_W = {"quant_cfg": {"*weight_quantizer": {"num_bits": (4, 3), "block_sizes": {-1: 128, -2: 128}}, "default": {"enable": False}},
               "algorithm": "max"}


def mlp(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(256, 512), nn.GELU(), nn.Linear(512, 256), nn.LayerNorm(256))
    return ql.quantize(model, FP8_BLOCK_W)


def test_single_file_config_and_manifest(tmp_path):
    model = mlp()
    man = export_checkpoint(model, tmp_path / "c", "hf_fp8_block")
    assert sorted(os.listdir(tmp_path / "c")) == ["config.json", "model.safetensors"]
    assert man.files == ["model.safetensors", "config.json"] and man.num_bytes > 256 * 512 * 2
    assert man.quantized_modules == ["0", "2"] and man.unquantized_modules == ["3"]
    qc = json.loads((tmp_path / "c" / "config.json").read_text())["quantization_config"]
    assert qc["ignored_layers"] == ["3"] and qc["weight_block_size"] == [128, 128]


def test_shards_and_index(tmp_path):
    from safetensors.torch import load_file

    model = mlp()
    man = export_checkpoint(model, tmp_path / "c", "ct_fp8_block", max_shard_size=200_000)
    shards = [f for f in man.files if f.endswith(".safetensors")]
    assert len(shards) >= 2 and shards[0] == f"model-00001-of-{len(shards):05d}.safetensors"
    index = json.loads((tmp_path / "c" / "model.safetensors.index.json").read_text())
    keys = {k for f in shards for k in load_file(tmp_path / "c" / f)}
    assert set(index["weight_map"]) == keys and {"0.weight", "0.weight_scale", "0.bias", "3.weight"} <= keys
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for f in shards
                                                  for t in load_file(tmp_path / "c" / f).values())


def test_hf_config_is_the_base_of_config_json(tmp_path):
    export_checkpoint(mlp(), tmp_path / "c", "ct_fp8_block", hf_config={"model_type": "tiny", "hidden_size": 256})
    cfg = json.loads((tmp_path / "c" / "config.json").read_text())
    assert cfg["model_type"] == "tiny" and cfg["quantization_config"]["format"] == "float-quantized"


def test_failed_write_leaves_nothing_and_names_the_file(tmp_path, monkeypatch):
    from quantlib.export import safetensors_io

    calls = []

    def failing(tensors, path, metadata=None):
        calls.append(path)
        if len(calls) == 2:
            raise OSError(28, "No space left on device")
        return real(tensors, path, metadata=metadata)

    real = safetensors_io.save_file
    monkeypatch.setattr(safetensors_io, "save_file", failing)
    with pytest.raises(ExportError, match=r"writing .*shard-00001\.tmp: .*No space left"):
        export_checkpoint(mlp(), tmp_path / "c", "ct_fp8_block", max_shard_size=200_000)
    assert os.listdir(tmp_path) == []


def test_overwrite_replaces_whole_directory(tmp_path):
    out = tmp_path / "c"
    out.mkdir()
    (out / "stale.txt").write_text("old")
    with pytest.raises(ExportError, match="not empty; pass overwrite=True"):
        export_checkpoint(mlp(), out, "ct_fp8_block")
    assert os.listdir(out) == ["stale.txt"]
    export_checkpoint(mlp(), out, "ct_fp8_block", overwrite=True)
    assert sorted(os.listdir(out)) == ["config.json", "model.safetensors"] and sorted(os.listdir(tmp_path)) == ["c"]


def test_iter_packed_module_by_module_and_chunks():
    model = mlp()
    packed = list(iter_packed(model, "hf_fp8_block"))
    assert [(p.name, p.role) for p in packed] == [("0", "linear"), ("2", "linear"), ("3", "unquantized")]
    assert packed[0].tensors["weight"].dtype == torch.float8_e4m3fn and packed[0].tensors["bias"].dtype == torch.float32
    chunks = list(iter_packed(model, "hf_fp8_block", chunk_bytes=150_000))
    assert [[p.name for p in c] for c in chunks] == [["0"], ["2", "3"]]
    assert all(sum(p.nbytes for p in c) <= 150_000 or len(c) == 1 for c in chunks)


def test_shard_and_expert_ids_of_qwen3_moe():
    pytest.importorskip("transformers")
    from tests.test_export._export_models import quantized, qwen3_moe, weight_only

    model = quantized(qwen3_moe(), weight_only(ql.FP8_2D_BLOCKWISE_WEIGHT_ONLY_CFG))
    ids = {p.name: (p.role, p.expert, p.shard) for p in iter_packed(model, "hf_fp8_block")}
    assert ids["model.layers.0.self_attn.k_proj"] == ("linear", None, "k")
    assert ids["model.layers.1.mlp.experts.3.gate_proj"] == ("expert", 3, "w1")
    assert ids["model.layers.1.mlp.experts.3.up_proj"] == ("expert", 3, "w3")
    assert ids["model.layers.1.mlp.experts.0.down_proj"] == ("expert", 0, "w2")
    assert ids["model.layers.0.mlp.gate"][0] == "unquantized"
    assert not any(n.endswith("experts") for n in ids)  # never a fused 3-D expert tensor


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float8_e4m3fn, torch.uint8, torch.int8, torch.int32,
                                   torch.int64])
def test_safetensors_writer_read_by_safetensors(tmp_path, dtype):
    from safetensors import safe_open

    from quantlib.export import safetensors_io

    g = torch.Generator().manual_seed(0)
    tensors = {"a": (torch.randn(3, 5, generator=g) * 100).to(dtype), "scalar": torch.tensor(7).to(dtype),
               "empty": torch.zeros(0, 4, dtype=dtype), "col": torch.arange(6).reshape(2, 3).t().to(dtype)}
    safetensors_io.save_file(tensors, str(tmp_path / "x.safetensors"), metadata={"format": "pt"})
    with safe_open(str(tmp_path / "x.safetensors"), "pt") as f:
        assert f.metadata() == {"format": "pt"} and sorted(f.keys()) == sorted(tensors)
        for k, t in tensors.items():
            got = f.get_tensor(k)
            assert got.dtype == dtype and got.shape == t.shape and torch.equal(got.view(torch.uint8) if dtype == torch.float8_e4m3fn
                                                                               else got, t.contiguous().view(torch.uint8)
                                                                               if dtype == torch.float8_e4m3fn else t)


def test_fp8_block_packs_with_the_stored_amax_when_the_weight_changed():
    from quantlib.export.quantize import real_quantize
    from quantlib.formats import dequantize

    model = mlp()
    q = model[0].weight_quantizer
    with torch.no_grad():
        model[0].weight[:5].mul_(3.0)  # after calibration: the stored amax is no longer the weight's
    packed = real_quantize(model[0].weight.detach(), q.spec, q.amax)
    assert torch.equal(dequantize(packed, torch.float32), q(model[0].weight).float())
    assert not torch.equal(packed.scale, ql.kernels.fp8_blockwise_cast(model[0].weight.detach(), (128, 128))[1])


@pytest.mark.parametrize("axis", [None, 0, 1])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fp8_codes_equal_the_reference(axis, dtype):
    from quantlib.export.quantize import real_quantize
    from quantlib.formats import FormatSpec, Kind, quantize

    g = torch.Generator().manual_seed(0)
    w = (torch.randn(300, 700, generator=g) * 10).to(dtype)
    w[3, 5], w[7, 9] = float("inf"), float("nan")
    amax = torch.tensor(5.0) if axis is None else w.float().abs().nan_to_num(0, 0, 0).amax(dim=1 - axis, keepdim=True)
    spec = FormatSpec(Kind.FP8, element=(4, 3))
    ours, ref = real_quantize(w, spec, amax), quantize(w, spec, amax)
    assert torch.equal(ours.codes.view(torch.uint8), ref.codes.view(torch.uint8)) and torch.equal(ours.scale, ref.scale)


def test_static_scales_in_one_pass_equal_each_scale():
    from quantlib.export.quantize import static_scale, static_scales
    from quantlib.formats import FormatSpec, Kind

    g = torch.Generator().manual_seed(0)
    fp8 = FormatSpec(Kind.FP8, element=(4, 3))
    blk = FormatSpec(Kind.FP8_BLOCK, element=(4, 3), block=(128, 128), pow2=True)
    pairs = [(fp8, torch.rand((), generator=g)), (blk, torch.rand(2, 3, generator=g)), (fp8, torch.rand(5, 1, generator=g)),
             (blk, torch.zeros(1, 1)), (FormatSpec(Kind.INT, 8), torch.rand(()))]
    got = static_scales(pairs)
    assert got[-1] is None
    for (spec, amax), sc in zip(pairs[:-1], got[:-1]):
        assert torch.equal(sc, static_scale(amax, spec))
