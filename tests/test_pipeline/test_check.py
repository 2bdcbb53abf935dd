"""quantlib.pipeline.check: the export loaded back by its consumer."""

from __future__ import annotations

import pytest

pytest.importorskip("transformers")


def test_hf_consumer_that_cannot_run_is_reported_not_raised(monkeypatch, tmp_path):
    """transformers' FP8 loader raises ImportError (no accelerate) only when it loads: the check says why it skipped."""
    import transformers

    from quantlib.pipeline.check import reload_export

    def no_accelerate(*args, **kwargs):
        raise ImportError("Loading an FP8 quantized model requires accelerate (`pip install accelerate`)")

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", no_accelerate)
    model, consumer, why = reload_export(str(tmp_path), "hf_fp8_block", {}, False)
    assert model is None and consumer == "hf_fp8_block" and "requires accelerate" in why and "quantlib[export]" in why


@pytest.mark.parametrize("fmt", ["ct_fp8_block", "hf_fp8_block"])
def test_gpt2_check_reads_conv1d_as_stored(tmp_path, fmt):
    """The CLI's consumer check on GPT-2 (Conv1D weights stored (in, out)): each quantized weight as the fake-quantized
    model holds it, (in, out), against the consumer's read of the export (transformers cannot load a quantized GPT-2: its
    own FP8 dequantization op reads the hf_* export as vLLM lays it out)."""
    pytest.importorskip("compressed_tensors")
    import warnings

    import quantlib as ql
    from quantlib.export import export_checkpoint
    from quantlib.pipeline import check
    from tests.test_export._export_models import weight_only
    from tests.test_export._families import gpt2

    model = gpt2(tie=False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ql.quantize(model, weight_only(ql.FP8_2D_BLOCKWISE_WEIGHT_ONLY_CFG), None)
    export_checkpoint(model, tmp_path / "q", fmt)
    shapes = {n: raw.shape for n, raw, _ in check.iter_weights(model, quantized=False)}
    loaded, consumer, why = check.reload_export(str(tmp_path / "q"), fmt, shapes, False)
    assert loaded is not None, why
    res = check.CheckResult(consumer, check.RULES.get(fmt, "exact"))
    for name, _raw, ref in check.iter_weights(model):
        check.check_weight(res, name, ref, loaded)
    assert res.passed and res.compared == 4, res
