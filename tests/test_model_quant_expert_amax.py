"""``sync_expert_weight_amax`` in one process: the README says expert weights then share one amax (the
max over the layer's experts); without a process group no sync ran and the flag was ignored."""

from __future__ import annotations

import copy

import pytest
import torch

pytest.importorskip("transformers")

import quantlib as ql  # noqa: E402

from tests.test_export._export_models import qwen3_moe, tokens  # noqa: E402


@pytest.mark.parametrize("preset", ["NVFP4_DEFAULT_CFG", "FP8_DEFAULT_CFG"])
def test_local_experts_share_the_max_weight_amax(preset):
    base = qwen3_moe()  # experts of magnitudes 1, 2, 4, 8 (x their init)
    cfg = copy.deepcopy(getattr(ql, preset))
    per_expert = ql.quantize(copy.deepcopy(base), cfg, lambda m: m(tokens()))
    cfg["sync_expert_weight_amax"] = True
    shared = ql.quantize(copy.deepcopy(base), cfg, lambda m: m(tokens()))
    for layer in range(2):
        for proj in ("gate_up_proj", "down_proj"):
            own = [q.amax for q in getattr(per_expert.model.layers[layer].mlp.experts, f"{proj}_weight_quantizer")]
            got = [q.amax for q in getattr(shared.model.layers[layer].mlp.experts, f"{proj}_weight_quantizer")]
            assert len({float(a) for a in own}) == 4  # the experts differ
            top = torch.stack(own).amax()
            assert all(torch.equal(a, top) for a in got), (layer, proj, [float(a) for a in got])
    # the attention's weights are no experts: untouched
    assert torch.equal(shared.model.layers[0].self_attn.q_proj.weight_quantizer.amax, per_expert.model.layers[0].self_attn.q_proj.weight_quantizer.amax)
