"""WeightSync: the plan kept between syncs gives sync_pairs' tensors after every optimizer step, reads
nothing back to the host once planned, and plans again after each change the plan depends on."""

from __future__ import annotations

import copy

import pytest
import torch

pytest.importorskip("transformers")

import quantlib as ql  # noqa: E402
from quantlib.export import WeightSync, sync_pairs  # noqa: E402

from tests.test_export._export_models import bit_equal, llama, quantized, qwen3_moe, weight_only  # noqa: E402
from tests.test_export.test_weight_sync import HostReads  # noqa: E402

FP8_BLOCK = weight_only(ql.FP8_2D_BLOCKWISE_WEIGHT_ONLY_CFG)


def _same(a: list, b: list) -> bool:
    return [k for k, _ in a] == [k for k, _ in b] and all(bit_equal(x, y) for (_, x), (_, y) in zip(a, b))


def _step(model: torch.nn.Module, seed: int) -> None:
    """An optimizer step that grows the weights (in place, as optimizers update them)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(1.5).add_(torch.randn(p.shape, generator=g, dtype=p.dtype) * 0.01)


@pytest.mark.parametrize("family, cfg, fmt", [
    ("llama", FP8_BLOCK, "hf_fp8_block"),
    ("llama", ql.NVFP4_DEFAULT_CFG, "modelopt_nvfp4"),
    ("qwen3_moe", ql.MXFP8_DEFAULT_CFG, "hf_mxfp8"),
    ("qwen3_moe", FP8_BLOCK, "hf_fp8_block"),
])  # fmt: skip
def test_replays_equal_sync_pairs_after_every_step_with_one_plan(family, cfg, fmt):
    model = quantized(llama() if family == "llama" else qwen3_moe(), cfg)
    sync = WeightSync(model, fmt)
    for step in range(3):
        _step(model, step)
        assert _same(list(sync.pairs()), list(sync_pairs(model, fmt))), step
    assert sync.replans == 1


def test_a_kept_plan_reads_nothing_back(monkeypatch):
    model = quantized(qwen3_moe(), FP8_BLOCK)
    sync = WeightSync(model, "hf_fp8_block")
    list(sync.pairs())
    reads = HostReads(monkeypatch)
    list(sync.pairs())
    assert reads.count == 0  # sync_pairs reads every amax once per call to check it


def _disable_one(model):
    model.model.layers[0].self_attn.o_proj.weight_quantizer.disable()


def _new_weight(model):
    lin = model.model.layers[1].mlp.down_proj
    lin.weight = torch.nn.Parameter(lin.weight.detach().clone() * 3)


def _recalibrate(model):
    with torch.no_grad():
        model.model.layers[0].self_attn.q_proj.weight_quantizer.amax.mul_(2)  # in place: same tensor, new values


def _new_format(model):
    ql.quantize(model, {"quant_cfg": {"*": {"enable": False}, "*down_proj.weight_quantizer": {"num_bits": (4, 3), "axis": None}}, "algorithm": "max"},
                lambda m: m(torch.arange(8).reshape(1, 8)))


def _retie_module(model):
    layer = model.model.layers[1].self_attn
    layer.o_proj = copy.deepcopy(layer.o_proj)


@pytest.mark.parametrize("change", [_disable_one, _new_weight, _recalibrate, _retie_module])
def test_every_change_the_plan_depends_on_plans_again(change):
    model = quantized(llama(), FP8_BLOCK)
    sync = WeightSync(model, "hf_fp8_block", scales="calibrated")
    list(sync.pairs())
    change(model)
    got = list(sync.pairs())
    assert sync.replans == 2
    assert _same(got, list(sync_pairs(model, "hf_fp8_block", scales="calibrated")))


def test_a_changed_scheme_is_refused_as_sync_pairs_refuses_it():
    model = quantized(llama(), FP8_BLOCK)
    sync = WeightSync(model, "hf_fp8_block")
    list(sync.pairs())
    _new_format(model)
    with pytest.raises(ql.export.ExportError) as want:
        list(sync_pairs(model, "hf_fp8_block"))
    with pytest.raises(ql.export.ExportError) as got:
        list(sync.pairs())
    assert str(got.value) == str(want.value)
