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
