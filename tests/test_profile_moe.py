"""benchmarks/profile_moe.py runs on the CPU (a tiny layer): the profiler's tables of both layers and, with ``--host``,
the Python profile of each layer's eval forward, where the quantized layer's own functions show."""

from __future__ import annotations

import pytest

pytest.importorskip("transformers", reason="needs transformers (pip install quantlib[transformers])")

from tests._scripts import load_benchmark  # noqa: E402


def test_host_profile_names_the_quantized_forward(capsys):
    bench = load_benchmark("profile_moe")
    bench.SHAPES = [(4, 32, 16)]
    bench.main(["--device", "cpu", "--experts", "4", "--tokens", "8", "--top-k", "2", "--preset", "INT4-block", "--rows", "60",
                "--host"])
    out = capsys.readouterr().out
    assert out.count("Python profile of the eval forward") == 2, out
    quantized = out.split("### quantlib INT4-block, Python profile of the eval forward")[1]
    assert "50 calls" in quantized and "hf_experts.py" in quantized and "_grouped_forward" in quantized, quantized
    assert "Self CPU" in out
