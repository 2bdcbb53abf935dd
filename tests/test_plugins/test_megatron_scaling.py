"""SmoothQuant and AWQ under tensor and expert parallelism (Megatron-Core on the CPU, 2 gloo ranks).

The 2-layer GPT of ``megatron_shims`` (4 SequentialMLP experts, top-2; attention's ``linear_qkv`` and
the experts' ``linear_fc1`` are column-parallel, ``linear_proj`` and ``linear_fc2`` row-parallel) is
calibrated at TP=2 (expert-TP 2 too) and at EP=2 (its dense layers then data parallel over the 2
ranks), and by one process at TP=1 / EP=1 on the same global data: every batch at TP=2 (the tensor
ranks see the same tokens), and at EP=2 each step's two per-rank batches as one batch (the experts
see both ranks' tokens of a step in one call, so the one process must too). Every ``pre_quant_scale``
and amax, in the checkpoint's global form (TP shards joined, experts by global index), and every
chosen alpha must be the single process's, and every rank's copy of a value the same.

Before, these algorithms refused split linears under TP and expert linears under EP.
"""

from __future__ import annotations

import copy
import os
import re

import pytest
import torch

pytest.importorskip("psutil", reason="Megatron dist checkpointing hangs without psutil")
pytest.importorskip("megatron.core", reason="needs megatron-core (pip install 'quantlib[megatron]')")

import quantlib as ql  # noqa: E402
from tests.test_plugins import megatron_shims as shims  # noqa: E402

pytestmark = [pytest.mark.megatron, pytest.mark.distributed]

WORLD, SEED, BATCHES = 2, 0, 4


def _int4(block: int, algorithm) -> dict:
    cfg = copy.deepcopy(ql.INT4_AWQ_CFG)
    cfg["quant_cfg"]["*weight_quantizer"] = {"num_bits": 4, "block_sizes": {-1: block, "type": "static"}}
    return dict(cfg, algorithm=algorithm)


#: blocks of 8 lie inside a row-parallel shard (16 columns); blocks of 128 span both shards of a row
CASES = {
    "smoothquant": ql.INT8_SMOOTHQUANT_CFG,
    "awq_lite": _int4(8, {"method": "awq_lite", "alpha_step": 0.1}),
    "awq_clip": _int4(8, "awq_clip"),
    "awq_full": _int4(8, "awq_full"),
    "awq_full_b128": _int4(128, "awq_full"),
    "nvfp4_awq_full": ql.NVFP4_AWQ_FULL_CFG,
}
#: layout -> (TP, EP); at EP=2 with 2 ranks an expert has one replica, with 4 ranks two
LAYOUTS = {"tp2": (2, 1), "ep2": (1, 2)}
LAYOUTS_4 = {"ep2dp2": (1, 2), "tp2ep2": (2, 2)}
CASES_4 = ["smoothquant", "awq_full", "nvfp4_awq_full"]
#: the one process's data for a layout: each step's batches of an expert-parallel group as one batch
JOINED = {"tp2": 1, "ep2": 2, "ep2dp2": 2, "tp2ep2": 2}


def _alphas(model) -> dict[str, float]:
    """awq_lite's alpha per linear, experts named by their global index."""
    out = {}
    for name, m in model.named_modules():
        if hasattr(m, "awq_lite_alpha"):
            if getattr(m, "is_expert", False):
                name = re.sub(r"local_experts\.\d+", f"experts.{m.expert_index}", name)
            out[name] = m.awq_lite_alpha
    return out


def _state(model) -> dict:
    clipped = sum(int((m.awq_clip_ratio < 1).sum()) for m in model.modules() if isinstance(getattr(m, "awq_clip_ratio", None),
                                                                                           torch.Tensor))
    return {"pqs": shims.amax_pieces(model, "._pre_quant_scale"), "amax": shims.amax_pieces(model, "._amax"), "alpha": _alphas(model),
            "clipped": clipped}


def _global(states: list[dict]) -> dict:
    pqs, p1 = shims.assemble([s["pqs"] for s in states])
    amax, p2 = shims.assemble([s["amax"] for s in states])
    alphas = [s["alpha"] for s in states]
    merged: dict = {}
    for a in alphas:
        for k, v in a.items():
            merged.setdefault(k, set()).add(v)
    p3 = [f"{k}: alphas {sorted(v)} differ between ranks" for k, v in merged.items() if len(v) > 1]
    clipped = sum(s["clipped"] for s in states)
    return {"pqs": pqs, "amax": amax, "alpha": {k: next(iter(v)) for k, v in merged.items()}, "clipped": clipped, "problems": p1 + p2 + p3}


def _gathered(model, world: int, rank: int) -> dict:
    states = [None] * world
    torch.distributed.all_gather_object(states, _state(model))
    return _global(states) if rank == 0 else {}


def _save_and_restore_at_tp1(model, folder: str, world: int, rank: int) -> dict:
    """Save ``model`` (a dist checkpoint) and load it into a fresh TP=1 model: its global state."""
    from megatron.core import dist_checkpointing

    from quantlib.plugins.megatron import restore_quantizer_config

    if rank == 0:
        os.makedirs(folder, exist_ok=True)
    torch.distributed.barrier()
    dist_checkpointing.save(model.sharded_state_dict(), folder)
    shims.set_layout(1, 1)
    fresh = restore_quantizer_config(shims.build_gpt(1, 1, SEED + 1), folder)
    fresh.load_state_dict(dist_checkpointing.load(fresh.sharded_state_dict(), folder))
    return _gathered(fresh, world, rank)


def _sweep(rank: int, world: int, layouts: dict, cases: list[str], batches: int, folder: str) -> dict:
    from megatron.core import parallel_state as mpu

    data = shims.token_batches(batches, 1)
    out: dict = {}
    for layout, (tp, ep) in layouts.items():
        for case in cases:
            shims.set_layout(tp, ep)
            dp, dp_rank = mpu.get_data_parallel_world_size(), mpu.get_data_parallel_rank()
            model = shims.build_gpt(tp, ep, SEED)
            ql.quantize(model, CASES[case], shims.forward_loop(data[dp_rank::dp]), parallel_state=ql.ParallelState.from_megatron())
            out[(layout, case)] = _gathered(model, world, rank)
            if folder and (layout, case) == ("tp2", "awq_full"):
                out["restored"] = _save_and_restore_at_tp1(model, os.path.join(folder, "tp2_awq_full"), world, rank)
    shims.set_layout(1, 1)
    if rank == 0:  # one process, no groups: the TP=1 / EP=1 result on the global data
        for layout in layouts:
            k = JOINED[layout]
            joined = [torch.cat(data[i : i + k]) for i in range(0, batches, k)]
            for case in cases:
                model = shims.build_gpt(1, 1, SEED)
                ql.quantize(model, CASES[case], shims.forward_loop(joined), parallel_state=ql.ParallelState())
                out[("single", layout, case)] = _global([_state(model)])
    torch.distributed.barrier()
    return out if rank == 0 else {}


@pytest.fixture(scope="module")
def sweep(tmp_path_factory) -> dict:
    folder = str(tmp_path_factory.mktemp("tp2_ckpt"))
    return shims.run_distributed(_sweep, WORLD, LAYOUTS, list(CASES), BATCHES, folder, timeout=480)[0]


@pytest.fixture(scope="module")
def sweep4() -> dict:
    return shims.run_distributed(_sweep, 4, LAYOUTS_4, CASES_4, 2 * BATCHES, "", timeout=480)[0]


def _check(got: dict, ref: dict, case: str) -> None:
    assert not got["problems"], got["problems"]  # every rank's copy of every value is the same
    searched = got["amax"] if case == "awq_clip" else got["pqs"]  # awq_clip sets no pre_quant_scale
    assert any(".experts." in k for k in searched) and any("linear_proj" in k for k in searched), "nothing searched"
    assert sorted(got["pqs"]) == sorted(ref["pqs"]) and sorted(got["amax"]) == sorted(ref["amax"])
    assert got["alpha"] == ref["alpha"]
    if "clip" in case or "full" in case:
        assert ref["clipped"] > 0, "no block was clipped: the clip search would be untested"
    # the same choices; values differ by float rounding: the TP forward's own (row-parallel outputs are
    # summed over the ranks) and the searches' fp32 sums in another order (a column-parallel weight's
    # per-channel mean over its rows, a row-parallel linear's partial output errors, the mean |x| over
    # calls of differently grouped tokens); measured at most 1.4e-6
    for key, value in ref["pqs"].items():
        torch.testing.assert_close(got["pqs"][key], value, rtol=RTOL, atol=0, msg=key)
    for key, value in ref["amax"].items():
        torch.testing.assert_close(got["amax"][key], value, rtol=RTOL, atol=0, msg=key)


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_scales_match_one_process_on_the_global_data(sweep, layout, case):
    _check(sweep[(layout, case)], sweep[("single", layout, case)], case)


@pytest.mark.parametrize("case", CASES_4)
@pytest.mark.parametrize("layout", list(LAYOUTS_4))
def test_four_ranks_with_expert_replicas_and_tp2_ep2(sweep4, layout, case):
    _check(sweep4[(layout, case)], sweep4[("single", layout, case)], case)


def test_tp2_checkpoint_restores_the_tp1_scales_at_tp1(sweep):
    restored, saved, single = sweep["restored"], sweep[("tp2", "awq_full")], sweep[("single", "tp2", "awq_full")]
    assert not restored["problems"], restored["problems"]
    assert sorted(restored["pqs"]) == sorted(single["pqs"])
    for key, value in saved["pqs"].items():
        assert torch.equal(restored["pqs"][key], value), key
        torch.testing.assert_close(restored["pqs"][key], single["pqs"][key], rtol=RTOL, atol=0, msg=key)
    for key, value in saved["amax"].items():
        assert torch.equal(restored["amax"][key], value), key


RTOL = 1e-5
