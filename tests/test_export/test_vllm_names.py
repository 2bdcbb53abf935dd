"""Stacked experts named as vLLM's fused-MoE parameters in either style (flat ``experts.w13_weight``,
nested ``experts.routed_experts.w13_weight``), gate and up merged into ``w13``, and the receiver check
that names both candidates."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

import quantlib as ql  # noqa: E402
from quantlib.export import ExportError, check_receiver, iter_packed, sync_pairs  # noqa: E402
from quantlib.export.vllm_names import candidates  # noqa: E402
from quantlib.formats.nvfp4 import nvfp4_global_scale  # noqa: E402
from tests.test_export._export_models import quantized, qwen3_moe, weight_only  # noqa: E402


@pytest.fixture(scope="module")
def moe():
    return quantized(qwen3_moe(), weight_only(ql.NVFP4_DEFAULT_CFG))


def test_flat_and_nested_names(moe):
    flat = dict(sync_pairs(moe, "modelopt_nvfp4"))
    nested = dict(sync_pairs(moe, "modelopt_nvfp4", expert_names="nested"))
    experts = sorted(k for k in flat if ".experts." in k and k.startswith("model.layers.0."))
    assert experts == [f"model.layers.0.mlp.experts.{p}_{s}" for p in ("w13", "w2") for s in ("weight", "weight_scale", "weight_scale_2")]
    assert sorted(k for k in nested if ".experts." in k
                  and k.startswith("model.layers.0.")) == [k.replace("experts.", "experts.routed_experts.") for k in experts]
    assert {k for k in flat if ".experts." not in k} == {k for k in nested if ".experts." not in k}
    # vLLM's w13 parameters: [E, 2I, H/2] codes, gate rows then up rows; [E, 2] global scales
    w13, s2 = flat["model.layers.0.mlp.experts.w13_weight"], flat["model.layers.0.mlp.experts.w13_weight_scale_2"]
    assert w13.shape == (4, 256, 128) and s2.shape == (4, 2)
    shards = {p.shard: p.tensors for p in iter_packed(moe, "modelopt_nvfp4", experts="stacked", scales="dynamic")
              if p.name == "model.layers.0.mlp.experts"}
    assert torch.equal(w13, torch.cat([shards["w1"]["w13_weight"], shards["w3"]["w13_weight"]], 1))
    assert torch.equal(s2, torch.stack([shards["w1"]["w13_weight_scale_2"], shards["w3"]["w13_weight_scale_2"]], 1))
    assert torch.equal(s2[:, 0], s2[:, 1])  # gate and up of an expert share one global scale (vLLM uses gate's)


def test_receiver_check_names_both_candidates(moe):
    flat_keys = [k for k, _ in sync_pairs(moe, "modelopt_nvfp4")]
    nested_keys = [k for k, _ in sync_pairs(moe, "modelopt_nvfp4", expert_names="nested")]
    check_receiver(flat_keys, set(flat_keys))
    check_receiver(nested_keys, set(nested_keys))
    with pytest.raises(ExportError, match=r"12 synced parameter\(s\) missing on the receiver: model\.layers\.0\.mlp\.experts\.w13_weight "
                                          r"\(candidates: flat 'model\.layers\.0\.mlp\.experts\.w13_weight', "
                       r"nested 'model\.layers\.0\.mlp\.experts\.routed_experts\.w13_weight'; the receiver has "
                       r"'model\.layers\.0\.mlp\.experts\.routed_experts\.w13_weight': use expert_names='nested'\)"):
        check_receiver(flat_keys, set(nested_keys))
    with pytest.raises(ExportError, match=r"use expert_names='flat'"):
        check_receiver(nested_keys, set(flat_keys))
    with pytest.raises(ExportError, match=r"the receiver has neither"):
        check_receiver(flat_keys, {"model.embed_tokens.weight"})


def test_candidates():
    assert candidates("m.experts.w2_weight") == ("m.experts.w2_weight", "m.experts.routed_experts.w2_weight")
    assert candidates("m.experts.routed_experts.w2_weight") == ("m.experts.w2_weight", "m.experts.routed_experts.w2_weight")


def test_unknown_style_refused(moe):
    with pytest.raises(ExportError, match=r"expert_names='deep': expected one of \['flat', 'nested'\]"):
        list(sync_pairs(moe, "modelopt_nvfp4", expert_names="deep"))


def test_w4a4_activation_scales_travel_with_the_experts():
    model = quantized(qwen3_moe(), ql.NVFP4_DEFAULT_CFG)
    pairs = dict(sync_pairs(model, "modelopt_nvfp4"))
    experts = model.model.layers[1].mlp.experts
    # the layer's input quantizer per expert, for gate and up each: vLLM's NVFP4 MoE keeps w13_input_scale [E, 2]
    assert pairs["model.layers.1.mlp.experts.w13_input_scale"].shape == (4, 2)
    assert torch.equal(pairs["model.layers.1.mlp.experts.w13_input_scale"],
                       nvfp4_global_scale(experts.gate_up_proj_input_quantizer.amax).reshape(1, 1).expand(4, 2))
    assert torch.equal(pairs["model.layers.1.mlp.experts.w2_input_scale"],
                       nvfp4_global_scale(experts.down_proj_input_quantizer.amax).reshape(1).expand(4))
    assert "model.layers.1.self_attn.q_proj.input_scale" in pairs


def test_w8a8_fp8_expert_input_scale_once_per_expert():
    """vLLM's FP8 MoE methods keep one input scale per expert for w13 ([E]), unlike NVFP4's [E, 2]."""
    pairs = dict(sync_pairs(quantized(qwen3_moe(), ql.FP8_DEFAULT_CFG), "modelopt_fp8"))
    assert pairs["model.layers.1.mlp.experts.w13_input_scale"].shape == (4,)
    assert pairs["model.layers.1.mlp.experts.w13_weight_scale"].shape == (4, 2)


def test_ct_nvfp4_per_tensor_scales_one_value_per_expert():
    """compressed-tensors stores a global scale as [1]: stacked, vLLM's parameters hold [E] (w2) and [E, 2] (w13),
    never [E, 1] (before: w2's went out [E, 1])."""
    pairs = dict(sync_pairs(quantized(qwen3_moe(), ql.NVFP4_DEFAULT_CFG), "ct_nvfp4"))
    for key, shape in (("w13_weight_global_scale", (4, 2)), ("w13_input_global_scale", (4, 2)), ("w2_weight_global_scale", (4,)),
                       ("w2_input_global_scale", (4,))):  # fmt: skip
        assert pairs[f"model.layers.1.mlp.experts.{key}"].shape == shape, key
