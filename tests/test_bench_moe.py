"""benchmarks/bench_moe.py runs on the CPU end to end (tiny layers): every column of the unquantized layer and of
quantlib's, the host time within the synchronised time, the CUDA-graph column NaN off CUDA, and the table."""

from __future__ import annotations

import json
import math

import pytest

pytest.importorskip("transformers", reason="needs transformers (pip install quantlib[transformers])")

from tests._scripts import load_benchmark  # noqa: E402

COLUMNS = {"fwd", "fwd_host", "fwd_graph", "fwd_w", "fwd_qat", "fwd_bwd"}


def test_small_run_reports_every_column(tmp_path, capsys):
    bench = load_benchmark("bench_moe")
    bench.SMALL_SHAPES = [(4, 32, 16)]
    out = tmp_path / "moe.json"
    rows = bench.main(["--small", "--device", "cpu", "--tokens", "8", "--top-k", "2", "--reps", "2", "--presets", "FP8", "INT4-block",
                       "--no-modelopt", "--json", str(out)])  # fmt: skip
    assert [r["preset"] for r in rows] == ["FP8", "INT4-block"]
    for r in rows:
        for side in ("unquantized", "quantlib"):
            assert set(r[side]) == COLUMNS, (side, r)
            assert 0 < r[side]["fwd_host"] <= r[side]["fwd"]
            assert math.isnan(r[side]["fwd_graph"])  # no CUDA: nothing captured
    assert rows[1]["quantlib"]["fwd_w"] == rows[1]["quantlib"]["fwd"]  # weight-only: its own forward
    assert json.loads(out.read_text())["rows"][0]["preset"] == "FP8"
    table = capsys.readouterr().out
    assert "its host time ms" in table and "| 4 | 32 | 16 | FP8 (eager) |" in table
