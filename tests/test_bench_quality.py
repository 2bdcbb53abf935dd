"""The quality benchmark (benchmarks/bench_quality.py): its models train deterministically and load
from the cache, its summary computes the difference from max per calibration draw, and one quick row
runs on the cached trained models with quantlib next to ModelOpt."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from ._scripts import load_benchmark

bq = load_benchmark("bench_quality")
qm = bq.qm


def _tiny() -> torch.nn.Module:
    return qm.DenseLM(dim=32, layers=1, heads=2, hidden=64)


def test_training_is_deterministic_and_the_cache_round_trips(tmp_path, monkeypatch):
    # one thread: what is tested is the seeding; MKL's multi-threaded GEMM need not split its sums the
    # same way twice in a loaded process (this test failed once in a loaded `-n 2` run at 2 threads)
    monkeypatch.setattr(qm, "THREADS", 1)
    a = qm.load_or_train(_tiny, str(tmp_path / "a.pt"), steps=2)
    b = qm.load_or_train(_tiny, str(tmp_path / "b.pt"), steps=2)
    cached = qm.load_or_train(_tiny, str(tmp_path / "a.pt"), steps=2)
    untrained = (torch.manual_seed(0), _tiny())[1]
    for (name, p), q, r, _ in zip(a.state_dict().items(), b.state_dict().values(), cached.state_dict().values(),
                                  untrained.state_dict().values()):
        assert torch.equal(p, q) and torch.equal(p, r), name
    assert any(not torch.equal(p, u) for p, u in zip(a.state_dict().values(), untrained.state_dict().values()))


def test_corpus_holds_out_the_tail():
    train, held = qm.corpus()
    assert abs(train.numel() - 9 * held.numel()) <= 9 and held.numel() > 100_000 and int(train.max()) < qm.VOCAB


def test_held_out_windows_cover_the_text_without_overlap():
    text = torch.arange(10 * qm.CTX)
    w = qm.spaced_windows(text, 9)
    assert w.shape == (9, qm.CTX + 1) and int(w[0, 0]) == 0 and int(w[-1, -1]) == text.numel() - 1
    assert bool((w[1:, 0] - w[:-1, 0] >= qm.CTX).all())  # the inputs of consecutive windows are disjoint


def test_static_variant_sweeps_static_weight_blocks_only():
    ours, mo = bq.configs("W4A16_NVFP4_CFG:static", "mse_fp8_sweep")
    assert ours["algorithm"] == {"method": "mse", "fp8_scale_sweep": True}
    entries = ours["quant_cfg"] if isinstance(ours["quant_cfg"], list) else [{"quantizer_name": k, "cfg": v}
                                                                             for k, v in ours["quant_cfg"].items()]
    types = {e["quantizer_name"]: e["cfg"]["block_sizes"]["type"] for e in entries if isinstance(e.get("cfg"), dict)
             and "block_sizes" in e["cfg"]}
    assert types == {"*weight_quantizer": "static"}
    assert bq.configs("W4A16_NVFP4_CFG", "mse")[0]["algorithm"] == {"method": "mse"}
    if mo is not None:  # the library's preset itself is left dynamic
        import modelopt.torch.quantization as mtq

        assert "'dynamic'" in repr(mtq.W4A16_NVFP4_CFG) and mo["algorithm"] == ours["algorithm"]
    torch.manual_seed(0)
    model, data = _tiny().eval(), [torch.randint(0, qm.VOCAB, (2, 16))]
    q = {a: bq._calibrate(bq.ql.quantize, model, bq.configs("W4A16_NVFP4_CFG:static", a)[0], data)[0] for a in ("max", "mse_fp8_sweep")}
    blocks = {a: m.layers[0].mlp.down_proj.weight_quantizer.block_amax for a, m in q.items()}
    assert blocks["max"] is not None and not torch.equal(blocks["max"], blocks["mse_fp8_sweep"])


def test_summary_compares_each_draw_with_its_own_max():
    def rec(algo, seed, ppl):
        return {"model": "m", "preset": "P", "algorithm": algo, "lib": "quantlib", "seed": seed, "ppl": ppl, "kl": 0.001,
                "calib_s": 1.0 + seed}

    rows = bq.summarize([rec("max", 0, 10.0), rec("max", 1, 20.0), rec("awq_lite", 0, 9.9), rec("awq_lite", 1, 19.6)])
    awq = next(r for r in rows if r["algorithm"] == "awq_lite")
    assert awq["vs_max_pct"] == pytest.approx(-1.5) and awq["vs_max_std"] == pytest.approx(math.sqrt(0.5))
    assert awq["ppl"] == pytest.approx(14.75) and awq["calib_s"] == 1.0
    assert "vs_max_pct" not in next(r for r in rows if r["algorithm"] == "max")
    assert "-1.50 ± 0.71" in bq.table(rows)


@pytest.mark.slow
def test_quick_rows_run_on_the_cached_models():
    pytest.importorskip("transformers")
    torch.set_num_threads(2)
    for name in ("dense", "moe"):
        assert Path(qm.DENSE_WEIGHTS if name == "dense" else qm.MOE_WEIGHTS).is_file(), "cached weights ship with the repository"
        records = bq.run_model(name, [("INT4_AWQ_CFG", ["max"])], seeds=1, batches=1, device="cpu", windows=4, retrain=False)
        by = {(r["preset"], r["lib"]): r for r in records}
        fp32, int4 = by[("fp32", "torch")], by[("INT4_AWQ_CFG", "quantlib")]
        assert fp32["ppl"] < 12, "the cached model is trained (an untrained byte model has ppl ~256)"
        assert int4["kl"] > 0 and math.isfinite(int4["ppl"])
        if ("INT4_AWQ_CFG", "modelopt") in by:  # same config and data: ModelOpt's max gives the same model
            assert by[("INT4_AWQ_CFG", "modelopt")]["ppl"] == pytest.approx(int4["ppl"], rel=5e-3)


def test_paired_error_is_the_standard_error_of_the_per_window_difference():
    base = torch.tensor([1.0, 2.0, 3.0, 4.0], dtype=torch.float64)
    out = bq.paired(base + torch.tensor([-0.01, -0.03, 0.01, -0.01], dtype=torch.float64), base)
    assert out["se_pct"] == pytest.approx(100 * 0.016329931618554522 / 2) and out["windows_better"] == 3 and out["windows"] == 4
    rec = lambda algo, se: {"model": "m", "preset": "P", "algorithm": algo, "lib": "quantlib", "seed": 0, "ppl": 1.0,  # noqa: E731
                            "kl": 0.0, "se_pct": se, "windows_better": 3, "windows": 4}
    row = next(r for r in bq.summarize([rec("max", 0.0), rec("mse", 0.5)]) if r["algorithm"] == "mse")
    assert row["se_pct"] == 0.5 and row["windows_better"] == "3/4" and "| 0.50 | 3/4 |" in bq.table([row])


def test_op_count_counts_the_calibrations_aten_ops():
    model = _tiny()
    data = [torch.randint(0, 256, (2, 16))]
    max_ops = bq.count_ops(bq.ql.quantize, model, {"quant_cfg": {"*weight_quantizer": {"num_bits": 8, "axis": 0}}, "algorithm": "max"},
                           data)
    awq_ops = bq.count_ops(bq.ql.quantize, model, {"quant_cfg": {"*weight_quantizer": {"num_bits": 4, "block_sizes": {-1: 16}}},
                                                   "algorithm": "awq_lite"}, data)
    assert 0 < max_ops < awq_ops  # the search runs the layers again per alpha
    def rec(lib, ops):
        return {"model": "m", "preset": "P", "algorithm": "max", "lib": lib, "seed": 0, "ppl": 1.0, "kl": 0.0, "ops": ops}

    assert "| m | P | max | 30 | 120 | 0.25 |" in bq.ops_table(bq.summarize([rec("quantlib", 30), rec("modelopt", 120)]))
    assert bq.ops_table(bq.summarize([{k: v for k, v in rec("quantlib", 1).items() if k != "ops"}])) == ""


def test_gpu_calibration_is_timed_to_its_end(monkeypatch):
    # CUDA kernels run after the call returns: the clock must stop after a synchronize, not at the return
    events: list[str] = []

    class _Cuda:
        is_cuda = True

    monkeypatch.setattr(bq.torch.cuda, "synchronize", lambda *a: events.append("sync"))
    bq._calibrate(lambda m, c, loop: events.append("quantize") or m, torch.nn.Linear(2, 2), {}, [_Cuda()])
    assert events == ["sync", "quantize", "sync"]
