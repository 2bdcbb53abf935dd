"""The export plan kept between RL weight syncs (:mod:`quantlib.export.plan_cache`): a sync through unchanged quantizers
plans nothing and dispatches its budget of aten ops (on a GPU each is a launch the host pays for, and the sync is
bound by its host time), and any change of a quantizer, its amax or the module tree shows in the next sync."""

from __future__ import annotations

import copy
import gc
import pickle
import weakref

import pytest
import torch

pytest.importorskip("transformers")

import quantlib as ql  # noqa: E402
from quantlib.export import ExportError, iterate, sync_pairs  # noqa: E402
from tests.test_export._export_models import bit_equal, llama, quantized, qwen3_moe, weight_only  # noqa: E402
from tests.test_plugins.host_reads import OpCount  # noqa: E402

FP8_BLOCK = weight_only(ql.FP8_2D_BLOCKWISE_WEIGHT_ONLY_CFG)
#: aten ops of one steady-state sync of the 2-layer Qwen3-MoE (4 attention linears and 2 stacked expert projections a
#: layer): each cast's codes and scales (2 empties), a detach of each weight and passed-through tensor, the w1 / w3 views of
#: each gate_up cast and their join. Whatever the number of experts. 2026-12-07 (0384523, the plan built every sync) these
#: were 98 (fp8_block: the amax read back, the stacked amax, the shard checks) and 65 (mxfp8)
BUDGET = {"hf_fp8_block": 61, "hf_mxfp8": 61}


def pairs(model: torch.nn.Module, fmt: str, **kwargs) -> dict[str, torch.Tensor]:
    with torch.no_grad():
        return {k: t.clone() for k, t in sync_pairs(model, fmt, **kwargs)}


def fresh(model: torch.nn.Module, fmt: str, **kwargs) -> dict[str, torch.Tensor]:
    """The pairs of a plan built now: a copy of the model carries no plan."""
    return pairs(copy.deepcopy(model), fmt, **kwargs)


def same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(bit_equal(a[k], b[k]) for k in a)


def plans_made(monkeypatch) -> list:
    made: list = []
    build = iterate.make_plan
    monkeypatch.setattr(iterate, "make_plan", lambda *a, **k: made.append(1) or build(*a, **k))
    return made


@pytest.mark.parametrize("fmt, cfg", [("hf_fp8_block", FP8_BLOCK), ("hf_mxfp8", ql.MXFP8_DEFAULT_CFG)])
def test_a_steady_sync_plans_nothing_and_dispatches_its_budget_of_ops(monkeypatch, fmt, cfg):
    model = quantized(qwen3_moe(), cfg)
    first = pairs(model, fmt)
    made = plans_made(monkeypatch)
    with torch.no_grad(), OpCount() as rec:
        for _ in sync_pairs(model, fmt):
            pass
    assert made == []
    assert sum(rec.ops.values()) <= BUDGET[fmt], rec.ops
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(0.5)  # an optimizer step: the weights change in place, the quantizers do not
    stepped = pairs(model, fmt)
    assert made == [] and not same(stepped, first) and same(stepped, fresh(model, fmt))


def test_an_in_place_amax_write_shows_in_the_next_sync():
    """Calibrated scales of a stacked projection come from a stack of the experts' amax made when planning: an amax
    written in place (its generation unchanged, its version counter not) is planned again."""
    model = quantized(qwen3_moe(), FP8_BLOCK)
    q = model.model.layers[0].mlp.experts.gate_up_proj_weight_quantizer[1]
    before = pairs(model, "hf_fp8_block", scales="calibrated")
    with torch.no_grad():
        q.amax.mul_(4.0)
    after = pairs(model, "hf_fp8_block", scales="calibrated")
    key = "model.layers.0.mlp.experts.w13_weight_scale_inv"
    assert not bit_equal(after[key], before[key])
    assert same(after, fresh(model, "hf_fp8_block", scales="calibrated"))


@pytest.mark.parametrize("change", ["disable", "replace"])
def test_a_changed_quantizer_shows_in_the_next_sync(change):
    """A dense model (each linear its own quantizer): switched off, or replaced by another module."""
    model = quantized(llama(), FP8_BLOCK)
    attn = model.model.layers[1].self_attn
    before = pairs(model, "hf_fp8_block")
    if change == "disable":
        attn.o_proj.weight_quantizer.disable()
    else:
        attn.o_proj.weight_quantizer = copy.deepcopy(attn.o_proj.weight_quantizer)
        attn.o_proj.weight_quantizer.disable()
    after = pairs(model, "hf_fp8_block")
    key = "model.layers.1.self_attn.o_proj.weight_scale_inv"
    assert key in before and key not in after
    assert same(after, fresh(model, "hf_fp8_block"))


def test_a_quantizer_changed_elsewhere_keeps_the_plan_and_one_of_the_model_changed_after_it_is_seen(monkeypatch):
    """The plan check reads the buffers' versions alone while no quantizer generation was issued since the last sync; one
    issued elsewhere (another model's quantizer switched, a quantizer made) makes it compare this model's generations:
    equal, the plan is kept; a change of this model's after that is planned again."""
    model, other = quantized(llama(), FP8_BLOCK), quantized(llama(), FP8_BLOCK)
    pairs(model, "hf_fp8_block")
    made = plans_made(monkeypatch)
    other.model.layers[0].self_attn.o_proj.weight_quantizer.disable()
    ql.nn.TensorQuantizer()
    pairs(model, "hf_fp8_block")
    assert made == []
    model.model.layers[1].self_attn.o_proj.weight_quantizer.disable()
    after = pairs(model, "hf_fp8_block")
    assert made == [1] and "model.layers.1.self_attn.o_proj.weight_scale_inv" not in after
    assert same(after, fresh(model, "hf_fp8_block"))


def test_a_changed_format_is_checked_again():
    """One linear given other blocks than the rest: refused by name in the next sync (the format carries one block)."""
    model = quantized(llama(), FP8_BLOCK)
    pairs(model, "hf_fp8_block")
    model.model.layers[1].self_attn.o_proj.weight_quantizer.set_from_attribute_config(
        {"num_bits": (4, 3), "block_sizes": {-1: 64, -2: 64, "type": "dynamic"}})
    with pytest.raises(ExportError, match="o_proj.weight_quantizer: weight .* differs from"):
        pairs(model, "hf_fp8_block")


def test_a_replaced_expert_quantizer_shows_in_the_next_sync():
    """A fused-experts module's quantizer group: a member replaced (the group's own children change) is planned again."""
    model = quantized(qwen3_moe(), FP8_BLOCK)
    group = model.model.layers[1].mlp.experts.down_proj_weight_quantizer
    before = pairs(model, "hf_fp8_block", scales="calibrated")
    other = copy.deepcopy(group[0])
    with torch.no_grad():
        other.amax = other.amax * 8.0
    group[0] = other
    after = pairs(model, "hf_fp8_block", scales="calibrated")
    key = "model.layers.1.mlp.experts.w2_weight_scale_inv"
    assert not bit_equal(after[key], before[key])
    assert same(after, fresh(model, "hf_fp8_block", scales="calibrated"))


def test_a_replaced_weight_is_freed_and_sent():
    """A trainer that assigns new parameter objects (``load_state_dict(assign=True)``): the plan keeps no old weight (a
    second copy of the model's weights on the device) and packs the new ones."""
    model = quantized(llama(), FP8_BLOCK)
    before = pairs(model, "hf_fp8_block")
    proj = model.model.layers[0].mlp.down_proj
    ref = weakref.ref(proj.weight)
    proj.weight = torch.nn.Parameter(proj.weight.detach() * 0.25)
    proj._weight_cache.clear()  # the forward's fake-quant cache keeps its weight until the next forward
    gc.collect()
    assert ref() is None
    after = pairs(model, "hf_fp8_block")
    key = "model.layers.0.mlp.down_proj.weight_scale_inv"
    assert not bit_equal(after[key], before[key])
    assert same(after, fresh(model, "hf_fp8_block"))


def test_the_plan_does_not_travel_with_a_copy_and_dies_with_the_model():
    model = quantized(llama(), FP8_BLOCK)
    pairs(model, "hf_fp8_block")
    for other in (copy.deepcopy(model), pickle.loads(pickle.dumps(model))):
        assert other.__dict__["_quantlib_sync_plan"].plan is None
    ref = weakref.ref(model)
    del model
    gc.collect()
    assert ref() is None
