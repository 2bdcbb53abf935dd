"""Mixed-precision exports run by their consumers: transformers loads a compressed-tensors export of two dense schemes
(W4A16 MLP + FP8 128x128 attention, also after AWQ) and gives quantlib's logits; compressed-tensors' decompressors (each
module by its config group) and ModelOpt's qtensors (each layer by the algorithm ``quantized_layers`` names), the
weights put into the model, give them for NVFP4 experts + FP8 attention as well (the check of ``quantlib.pipeline``)."""

from __future__ import annotations

import copy

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("compressed_tensors")

import quantlib as ql  # noqa: E402
from quantlib.export import export_checkpoint, share_pre_quant_scale  # noqa: E402
from quantlib.pipeline.check import iter_weights, reload_export  # noqa: E402
from tests.test_export._export_models import llama, quantized, qwen3_moe, tokens  # noqa: E402
from tests.test_export.test_mixed import FP8_BLOCK, INT4, NVFP4, _cfg  # noqa: E402


@pytest.fixture(scope="module")
def models():
    return {"w4a16_mlp_fp8_attn": quantized(llama(), _cfg(mlp=INT4, self_attn=FP8_BLOCK)),
            "nvfp4_mlp_fp8_attn": quantized(llama(), _cfg(mlp=NVFP4, self_attn=FP8_BLOCK)),
            "nvfp4_experts_fp8_attn": quantized(qwen3_moe(), _cfg(experts=NVFP4, self_attn=FP8_BLOCK))}


def _close(got: torch.Tensor, ref: torch.Tensor, tol: float) -> None:
    assert (got - ref).abs().max() <= tol * ref.abs().max(), float((got - ref).abs().max())


def _reloaded_logits(model, out_dir, fmt: str) -> torch.Tensor:
    shapes = {n: raw.shape for n, raw, _ in iter_weights(model, quantized=False)}
    loaded, consumer, why = reload_export(str(out_dir), fmt, shapes, False)
    assert loaded is not None, why
    with torch.no_grad():
        return loaded(tokens()).logits


@pytest.mark.parametrize("fmt, case", [("ct_mixed", "w4a16_mlp_fp8_attn"), ("ct_mixed", "nvfp4_experts_fp8_attn"),
                                       ("modelopt_mixed", "nvfp4_mlp_fp8_attn"), ("modelopt_mixed", "nvfp4_experts_fp8_attn")])
def test_reloaded_by_the_formats_own_dequantizers(models, tmp_path, fmt, case):
    """Before, the check refused every compressed-tensors export of several groups and read a MIXED_PRECISION layer as FP8."""
    model = models[case]
    export_checkpoint(model, tmp_path / "c", fmt)
    with torch.no_grad():
        ref = model(tokens()).logits
    # compressed-tensors dequantizes NVFP4 in bf16 (1 bf16 ulp of a weight); FP8, INT4 and ModelOpt's NVFP4 to a few fp32 ulps
    _close(_reloaded_logits(model, tmp_path / "c", fmt), ref, 1e-2 if fmt == "ct_mixed" and "nvfp4" in case else 1e-5)


def test_transformers_runs_two_dense_schemes(models, tmp_path):
    """transformers' compressed-tensors integration builds each module by its own group (CompressedLinear, run compressed); its
    ``dequantize=True`` path takes one scheme for every dense module and is not the consumer of two dense schemes."""
    from transformers import AutoModelForCausalLM

    model = models["w4a16_mlp_fp8_attn"]
    export_checkpoint(model, tmp_path / "c", "ct_mixed")
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "c", dtype=torch.float32)
    with torch.no_grad():
        _close(loaded(tokens()).logits, model(tokens()).logits, 1e-5)


def test_awq_model_mixed_export(tmp_path):
    """AWQ on a W4A16 MLP + FP8 128x128 q/k/v model: q/k/v and gate/up scales fold into the norms, down_proj's into up_proj's INT4
    row scales (o_proj stays bf16: v_proj's FP8 blocks have no row scale); transformers and compressed-tensors give the logits."""
    from transformers import AutoModelForCausalLM

    cfg = _cfg(mlp=INT4, q_proj=FP8_BLOCK, k_proj=FP8_BLOCK, v_proj=FP8_BLOCK)
    cfg["algorithm"] = {"method": "awq_lite", "alpha_step": 0.5}
    model = copy.deepcopy(llama())
    ql.quantize(model, cfg, lambda m: m(tokens(5)))
    share_pre_quant_scale(model, lambda m: m(tokens(5)))
    assert model.model.layers[0].mlp.down_proj.input_quantizer.pre_quant_scale is not None
    export_checkpoint(model, tmp_path / "c", "ct_mixed")
    with torch.no_grad():
        ref = model(tokens()).logits
        _close(AutoModelForCausalLM.from_pretrained(tmp_path / "c", dtype=torch.float32)(tokens()).logits, ref, 1e-5)
    _close(_reloaded_logits(model, tmp_path / "c", "ct_mixed"), ref, 1e-5)
