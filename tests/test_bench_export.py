"""The export benchmark (benchmarks/bench_export.py) runs end to end on the CPU with a tiny Llama."""

from __future__ import annotations

import re

import pytest

from ._scripts import load_benchmark

pytest.importorskip("transformers")


def test_small_cpu_run_times_every_format_against_the_copy(tmp_path):
    out = tmp_path / "r.md"
    rows = load_benchmark("bench_export").main(["--device", "cpu", "--small", "--runs", "1", "--no-modelopt", "--out", str(out)])
    names = [r[0] for r in rows]
    assert names[0].startswith("bf16 copy")
    for label in ("FP8 128x128", "MXFP8", "FP8 per tensor"):
        assert any(n.startswith(label) and "iter_packed (memory)" in n for n in names), names
    assert all(t > 0 and gbs > 0 for _, t, gbs, _, _ in rows)
    assert "| what | ms | GB/s of bf16 weights | of the copy |" in out.read_text()


def test_folded_awq_export_timed_against_the_same_model_without_pre_quant_scale(capsys):
    rows = load_benchmark("bench_export").main(["--device", "cpu", "--small", "--runs", "1", "--formats", "int4_awq"])
    names = [r[0] for r in rows]
    assert any(n.startswith("INT4 AWQ") and n.endswith("folded): quantlib iter_packed (memory)") for n in names), names
    assert any(n.startswith("INT4 AWQ") and "without pre_quant_scale, quantlib iter_packed" in n for n in names), names
    assert not any("ModelOpt" in n for n in names)
    # issue #27: a folded AWQ export costs at most one extra pass over the weights (each weight times its scale, once)
    out = capsys.readouterr().out
    m = re.search(r"extra traffic on weight-sized tensors: ([\d.-]+)x the bf16 weight bytes read, ([\d.-]+)x written", out)
    assert m is not None and 0.95 <= float(m.group(1)) <= 1.05 and 0.95 <= float(m.group(2)) <= 1.05, m and m.groups()


def test_small_moe_run_reports_the_stacked_sync(tmp_path):
    """``--model moe``: a Qwen3-MoE whose 3-D experts are packed; the copy counts them (expert weights dominate)."""
    bench = load_benchmark("bench_export")
    args = bench.parse(["--device", "cpu", "--small", "--model", "moe"])
    model = bench.build(args.hidden, args.intermediate, args.layers, args.heads, args.kv_heads, args.vocab, "cpu", args.experts,
                        args.moe_intermediate)
    weights = bench.linear_weights(model)
    assert sum(w.dim() == 3 for w in weights) == 2 * args.layers  # gate_up_proj and down_proj of every layer
    assert sum(w.numel() for w in weights if w.dim() == 3) > sum(w.numel() for w in weights if w.dim() == 2)
    out = tmp_path / "r.md"
    rows = bench.main(["--device", "cpu", "--small", "--model", "moe", "--runs", "1", "--no-modelopt", "--formats", "fp8_block",
                       "--out", str(out)])
    assert any("sync_pairs" in r[0] for r in rows)
    assert "Qwen3-MoE hidden 256, 8 experts of 128" in out.read_text()


def test_llama_refuses_expert_options():
    with pytest.raises(SystemExit):
        load_benchmark("bench_export").parse(["--experts", "4"])


def test_a_run_cut_short_has_printed_every_row_it_measured(capsys, monkeypatch):
    """A lent GPU's time limit kills a run mid-way: the rows measured before (the first recipe's, the second
    recipe's quantlib rows before its ModelOpt part) are on stdout already."""
    bench = load_benchmark("bench_export")

    def modelopt_is_killed(*args, **kwargs):
        raise KeyboardInterrupt("the time limit")

    monkeypatch.setattr(bench, "modelopt_quantized", modelopt_is_killed)
    with pytest.raises(KeyboardInterrupt):
        bench.main(["--device", "cpu", "--small", "--runs", "1", "--formats", "fp8_block,mxfp8"])
    out = capsys.readouterr().out
    assert re.search(r"^\| bf16 copy of every packed weight \(clone\) \| [\d.]+ \|", out, re.M), out
    assert re.search(r"^\| FP8 128x128 .*: quantlib sync_pairs, scales from the weights \(memory\) \| [\d.]+ \|", out, re.M), out
