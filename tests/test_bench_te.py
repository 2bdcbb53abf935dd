"""bench_te's ``--clipped-ste`` config rewrite (the benchmark itself needs a GPU and TE)."""

from __future__ import annotations

import copy

import pytest

import quantlib as ql
from quantlib.config import QuantizeConfig

from ._scripts import load_benchmark

bt = load_benchmark("bench_te")


def _attrs(cfg: dict) -> list:
    entries = QuantizeConfig.from_any(cfg).quant_cfg
    return [a for e in entries if e.attrs is not None for a in (e.attrs if isinstance(e.attrs, list) else [e.attrs])]


@pytest.mark.parametrize("preset", ["FP8_DEFAULT_CFG", "W4A8_AWQ_BETA_CFG"])
def test_clipped_sets_every_quantizing_entry_and_leaves_toggles(preset):
    cfg = copy.deepcopy(getattr(ql, preset))
    assert all(a.pass_through_bwd for a in _attrs(cfg))
    out = bt.clipped(copy.deepcopy(cfg))
    assert _attrs(out) and all(a.pass_through_bwd is False for a in _attrs(out))
    toggles = {k: v for k, v in cfg["quant_cfg"].items() if v == {"enable": False}}
    assert toggles and all(out["quant_cfg"][k] == v for k, v in toggles.items())


def test_clipped_on_modelopts_list_form():
    mtq = pytest.importorskip("modelopt.torch.quantization")
    out = bt.clipped(copy.deepcopy(mtq.FP8_DEFAULT_CFG))
    cfgs = [e["cfg"] for e in out["quant_cfg"] if e.get("cfg") is not None]
    assert cfgs and all(c["pass_through_bwd"] is False for c in cfgs if set(c) - {"enable"})
    assert {"quantizer_name": "*", "enable": False} in out["quant_cfg"]
