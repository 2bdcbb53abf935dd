"""A pipeline run parses its recipe once: the typed config from ``resolve_recipe`` serves the up-front refusals,
``quantize`` and the report (each used to parse the dict again)."""

from __future__ import annotations

import pytest

pytest.importorskip("transformers")

import quantlib as ql  # noqa: E402
from quantlib.config import QuantizeConfig  # noqa: E402
from tests.test_pipeline._models import FAST  # noqa: E402


def test_a_run_parses_its_config_once(disk, tmp_path, monkeypatch):
    parses = []
    real = QuantizeConfig.__post_init__

    def counting(self):
        parses.append(self)
        real(self)

    monkeypatch.setattr(QuantizeConfig, "__post_init__", counting)
    report = ql.oneshot(str(disk["qwen3"]), **dict(FAST, data=str(disk["text"]), out=str(tmp_path / "out"), preset="INT8_SMOOTHQUANT_CFG",
                                                   export_format="none"))
    assert report["algorithm"] == "smoothquant"
    assert len(parses) == 1
