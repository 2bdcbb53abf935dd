"""The host cost of the grouped fused-experts forward: the aten ops one eval forward (no grad, weight cache
on) dispatches, held at a budget so that per-call work (spec parsing, validation, small ops in the dispatch
and the combine) cannot creep back in unnoticed. On a GPU each op is a launch the host pays for, and the
benchmark (benchmarks/bench_moe.py) synchronises after every forward, so these show in its times directly."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers", reason="needs transformers (pip install quantlib[transformers])")

import quantlib as ql  # noqa: E402
from quantlib.plugins import huggingface as hf  # noqa: E402
from quantlib.plugins.hf_experts import flag  # noqa: E402

from .host_reads import OpCount  # noqa: E402
from .test_hf_experts_layouts import expert_modules, input_ids, tiny_model  # noqa: E402

PRESETS = {"fp8": ql.FP8_DEFAULT_CFG, "nvfp4": ql.NVFP4_DEFAULT_CFG, "int4-block": ql.INT4_BLOCKWISE_WEIGHT_ONLY_CFG}
#: ops of one forward besides its top_k adds (the combine's): act-quantizing presets, weight-only presets.
#: 2026-12-06 (bb68e1b) these were 42 / 38 (qwen3_moe) and 56 / 52 (gpt_oss: biases, clamped gate, transposed weights)
BUDGET = {"qwen3_moe": (31, 27), "phimoe": (31, 27), "gpt_oss": (43, 39)}


@pytest.fixture(autouse=True)
def _plugin_sees_the_modeling_modules():
    hf.refresh()


@pytest.mark.parametrize("top_k", [2, 3])
@pytest.mark.parametrize("preset", list(PRESETS))
@pytest.mark.parametrize("family", list(BUDGET))
def test_grouped_forward_dispatches_at_most_its_budget_of_ops(family, preset, top_k):
    model = ql.quantize(tiny_model(family), PRESETS[preset], lambda m: m(input_ids(seed=5)))
    m = expert_modules(model)[0][1]
    g = torch.Generator().manual_seed(top_k)
    tokens = 10
    idx = torch.stack([torch.randperm(m.num_experts, generator=g)[:top_k] for _ in range(tokens)])
    weights = torch.rand(tokens, top_k, generator=g)
    hidden = torch.randn(tokens, m.down_proj.shape[2 if flag(m, "is_transposed") else 1], generator=g)
    assert not m._grouped_refusal(hidden, False)
    with torch.no_grad():
        want = m(hidden, idx, weights)  # fills the weight cache
        rec = OpCount()
        with rec:
            got = m(hidden, idx, weights)
    assert torch.equal(got, want)
    budget = BUDGET[family][PRESETS[preset] is ql.INT4_BLOCKWISE_WEIGHT_ONLY_CFG] + top_k
    assert sum(rec.ops.values()) <= budget, dict(rec.ops)


def test_transposed_layout_keeps_its_row_major_weights_while_the_cache_holds():
    """GPT-OSS stores slices (in, out): the grouped GEMM takes them row-major, a copy of the fake-quantized
    stack that an eval forward reused from its weight cache, rebuilt after the weights change."""
    model = ql.quantize(tiny_model("gpt_oss"), ql.FP8_DEFAULT_CFG, lambda m: m(input_ids(seed=5)))
    m = expert_modules(model)[0][1]
    g = torch.Generator().manual_seed(0)
    idx = torch.stack([torch.randperm(m.num_experts, generator=g)[:2] for _ in range(6)])
    weights, hidden = torch.rand(6, 2, generator=g), torch.randn(6, m.down_proj.shape[2], generator=g)
    with torch.no_grad():
        m(hidden, idx, weights)
        copy = m._weight_cache[("row_major", "gate_up_proj")][2]
        m(hidden, idx, weights)
        assert m._weight_cache[("row_major", "gate_up_proj")][2] is copy
        m.gate_up_proj.mul_(0.5)
        got = m(hidden, idx, weights)
        assert m._weight_cache[("row_major", "gate_up_proj")][2] is not copy
        m.__dict__.pop("_weight_cache")
        assert torch.equal(got, m(hidden, idx, weights))
