"""``quantlib.oneshot`` with AWQ on fused MoE experts (one pre_quant_scale per expert) end to end: ModelOpt's INT4_AWQ
export carries each expert's own scale, and the check reloads the experts under the family's checkpoint names (Mixtral's
``block_sparse_moe.experts.{e}.w1``) and compares every expert weight with the carried scale applied."""

from __future__ import annotations

import pytest

pytest.importorskip("transformers")
pytest.importorskip("compressed_tensors")

import quantlib as ql  # noqa: E402
from tests.test_pipeline._models import FAST, write_model  # noqa: E402
from tests.test_pipeline.test_run import FAST_AWQ, _keys  # noqa: E402


@pytest.mark.parametrize("family", ["mixtral", "qwen3_moe"])
def test_experts_awq_exported_and_checked(disk, tmp_path, family):
    model_dir = disk[family] if family in disk else write_model(tmp_path, family)
    opts = dict(FAST, data=str(disk["text"]), out=str(tmp_path / "out"), preset="INT4_AWQ_CFG", algorithm=FAST_AWQ,
                export_format="modelopt_int4_awq")
    report = ql.oneshot(str(model_dir), **opts)
    assert report["export"]["format"] == "modelopt_int4_awq" and report["check"]["passed"] is True, report["check"]
    # 2 layers: 4 attention linears + 4 experts x (gate, up, down) each, every expert weight scaled by its carried scale
    assert report["check"]["summary"].startswith(f"{report['check']['consumer']}: ")
    carried = [k for k in _keys(tmp_path / "out") if ".experts." in k and k.endswith("pre_quant_scale")]
    leaf = "w1" if family == "mixtral" else "gate_proj"
    assert len(carried) == 2 * 4 * 3 and any(k.endswith(f".experts.3.{leaf}.pre_quant_scale") for k in carried)
    assert report["perplexity"]["reloaded"]["perplexity"] > 1


def test_experts_down_scale_folded_and_checked(disk, tmp_path):
    """gate/up excluded, down_proj AWQ'd: compressed-tensors (no pre_quant_scale) takes each expert's down scale in its up
    rows, and the check compares those rows (unquantized: a slice of the fused tensor, no module) with the scaled ones."""
    model_dir = write_model(tmp_path, "mixtral")
    opts = dict(FAST, data=str(disk["text"]), out=str(tmp_path / "out"), preset="INT4_AWQ_CFG", algorithm=FAST_AWQ,
                exclude=["*experts.gate_up_proj*"])
    report = ql.oneshot(str(model_dir), **opts)
    assert report["export"]["format"] == "ct_int_pack" and report["check"]["passed"] is True, report["check"]
    assert not any(k.endswith("pre_quant_scale") for k in _keys(tmp_path / "out"))
