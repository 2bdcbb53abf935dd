"""benchmarks/bench_sync_host.py runs on the CPU (the tiny Llama): one line per format with the sync's host time (casts
stubbed), its time with the real casts and its aten ops, a steady sync's (the plan kept between calls)."""

from __future__ import annotations

import re

import pytest
import torch

pytest.importorskip("transformers")

from tests._scripts import load_benchmark  # noqa: E402


def test_llama_run_prints_host_time_and_ops(capsys):
    threads = torch.get_num_threads()
    try:
        load_benchmark("bench_sync_host").main(["--model", "llama", "--formats", "fp8_block", "--runs", "2", "--repeats", "1"])
    finally:
        torch.set_num_threads(threads)
    out = capsys.readouterr().out
    m = re.search(r"^llama fp8_block: host ms ([\d.]+) .*sync ms \(real casts\) ([\d.]+); aten ops (\d+):", out, re.M)
    assert m is not None, out
    assert float(m.group(1)) > 0 and float(m.group(2)) > 0
    assert 0 < int(m.group(3)) <= 60, out  # 49 on 2026-12-07 (70 before the plan was kept between syncs)


def test_moe_run_prints_the_host_time_before_the_first_expert_stack(capsys):
    """The tiny Qwen3-MoE: the host work from the call to its first expert stack's cast (what a GPU waits for before its
    first large kernel) is printed, and is a part of the sync's host time."""
    threads = torch.get_num_threads()
    try:
        load_benchmark("bench_sync_host").main(["--formats", "mxfp8", "--runs", "2", "--repeats", "1"])
    finally:
        torch.set_num_threads(threads)
    out = capsys.readouterr().out
    m = re.search(r"^moe mxfp8: host ms ([\d.]+) .*; to the first expert stack's cast ms ([\d.]+); sync ms", out, re.M)
    assert m is not None, out
    assert 0 < float(m.group(2)) < float(m.group(1))
