"""Bytes the RL weight sync of stacked experts moves and holds (``sync_pairs``), counted op by op on the CPU: on a GPU
every op of it is bound by memory bandwidth, so the bytes moved are its time. The ideal reads each bf16 weight once
and writes its codes and scales once; the sync holds at most about the largest vLLM parameter it yields (``w13_*``)."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

import quantlib as ql  # noqa: E402
from quantlib.export import sync_pairs  # noqa: E402
from tests.test_export._byte_count import ByteCount, counting_casts  # noqa: E402
from tests.test_export._export_models import quantized, qwen3_moe, weight_only  # noqa: E402
from tests.test_export.test_expert_stacks import mixtral  # noqa: E402

CFG = {"hf_fp8_block": weight_only(ql.FP8_2D_BLOCKWISE_WEIGHT_ONLY_CFG), "ct_fp8_block": weight_only(ql.FP8_2D_BLOCKWISE_WEIGHT_ONLY_CFG),
       "hf_mxfp8": ql.MXFP8_DEFAULT_CFG, "ct_mxfp8": ql.MXFP8_DEFAULT_CFG}


def bf16(model: torch.nn.Module) -> torch.nn.Module:
    """The quantized model's parameters in bf16, as a trainer holds them (quantizers kept in fp32); all of them, so that
    the model runs (the structure probe of a copy runs it: linears in bf16 behind fp32 embeddings cannot)."""
    with torch.no_grad():
        for p in model.parameters():
            p.data = p.data.to(torch.bfloat16)
    return model


def vllm_param(key: str) -> str:
    """The parameter a key belongs to: ``...experts.w13`` for ``...experts.w13_weight_scale_inv``, the module otherwise."""
    head, _, leaf = key.rpartition(".")
    return f"{head}.{leaf.split('_')[0]}" if leaf.startswith(("w13_", "w2_")) else head


@pytest.mark.parametrize("family, fmt", [("qwen3_moe", "hf_fp8_block"), ("mixtral", "hf_mxfp8"), ("qwen3_moe", "ct_mxfp8"),
                                         ("mixtral", "ct_fp8_block")])
def test_stacked_sync_moves_each_byte_once_and_holds_one_parameter(monkeypatch, family, fmt):
    """w1 / w3 rows are strided in the (E, 2I, H) stack: cast per shard they were copied contiguous, cast, copied into the
    shard and concatenated into w13 (1.6x the ideal bytes here; 11 bytes a bf16 element of gate_up_proj instead of 3) and
    w1, w3 and w13 were held at once (2.5x w13)."""
    model = bf16(quantized(qwen3_moe() if family == "qwen3_moe" else mixtral(), CFG[fmt]))
    count, made, params = ByteCount(), 0, {}
    with torch.no_grad(), count, counting_casts(monkeypatch, count):
        for key, t in sync_pairs(model, fmt):
            if count.made(t):
                made += t.numel() * t.element_size()
                params[vllm_param(key)] = params.get(vllm_param(key), 0) + t.numel() * t.element_size()
            del t
    ideal = count.cast_inputs + made
    assert count.moved <= 1.1 * ideal, (count.moved, ideal, count.ops)
    assert count.peak <= 1.2 * max(params.values()), (count.peak, max(params.values()))


def qwen3_moe_of(moe_intermediate: int) -> torch.nn.Module:
    """A one-layer Qwen3-MoE of 3 experts of ``moe_intermediate`` (192: not whole 128-row blocks, which FP8 128x128 refuses)."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(0)
    cfg = Qwen3MoeConfig(vocab_size=256, hidden_size=256, intermediate_size=256, moe_intermediate_size=moe_intermediate,
                         num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1, head_dim=128, num_experts=3,
                         num_experts_per_tok=2, max_position_embeddings=64, tie_word_embeddings=False)
    return Qwen3MoeForCausalLM(cfg).eval()


@pytest.mark.parametrize("family, fmt, tp", [("qwen3_moe", "hf_fp8_block", 1), ("qwen3_moe", "ct_fp8_block", 1), ("mixtral", "ct_mxfp8", 1),
                                             ("mixtral", "hf_fp8_block", 2), ("i192", "hf_mxfp8", 1)])
def test_sync_pairs_equal_the_per_expert_pairs(family, fmt, tp):
    """The joined cast (w13 as one cast of gate_up_proj, w1 and w3 views of it) gives the per-expert plan's pairs byte for
    byte, strides included, on every rank."""
    from quantlib.export.vllm_names import named_pairs
    from tests.test_export.test_expert_stacks import assert_same, per_expert

    build = {"qwen3_moe": qwen3_moe, "mixtral": mixtral, "i192": lambda: qwen3_moe_of(192)}[family]
    model = bf16(quantized(build(), CFG[fmt]))
    for rank in range(tp):
        ref = list(named_pairs(iter(per_expert(model, fmt, tp=tp, rank=rank)), "flat"))
        assert_same(list(sync_pairs(model, fmt, tp=tp, tp_rank=rank)), ref)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("fmt", ["hf_fp8_block", "hf_mxfp8"])
def test_sync_pairs_on_the_gpu_equal_the_per_expert_pairs(fmt):
    """The CUDA casts of a whole (E, 2I, H) stack joined into w13: the per-expert pairs on the device, and the CPU's."""
    import copy

    from quantlib.export.vllm_names import named_pairs
    from tests.test_export.test_expert_stacks import assert_same, per_expert

    cpu = bf16(quantized(mixtral(), CFG[fmt]))
    model = copy.deepcopy(cpu).cuda()
    ours = list(sync_pairs(model, fmt))
    assert_same(ours, list(named_pairs(iter(per_expert(model, fmt)), "flat")))
    assert_same([(k, t.cpu()) for k, t in ours], list(sync_pairs(cpu, fmt)))
