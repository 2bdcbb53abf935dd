"""Megatron-Core plugin on the CPU: a 2-layer GPT with 4 SequentialMLP experts (top-2) quantized at
TP=1, TP=2, EP=2, TP=2xEP=2 and EP=4 (4 gloo ranks, the rest of the world data parallel), and Megatron
dist checkpoints saved at one layout and loaded at another.

Every layout of a 4-rank world runs in one launch of 4 forked processes (:func:`_sweep`); the tests
below check what it returns. The model's weights depend on a seed and not on the layout
(``megatron_shims.init_global_weights``), so every layout holds the same model and the quantized
logits and amax of all layouts can be compared with each other and with amax computed from the full
weights.
"""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch

pytest.importorskip("psutil", reason="Megatron dist checkpointing hangs without psutil")
pytest.importorskip("megatron.core", reason="needs megatron-core (pip install 'quantlib[megatron]')")

import quantlib as ql  # noqa: E402
from quantlib.config import QuantizeConfig  # noqa: E402
from tests.test_plugins import megatron_shims as shims  # noqa: E402

pytestmark = [pytest.mark.megatron, pytest.mark.distributed]

WORLD = 4
SEED = 0
#: presets of the sweep (INT8_GLU: per-channel weights on a gated-MLP model, for the GLU halves)
PRESETS = {
    "fp8": ql.FP8_DEFAULT_CFG,
    "nvfp4": ql.NVFP4_DEFAULT_CFG,
    "int4_block": ql.INT4_BLOCKWISE_WEIGHT_ONLY_CFG,
    "int8_glu": ql.INT8_DEFAULT_CFG,
}
MODEL = {"int8_glu": {"gated_linear_unit": True}}
LAYOUTS_OF = {name: list(shims.LAYOUTS) for name in PRESETS}
LAYOUTS_OF["int8_glu"] = ["tp1", "tp2", "tp2ep2", "ep4"]
#: checkpoint saved at -> loaded at
TRANSFERS = [("tp2ep2", "tp1"), ("tp2ep2", "ep4"), ("tp2ep2", "tp2ep2"), ("tp1", "tp2ep2"), ("ep4", "tp2ep2")]
TRANSFERS_OF = {name: TRANSFERS for name in PRESETS}
TRANSFERS_OF["int8_glu"] = [("tp2ep2", "tp1"), ("tp2ep2", "ep4"), ("tp1", "tp2ep2")]
CALIB_BATCHES, EVAL_SEED = 8, 99

# ------------------------------------------------------------------------------------ the sweep (ranks)


def _snapshot(model, world: int, rank: int) -> dict[str, Any]:
    """Logits on the evaluation batch and every amax in global form (rank 0 gets the assembled result)."""
    logits = shims.gpt_logits(model, shims.token_batches(1, EVAL_SEED)[0])
    pieces = [None] * world
    torch.distributed.all_gather_object(pieces, shims.amax_pieces(model))
    if rank != 0:
        return {}
    amax, problems = shims.assemble(pieces)
    return {"logits": logits, "amax": amax, "problems": problems}


def _weight_shapes(model) -> dict[str, tuple[int, ...]]:
    return {sh.key: tuple(sh.global_shape) for sh in shims.sharded_tensors(model) if sh.key.endswith(".weight")}


def _quantized(preset: str, layout: str):
    from megatron.core import parallel_state as mpu

    tp, ep = shims.LAYOUTS[layout]
    shims.set_layout(tp, ep)
    model = shims.build_gpt(tp, ep, SEED, **MODEL.get(preset, {}))
    dp, dp_rank = mpu.get_data_parallel_world_size(), mpu.get_data_parallel_rank()
    data = shims.token_batches(CALIB_BATCHES, 1)[dp_rank::dp]  # each data-parallel rank its share
    return ql.quantize(model, PRESETS[preset], shims.forward_loop(data), parallel_state=ql.ParallelState.from_megatron())


def _gather_tokens(model, world: int) -> list[dict]:
    from quantlib.plugins.megatron import expert_token_counts

    counts = [None] * world
    torch.distributed.all_gather_object(counts, expert_token_counts(model))
    return counts


def _save(model, folder: str) -> None:
    from megatron.core import dist_checkpointing

    if torch.distributed.get_rank() == 0:
        os.makedirs(folder, exist_ok=True)
    torch.distributed.barrier()
    dist_checkpointing.save(model.sharded_state_dict(), folder)


def _load(preset: str, layout: str, folder: str):
    """A fresh model (other weights) at ``layout``, configured from the checkpoint, then loaded."""
    from megatron.core import dist_checkpointing

    from quantlib.plugins.megatron import restore_quantizer_config

    tp, ep = shims.LAYOUTS[layout]
    shims.set_layout(tp, ep)
    model = restore_quantizer_config(shims.build_gpt(tp, ep, SEED + 1, **MODEL.get(preset, {})), folder)
    model.load_state_dict(dist_checkpointing.load(model.sharded_state_dict(), folder))
    return model


def _state_dict_round_trip(model, layout: str, world: int, rank: int) -> dict:
    """``state_dict()`` of the quantized model into a fresh converted one at the same layout."""
    tp, ep = shims.LAYOUTS[layout]
    fresh = ql.convert(shims.build_gpt(tp, ep, SEED + 1))
    fresh.load_state_dict(model.state_dict())
    return _snapshot(fresh, world, rank)


def _single_token(world: int, rank: int) -> dict:
    """EP=4 (one expert per rank), calibrated on one token: top-2 reaches two experts, two get none."""
    shims.set_layout(1, 4)
    model = shims.build_gpt(1, 4, SEED)
    one = [shims.token_batches(1, 5, batch=1, seq=1)[0]]
    ql.quantize(model, ql.FP8_DEFAULT_CFG, shims.forward_loop(one), parallel_state=ql.ParallelState.from_megatron())
    out = _snapshot(model, world, rank)
    tokens = _gather_tokens(model, world)
    return dict(out, tokens=tokens) if rank == 0 else {}


def _sweep(rank: int, world: int, root: str) -> dict:
    results: dict[str, Any] = {"layouts": {}, "loads": {}, "tokens": {}, "round_trip": None, "single_token": None, "weight_shapes": {}}
    for preset in PRESETS:
        saves = {src for src, _ in TRANSFERS_OF[preset]}
        for layout in LAYOUTS_OF[preset]:
            model = _quantized(preset, layout)
            results["layouts"][(preset, layout)] = _snapshot(model, world, rank)
            if preset == "fp8":
                results["tokens"][layout] = _gather_tokens(model, world)
                if layout == "tp2ep2":
                    results["round_trip"] = _state_dict_round_trip(model, layout, world, rank)
            if layout == "tp1":
                results["weight_shapes"][preset] = _weight_shapes(model)
            if layout in saves:
                _save(model, os.path.join(root, preset, layout))
        for src, dst in TRANSFERS_OF[preset]:
            model = _load(preset, dst, os.path.join(root, preset, src))
            results["loads"][(preset, src, dst)] = _snapshot(model, world, rank)
    results["single_token"] = _single_token(world, rank)
    return results if rank == 0 else {}


@pytest.fixture(scope="module")
def sweep(tmp_path_factory) -> dict:
    return shims.run_distributed(_sweep, WORLD, str(tmp_path_factory.mktemp("mcore_ckpt")), timeout=280)[0]


# ------------------------------------------------------------------------------------ helpers


def _params() -> list:
    return [pytest.param(preset, layout, id=f"{preset}-{layout}") for preset in PRESETS for layout in LAYOUTS_OF[preset]]


def _transfer_params() -> list:
    return [pytest.param(preset, src, dst, id=f"{preset}-{src}-to-{dst}") for preset in PRESETS for src, dst in TRANSFERS_OF[preset]]


def _weight_attrs(preset: str):
    cfg = QuantizeConfig.from_any(PRESETS[preset])
    attrs, _ = cfg.resolve("decoder.layers.0.mlp.experts.local_experts.0.linear_fc1.weight_quantizer")
    return attrs


def _expected_weight_amax(preset: str, amax_key: str, global_shape: tuple, weight_shapes: dict) -> torch.Tensor:
    """The amax the full (unsharded) weight gives, per layer and expert."""
    wkey = amax_key[: -len("weight_quantizer._amax")] + "weight"
    weight = shims.global_value(wkey, weight_shapes[wkey], SEED)
    lead = weight.shape[:-2]
    out = torch.empty(global_shape)
    for idx in torch.cartesian_prod(*[torch.arange(n) for n in lead]).reshape(-1, len(lead)).tolist():
        q = ql.TensorQuantizer(_weight_attrs(preset))
        q.calibrate(weight[tuple(idx)])
        out[tuple(idx)] = q.amax.reshape(out[tuple(idx)].shape)
    return out


def _close(a: torch.Tensor, b: torch.Tensor) -> bool:
    # fp32 reduction order differs between layouts (TP splits the GEMMs' sums)
    return torch.allclose(a, b, rtol=1e-5, atol=1e-5)


# ------------------------------------------------------------------------------------ tests


@pytest.mark.parametrize("preset,layout", _params())
def test_every_rank_holds_synced_amax(sweep, preset, layout):
    """Every rank that holds a piece of an amax (a replica over DP, TP, or expert DP) holds the same
    value, and every piece of every global amax is held by some rank."""
    snap = sweep["layouts"][(preset, layout)]
    assert snap["amax"], "no amax found in the sharded state dict"
    assert snap["problems"] == []


@pytest.mark.parametrize("preset,layout", _params())
def test_expert_inputs_share_one_scale_per_layer(sweep, preset, layout):
    amax = sweep["layouts"][(preset, layout)]["amax"]
    keys = [k for k in amax if ".experts.experts." in k and "input_quantizer" in k]
    if preset == "int4_block":
        assert keys == []  # a weight-only preset
        return
    assert len(keys) == 2  # linear_fc1 and linear_fc2
    for key in keys:
        per_layer = amax[key].reshape(amax[key].shape[0], amax[key].shape[1], -1)  # [layer, expert, ...]
        assert torch.equal(per_layer, per_layer[:, :1].expand_as(per_layer)), key


@pytest.mark.parametrize("preset,layout", _params())
def test_weight_amax_is_that_of_the_full_weight(sweep, preset, layout):
    """Each weight amax (per expert for experts) equals the amax of the corresponding full weight: the
    global form is layout independent and every expert's amax comes from its own weight."""
    amax = sweep["layouts"][(preset, layout)]["amax"]
    keys = [k for k in amax if k.endswith("weight_quantizer._amax")]
    assert any(".experts." in k for k in keys) and any("linear_proj" in k for k in keys)
    for key in keys:
        expected = _expected_weight_amax(preset, key, tuple(amax[key].shape), sweep["weight_shapes"][preset])
        assert torch.equal(amax[key], expected), key


@pytest.mark.parametrize("preset,layout", _params())
def test_logits_and_activation_amax_match_tp1(sweep, preset, layout):
    ref, snap = sweep["layouts"][(preset, "tp1")], sweep["layouts"][(preset, layout)]
    assert not torch.equal(snap["logits"], torch.zeros_like(snap["logits"]))
    assert _close(snap["logits"], ref["logits"]), (snap["logits"] - ref["logits"]).abs().max()
    assert set(snap["amax"]) == set(ref["amax"])
    for key in snap["amax"]:
        assert _close(snap["amax"][key], ref["amax"][key]), key


def test_quantization_changes_the_logits(sweep):
    """The sweep compares quantized models (each preset gives other logits)."""
    logits = [sweep["layouts"][(p, "tp1")]["logits"] for p in ("fp8", "nvfp4", "int4_block")]
    assert not torch.equal(logits[0], logits[1]) and not torch.equal(logits[1], logits[2])


@pytest.mark.parametrize("preset,src,dst", _transfer_params())
def test_dist_checkpoint_restores_at_another_layout(sweep, preset, src, dst):
    """Saved at ``src``, loaded into a fresh model (other weights, default quantizers) at ``dst``:
    every amax identical, logits equal (bit for bit at the same layout)."""
    saved, loaded = sweep["layouts"][(preset, src)], sweep["loads"][(preset, src, dst)]
    assert loaded["problems"] == []
    assert set(loaded["amax"]) == set(saved["amax"])
    for key in saved["amax"]:
        assert torch.equal(loaded["amax"][key], saved["amax"][key]), key
    if src == dst:
        assert torch.equal(loaded["logits"], saved["logits"])
    else:
        assert _close(loaded["logits"], saved["logits"]), (loaded["logits"] - saved["logits"]).abs().max()


def test_state_dict_round_trip(sweep):
    """``model.state_dict()`` carries amax and quantizer config: a fresh converted model loads it."""
    saved, loaded = sweep["layouts"][("fp8", "tp2ep2")], sweep["round_trip"]
    assert loaded["problems"] == []
    assert all(torch.equal(loaded["amax"][k], saved["amax"][k]) for k in saved["amax"])
    assert torch.equal(loaded["logits"], saved["logits"])


def test_unrouted_experts_take_the_layer_amax(sweep):
    """Calibrated on one token at EP=4, two of the four experts of each layer (on other ranks) get no
    tokens: their input amax come from their peers through the sync, their weight amax from their
    own weights."""
    snap = sweep["single_token"]
    assert snap["problems"] == []
    per_layer: dict[str, dict[int, int]] = {}
    for by_rank in snap["tokens"]:
        for name, counts in by_rank.items():
            per_layer.setdefault(name, {}).update(counts)
    assert len(per_layer) == 2 and all(sorted(c) == [0, 1, 2, 3] for c in per_layer.values())
    assert all(sum(n == 0 for n in c.values()) == 2 for c in per_layer.values()), per_layer
    for key, value in snap["amax"].items():
        if ".experts.experts." in key and "input_quantizer" in key:
            assert bool(torch.isfinite(value).all()) and torch.equal(value, value[:, :1].expand_as(value)), key
    weights = snap["amax"]["decoder.layers.mlp.experts.experts.linear_fc1.weight_quantizer._amax"]
    assert len(set(weights.flatten().tolist())) == weights.numel()  # one per expert, all different


def test_tokens_per_expert_are_counted(sweep):
    """Calibration counts the tokens each expert receives: at EP=4 (all tokens reach every rank) the
    counts of the four experts add up to top-2 of all calibration tokens; at TP=1 (DP=4) each rank
    counts its own share, and the shares add up to the same per-expert counts."""
    total = CALIB_BATCHES * 2 * shims.SEQ * 2
    ep4 = {}
    for by_rank in sweep["tokens"]["ep4"]:
        for name, counts in by_rank.items():
            ep4.setdefault(name, {}).update(counts)
    assert set(ep4) == {"decoder.layers.0.mlp.experts", "decoder.layers.1.mlp.experts"}
    tp1: dict[str, dict[int, int]] = {}
    for by_rank in sweep["tokens"]["tp1"]:
        for name, counts in by_rank.items():
            for e, c in counts.items():
                tp1.setdefault(name, {}).setdefault(e, 0)
                tp1[name][e] += c
    for name in ep4:
        assert sum(ep4[name].values()) == total
        assert ep4[name] == tp1[name]
