"""``quantlib.oneshot`` / ``quantlib quantize`` end to end on tiny transformers models written to disk (Llama,
Qwen3, Qwen3-MoE): every preset family exported, reloaded by its consumer and checked; layer-by-layer
calibration equal to in-memory; resume after a crash and after Ctrl-C; the CLI equal to the function."""

from __future__ import annotations

import json
import os

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("compressed_tensors")

import quantlib as ql  # noqa: E402
from quantlib.__main__ import main  # noqa: E402
from quantlib.calib import sequential as seq_mod  # noqa: E402
from quantlib.pipeline import run as run_mod  # noqa: E402
from quantlib.pipeline.run import Interrupted  # noqa: E402
from tests.test_pipeline._models import FAST  # noqa: E402


def _run(disk, tmp_path, family="llama", **kw):
    tmp_path.mkdir(parents=True, exist_ok=True)
    opts = dict(FAST, data=str(disk["text"]), out=str(tmp_path / "out"))
    opts.update(kw)
    return ql.oneshot(str(disk[family]), **opts)


# one model per preset family, each with the format its consumer reloads on the CPU
@pytest.mark.parametrize(
    "preset, fmt, family",
    [
        ("FP8_2D_BLOCKWISE_WEIGHT_ONLY_CFG", "hf_fp8_block", "qwen3_moe"),
        ("INT8_DEFAULT_CFG", "ct_int8", "qwen3"),
        ("FP8_DEFAULT_CFG", "modelopt_fp8", "llama"),
        ("NVFP4_DEFAULT_CFG", "ct_nvfp4", "qwen3_moe"),
        ("INT4_BLOCKWISE_WEIGHT_ONLY_CFG", "ct_int_pack", "llama"),
        ("MXFP8_DEFAULT_CFG", "hf_mxfp8", "qwen3"),
    ],
)
def test_preset_exported_reloaded_and_checked(disk, tmp_path, preset, fmt, family):
    report = _run(disk, tmp_path, family, preset=preset, data=str(disk["jsonl"]))
    out = tmp_path / "out"
    assert report["export"]["format"] == fmt and report["check"]["passed"] is True
    assert {"config.json", "report.json", "report.html", "tokenizer.json"} <= set(os.listdir(out))
    assert not (tmp_path / "out.partial").exists()
    assert json.loads((out / "report.json").read_text())["perplexity"] == report["perplexity"]
    ppl = report["perplexity"]
    assert set(ppl) == {"before", "after", "reloaded"} and all(v["perplexity"] > 1 and v["stderr"] > 0 for v in ppl.values())
    assert report["coverage"]["silent_share"] == 0 and report["effective_bits"] > 4
    assert report["size_bytes"]["after"] < report["size_bytes"]["before"]
    n_linear = {"llama": 14, "qwen3": 14, "qwen3_moe": 8 + 2 * 3 * 4}[family]
    assert len(report["layer_errors"]) == n_linear and all(0 < e["rel_error"] < 0.5 for e in report["layer_errors"])
    assert "<svg" in (out / "report.html").read_text()


#: awq_lite searching 3 alphas instead of the presets' 11 (the tests check the export of the scales, not the search)
FAST_AWQ = '{"method": "awq_lite", "alpha_step": 0.5}'


# SmoothQuant / AWQ: pre_quant_scale shared among siblings, then folded into the norms and v_proj / up_proj rows
# (compressed-tensors) or carried (ModelOpt NVFP4_AWQ, W4A16_AWQ); the consumer's weights checked with the scales applied
@pytest.mark.parametrize(
    "family, preset, algorithm, fmt",
    [
        ("llama", "INT4_AWQ_CFG", FAST_AWQ, "ct_int_pack"),
        ("qwen3", "INT8_SMOOTHQUANT_CFG", None, "ct_int8"),
        ("qwen3", "INT4_BLOCKWISE_WEIGHT_ONLY_CFG", '{"method": "awq_full", "alpha_step": 0.5}', "ct_int_pack"),
        ("llama", "NVFP4_AWQ_LITE_CFG", FAST_AWQ, "modelopt_nvfp4"),
        ("qwen3", "INT4_AWQ_CFG", FAST_AWQ, "modelopt_int4_awq"),
    ],
    ids=["int4-awq-lite-llama", "int8-smoothquant-qwen3", "int4-awq-full-qwen3", "nvfp4-awq-lite-llama", "w4a16-awq-qwen3"],
)
def test_awq_and_smoothquant_exported_and_checked(disk, tmp_path, family, preset, algorithm, fmt):
    kw = dict(algorithm=algorithm) if algorithm else {}
    report = _run(
        disk, tmp_path, family, preset=preset, export_format=None if fmt in ("ct_int_pack", "ct_int8", "modelopt_nvfp4") else fmt, **kw
    )
    assert report["export"]["format"] == fmt and report["check"]["passed"] is True, report["check"]
    # 14 linears, 4 norms that took q/k/v's and gate/up's shared scale; rows of v_proj / up_proj, or columns where carried
    assert report["check"]["summary"].startswith(f"{report['check']['consumer']}: 18 weights")
    assert "scaled by a pre_quant_scale" in report["check"]["summary"]
    norm = _tensor(tmp_path / "out", "model.layers.0.input_layernorm.weight")
    assert not torch.equal(norm, _tensor(disk[family], "model.layers.0.input_layernorm.weight"))  # the fold is in the export
    carried = [k for k in _keys(tmp_path / "out") if k.endswith("pre_quant_scale")]
    assert bool(carried) == (fmt == "modelopt_nvfp4")  # NVFP4 rows take no scale: o_proj / down_proj carry theirs; INT4 rows do
    if preset != "NVFP4_AWQ_LITE_CFG":  # weight-only (or W8A8 whose reload runs without activation quantization)
        assert report["perplexity"]["reloaded"]["perplexity"] > 1


def _keys(d) -> list[str]:
    from safetensors import safe_open

    with safe_open(str(d / "model.safetensors"), "pt") as f:
        return list(f.keys())


def _tensor(d, key: str) -> torch.Tensor:
    from safetensors import safe_open

    with safe_open(str(d / "model.safetensors"), "pt") as f:
        return f.get_tensor(key)


def test_check_catches_a_scale_the_export_did_not_fold(disk, tmp_path, monkeypatch):
    """The check compares the consumer's norms and rows with the scaled ones: an export that drops the fold fails it."""
    from quantlib.export import fold

    monkeypatch.setattr(fold, "times_rows", lambda get, p: get)  # the export writes norms and rows unscaled
    with pytest.raises(
        ql.pipeline.PipelineError,
        match=r"check: .* differently from the fake-quantized model .*model.layers.0.input_layernorm.weight \(a folded",
    ):
        _run(disk, tmp_path, "qwen3", preset="INT8_SMOOTHQUANT_CFG")
    assert not (tmp_path / "out").exists()


def test_awq_resumes_with_its_scales_and_layer_by_layer(disk, tmp_path, monkeypatch):
    """Ctrl-C after layer-by-layer SmoothQuant: --resume restores the pre_quant_scales (the export folds them again)."""
    real = run_mod.export_checkpoint
    monkeypatch.setattr(run_mod, "export_checkpoint", lambda *a, **k: (_ for _ in ()).throw(KeyboardInterrupt))
    with pytest.raises(Interrupted):
        _run(disk, tmp_path, "qwen3", preset="INT8_SMOOTHQUANT_CFG", sequential="on")
    monkeypatch.setattr(run_mod, "export_checkpoint", real)
    report = _run(disk, tmp_path, "qwen3", preset="INT8_SMOOTHQUANT_CFG", sequential="on", resume=True)
    assert report["sequential"] and "calibrate (restored)" in report["stage_seconds"] and report["check"]["passed"]
    assert "scaled by a pre_quant_scale" in report["check"]["summary"]


def test_evaluates_without_export(disk, tmp_path):
    report = _run(disk, tmp_path, preset="INT4_BLOCKWISE_WEIGHT_ONLY_CFG", export_format="none")
    assert report["check"]["passed"] is None and report["perplexity"].keys() == {"before", "after"}
    assert sorted(os.listdir(tmp_path / "out")) == ["report.html", "report.json"]


def test_sequential_equals_in_memory(disk, tmp_path):
    a = _run(disk, tmp_path / "a", "qwen3_moe", preset="NVFP4_DEFAULT_CFG", sequential="off")
    b = _run(disk, tmp_path / "b", "qwen3_moe", preset="NVFP4_DEFAULT_CFG", sequential="on")
    assert not a["sequential"] and b["sequential"]
    assert a["perplexity"] == b["perplexity"] and a["layer_errors"] == b["layer_errors"]
    assert _files(tmp_path / "a" / "out") == _files(tmp_path / "b" / "out")


def _files(d) -> dict[str, bytes]:
    return {f: (d / f).read_bytes() for f in sorted(os.listdir(d)) if f.endswith(".safetensors")}


def test_resume_after_a_crash_in_layer_calibration(disk, tmp_path, monkeypatch):
    expected = _run(disk, tmp_path / "ref", preset="INT8_DEFAULT_CFG", sequential="on")
    real = seq_mod._calibrate_layer

    def crash_on_layer_1(model, driver, idx, *args):
        if idx == 1:
            raise RuntimeError("simulated crash")
        return real(model, driver, idx, *args)

    monkeypatch.setattr(seq_mod, "_calibrate_layer", crash_on_layer_1)
    with pytest.raises(RuntimeError, match="simulated crash"):
        _run(disk, tmp_path, preset="INT8_DEFAULT_CFG", sequential="on")
    assert not (tmp_path / "out").exists() and (tmp_path / "out.partial" / "calib.resume").exists()
    monkeypatch.setattr(seq_mod, "_calibrate_layer", real)
    calls = []
    monkeypatch.setattr(seq_mod, "_calibrate_layer", lambda model, driver, idx, *a: calls.append(idx) or real(model, driver, idx, *a))
    resumed = _run(disk, tmp_path, preset="INT8_DEFAULT_CFG", sequential="on", resume=True)
    assert calls == [1]  # layer 0 was not calibrated again
    assert resumed["perplexity"] == expected["perplexity"] and resumed["layer_errors"] == expected["layer_errors"]
    assert _files(tmp_path / "out") == _files(tmp_path / "ref" / "out")


def test_ctrl_c_leaves_nothing_at_out_and_resume_finishes(disk, tmp_path, monkeypatch):
    real = run_mod.export_checkpoint

    def interrupt(*a, **k):
        raise KeyboardInterrupt

    monkeypatch.setattr(run_mod, "export_checkpoint", interrupt)
    with pytest.raises(Interrupted, match="--resume"):
        _run(disk, tmp_path)
    assert not (tmp_path / "out").exists() and (tmp_path / "out.partial" / "quantizer_state.pt").exists()
    monkeypatch.setattr(run_mod, "export_checkpoint", real)
    report = _run(disk, tmp_path, resume=True)
    assert "calibrate (restored)" in report["stage_seconds"] and report["check"]["passed"]
    assert not (tmp_path / "out.partial").exists()


def _cli(model, data, out, *flags: str) -> dict:
    """``quantlib quantize`` with the small run's sizes and ``flags``; its report.json."""
    sizes = ["--num-samples", "2", "--eval-samples", "2", "--seq-len", "32", "--batch-size", "2"]
    assert main(["quantize", "--model", str(model), "--data", str(data), *flags, *sizes, "--out", str(out), "--quiet"]) == 0
    return json.loads((out / "report.json").read_text())


def test_cli_equals_function(disk, tmp_path, capsys):
    flags = ["--preset", "MXFP8_DEFAULT_CFG", "--export-format", "ct_mxfp8", "--exclude", "*layers.1.mlp*"]
    by_cli = _cli(disk["llama"], disk["text"], tmp_path / "cli", *flags)
    by_fn = ql.oneshot(
        str(disk["llama"]),
        **dict(
            FAST,
            data=str(disk["text"]),
            preset="MXFP8_DEFAULT_CFG",
            export_format="ct_mxfp8",
            exclude=["*layers.1.mlp*"],
            out=str(tmp_path / "fn"),
        ),
    )
    for key in ("perplexity", "layer_errors", "modules", "coverage", "effective_bits", "check"):
        assert by_cli[key] == json.loads(json.dumps(by_fn[key])), key
    assert not any("layers.1.mlp" in e["module"] for e in by_fn["layer_errors"])
    assert _files(tmp_path / "cli") == _files(tmp_path / "fn")


def test_embedded_default_runs_offline(tmp_path, capsys):
    """No --model, no --data: the shipped model on its shipped text (the README's first command, smaller)."""
    report = ql.oneshot(out=str(tmp_path / "out"), num_samples=2, eval_samples=2, seq_len=64, batch_size=2, progress=True)
    assert report["model"].startswith("embedded") and report["check"]["passed"]
    assert report["perplexity"]["after"]["perplexity"] < 20  # a trained model on real text (bytes: 272-way)
    printed = capsys.readouterr()
    assert "perplexity reloaded" in printed.out and "calibrate" in printed.err
    assert torch.tensor(report["perplexity"]["before"]["perplexity"]) < 20


def test_cli_modelopt_config_file_with_smoothquant(disk, tmp_path):
    """A ModelOpt-schema YAML recipe whose algorithm is SmoothQuant, from the command line, into compressed-tensors INT8."""
    yaml = pytest.importorskip("yaml")
    recipe = tmp_path / "sq.yaml"
    recipe.write_text(yaml.safe_dump({**ql.INT8_DEFAULT_CFG, "algorithm": {"method": "smoothquant", "alpha": 0.5}}, sort_keys=False))
    report = _cli(disk["llama"], disk["text"], tmp_path / "cli", "--config", str(recipe), "--export-format", "ct_int8")
    assert (
        report["algorithm"] == "smoothquant" and report["check"]["passed"] and "scaled by a pre_quant_scale" in report["check"]["summary"]
    )


def test_cli_algorithm_awq_clip(disk, tmp_path):
    """--algorithm awq_clip searches clip ratios only: no pre_quant_scale, the plain INT4 export and check."""
    report = _cli(disk["qwen3"], disk["jsonl"], tmp_path / "o", "--preset", "INT4_BLOCKWISE_WEIGHT_ONLY_CFG", "--algorithm", "awq_clip")
    assert report["algorithm"] == "awq_clip" and report["check"]["passed"] and "pre_quant_scale" not in report["check"]["summary"]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("sequential", ["off", "on"])
def test_on_cuda_equals_the_check(disk, tmp_path, sequential):
    """--device cuda: calibration, the pre_quant_scale share (its static input amax pass) and evaluation on the GPU,
    in one piece or layer by layer; the export reloaded on the CPU and checked against the GPU's fake-quantized weights."""
    for preset, kw in (("INT8_SMOOTHQUANT_CFG", {}), ("NVFP4_DEFAULT_CFG", {}), ("INT4_AWQ_CFG", {"algorithm": FAST_AWQ})):
        report = _run(disk, tmp_path / preset, "qwen3", preset=preset, device="cuda", sequential=sequential, **kw)
        assert report["check"]["passed"] is True and report["sequential"] == (sequential == "on"), report["check"]
