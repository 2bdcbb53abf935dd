"""The demo's last step: export its model and load the export back with compressed-tensors, or say that
compressed-tensors is missing and still export."""

from __future__ import annotations

import sys

import pytest

from quantlib import demo


def _loop(model):
    for batch in demo.calibration_data(2):
        model(batch)


def test_demo_export_loads_back_with_compressed_tensors(capsys):
    pytest.importorskip("compressed_tensors")
    assert demo.export_demo(_loop)
    out = capsys.readouterr().out
    assert "exported 4 FP8-block linears" in out and "compressed-tensors decompressed 4 weights: identical" in out


def test_demo_export_without_compressed_tensors(capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "compressed_tensors", None)  # import fails as if not installed
    monkeypatch.setitem(sys.modules, "compressed_tensors.compressors", None)
    assert demo.export_demo(_loop)
    out = capsys.readouterr().out
    assert "exported 4 FP8-block linears" in out and "compressed-tensors is not installed: skipped" in out
