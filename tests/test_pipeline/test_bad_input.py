"""Bad input to ``quantlib quantize``: each refused in one line naming the thing and the fix, before the
work it would spoil, with nothing written at ``--out``."""

from __future__ import annotations

import errno
import json
import os

import pytest

pytest.importorskip("transformers")

import quantlib as ql  # noqa: E402
from quantlib.__main__ import main  # noqa: E402
from quantlib.export import safetensors_io  # noqa: E402
from quantlib.pipeline import PipelineError  # noqa: E402
from tests.test_pipeline._models import FAST, write_jsonl, write_text  # noqa: E402


def _refused(tmp_path, match: str, model=None, **kw) -> str:
    opts = dict(FAST, out=str(tmp_path / "out"))
    opts.update(kw)
    with pytest.raises(PipelineError, match=match) as info:
        ql.oneshot(None if model is None else str(model), **opts)
    msg = str(info.value)
    assert "\n" not in msg
    assert not (tmp_path / "out").exists()
    return msg


def test_directory_that_is_not_a_model(tmp_path):
    (tmp_path / "notes.txt").write_text("hello")
    _refused(tmp_path, "not a Hugging Face model directory \\(no config.json\\)", model=tmp_path)
    _refused(tmp_path, "no such directory", model=tmp_path / "missing")


def test_config_without_weights(tmp_path):
    d = tmp_path / "m"
    d.mkdir()
    (d / "config.json").write_text("{}")
    _refused(tmp_path, "no weights", model=d)


@pytest.mark.parametrize("marker", ["latest_checkpointed_iteration.txt", "iter_0000100/", "common.pt", "__0_0.distcp"])
def test_megatron_checkpoint_is_refused_by_name(tmp_path, marker):
    """A Megatron-Core checkpoint (its tracker file, an iteration folder, or a torch_dist folder) and a config.json
    beside it: one line naming the directory and what the command reads."""
    d = tmp_path / "mcore"
    (d / marker).parent.mkdir(parents=True, exist_ok=True)
    (d / marker).mkdir() if marker.endswith("/") else (d / marker).write_text("100")
    (d / "config.json").write_text("{}")
    msg = _refused(tmp_path, f"^--model {d}: a Megatron-Core checkpoint, which quantlib quantize does not read", model=d)
    assert "Hugging Face model directories (config.json and *.safetensors)" in msg and "export_megatron_checkpoint" in msg


def test_missing_tokenizer(disk, tmp_path):
    _refused(tmp_path, "no tokenizer that loads offline .*tokenizer.save_pretrained", model=disk["no_tok"], data=str(disk["text"]))


def test_jsonl_without_the_text_field(disk, tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", field="content")
    _refused(tmp_path, "line 1 has no text field 'text' .*--text-field", model=disk["llama"], data=str(path))


def test_fewer_tokens_than_asked(disk, tmp_path):
    short = write_text(tmp_path / "short.txt", n_bytes=100)
    msg = _refused(tmp_path, "fewer than the 128 the run needs", model=disk["llama"], data=str(short))
    assert "--num-samples" in msg


def test_data_that_is_neither_file_nor_cached_dataset(disk, tmp_path):
    _refused(tmp_path, "no_such_dataset_xyz", model=disk["llama"], data="no_such_dataset_xyz")


def test_recipe_no_format_carries(disk, tmp_path):
    _refused(
        tmp_path,
        "MXFP6_DEFAULT_CFG: no export format carries it by default; pass --export-format",
        model=disk["llama"],
        preset="MXFP6_DEFAULT_CFG",
    )
    _refused(tmp_path, "unknown export format 'fp3'", model=disk["llama"], export_format="fp3")


def test_format_the_recipe_cannot_export(disk, tmp_path):
    """INT8 weights into an FP8-block format: the export's own check refuses, naming the quantizer."""
    msg = _refused(
        tmp_path,
        "export hf_fp8_block: .*weight_quantizer",
        model=disk["llama"],
        data=str(disk["text"]),
        preset="INT8_WEIGHT_ONLY_CFG",
        export_format="hf_fp8_block",
    )
    assert "--export-format" in msg


def test_full_disk(disk, tmp_path, monkeypatch):
    def full(*a, **k):
        raise OSError(errno.ENOSPC, "No space left on device", "shard.tmp")

    monkeypatch.setattr(safetensors_io, "save_file", full)
    _refused(tmp_path, "no space left on the device .*--resume", model=disk["llama"], data=str(disk["text"]))


def test_bad_recipe_file_and_options(disk, tmp_path):
    bad = tmp_path / "r.json"
    bad.write_text(json.dumps({"quant_cfg": {"*weight_quantizer": {"num_bits": 8, "axes": 0}}, "algorithm": "max"}))
    _refused(tmp_path, "recipe r.json: .*axes", model=disk["llama"], config=str(bad))
    _refused(tmp_path, "--preset and --config both given", preset="INT8_DEFAULT_CFG", config=str(bad))
    _refused(tmp_path, "--preset NOPE: unknown", preset="NOPE")
    _refused(tmp_path, "--seq-len must be at least 1", seq_len=0)
    _refused(tmp_path, "--lm-eval-tasks: lm-eval-harness tasks are not run", lm_eval_tasks="hellaswag")
    _refused(tmp_path, "--resume: no unfinished run", model=disk["llama"], resume=True)


def test_out_not_empty(disk, tmp_path):
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "keep.txt").write_text("mine")
    with pytest.raises(PipelineError, match="exists and is not empty; pass --overwrite"):
        ql.oneshot(str(disk["llama"]), **dict(FAST, out=str(tmp_path / "out")))
    assert os.listdir(tmp_path / "out") == ["keep.txt"]


def test_yaml_recipe_in_modelopt_schema(disk, tmp_path):
    yaml = pytest.importorskip("yaml")
    path = tmp_path / "r.yaml"
    path.write_text(
        yaml.safe_dump(
            {
                "quant_cfg": {
                    "*weight_quantizer": {"num_bits": [4, 3], "block_sizes": {-1: 128, -2: 128}},
                    "*input_quantizer": {"enable": False},
                    "*lm_head*": {"enable": False},
                    "default": {"enable": False},
                },
                "algorithm": "max",
            },
            sort_keys=False,
        )
    )
    report = ql.oneshot(
        str(disk["llama"]), **dict(FAST, data=str(disk["text"]), config=str(path), export_format="hf_fp8_block", out=str(tmp_path / "out"))
    )
    assert report["recipe"] == "r.yaml" and report["check"]["passed"]


def test_cli_prints_one_line(disk, tmp_path, capsys):
    assert main(["quantize", "--model", str(tmp_path), "--quiet", "--out", str(tmp_path / "o")]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("quantlib quantize: error: --model")


def test_awq_pairs_the_export_cannot_carry(disk, tmp_path):
    """SmoothQuant / AWQ recipes refused by name, before calibrating, only where the format can neither fold nor carry."""
    yaml = pytest.importorskip("yaml")
    w4a16 = tmp_path / "w4a16_awq.yaml"
    w4a16.write_text(yaml.safe_dump({**ql.W4A16_NVFP4_CFG, "algorithm": "awq_lite"}, sort_keys=False))
    no_rows = ("awq_lite gives self_attn.o_proj a pre_quant_scale that ct_nvfp4 can hold only folded into self_attn.v_proj's output rows, "
               "whose nvfp4")
    for match, kw in (
        (no_rows, dict(preset="NVFP4_AWQ_LITE_CFG", export_format="ct_nvfp4")),
        ("INT4_AWQ_CFG: awq_lite gives self_attn.o_proj .*the KV cache is quantized", dict(preset="INT4_AWQ_CFG", kv_cache="fp8")),
        ("only ModelOpt's NVFP4_AWQ carries, and NVFP4_AWQ quantizes activations", dict(config=str(w4a16), export_format="modelopt_nvfp4")),
    ):
        _refused(tmp_path, match, model=disk["llama"], **kw)
    experts = "awq_lite gives the fused experts model.layers.0.mlp.experts one pre_quant_scale per expert"
    msg = _refused(tmp_path, experts, model=disk["qwen3_moe"], data=str(disk["text"]), preset="INT4_AWQ_CFG")
    assert "--exclude '*experts*'" in msg
