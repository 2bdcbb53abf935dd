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


def test_trace_writes_the_profiled_sync_and_the_timeline_finds_the_waits(tmp_path):
    """``--profile --trace DIR`` writes one Chrome trace a format (host ops alone on the CPU); ``timeline`` reads a
    trace's kernels: the wait before the first kernel and the gaps between kernels, overlapping kernels counted once."""
    import json

    bench = load_benchmark("bench_export")
    with pytest.raises(SystemExit):
        bench.parse(["--trace", str(tmp_path)])  # without --profile
    bench.main(["--device", "cpu", "--small", "--runs", "1", "--no-modelopt", "--formats", "fp8_block", "--profile", "--trace",
                str(tmp_path / "t")])
    events = json.loads((tmp_path / "t" / "sync_fp8_block.json").read_text())["traceEvents"]
    assert any(e.get("cat") == "cpu_op" for e in events)
    assert bench.timeline(str(tmp_path / "t" / "sync_fp8_block.json")) is None  # no kernel on the CPU
    op = {"ph": "X", "cat": "cpu_op", "name": "aten::empty", "ts": 100.0, "dur": 5.0}
    kernels = [("a", 150.0, 100.0), ("b", 200.0, 10.0), ("c", 300.0, 50.0)]  # b inside a; c after a 50 us gap
    trace = tmp_path / "synthetic.json"
    events = [op] + [{"ph": "X", "cat": "kernel", "name": n, "ts": t, "dur": d} for n, t, d in kernels]
    trace.write_text(json.dumps({"traceEvents": events}))
    assert bench.timeline(str(trace)) == ("0.250 ms from the first host op to the last kernel's end: kernels busy 0.150 ms, 0.050 ms "
                                          "before the first kernel, 1 gaps between kernels of 0.050 ms (widest 50.0 us, before c)")
