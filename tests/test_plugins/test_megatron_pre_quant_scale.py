"""AWQ / SmoothQuant ``pre_quant_scale`` in Megatron-Core dist checkpoints (gloo, 2 ranks, CPU).

A Megatron GPT (SequentialMLP experts) calibrated with AWQ at TP=1 (DP=2: the search runs at TP=1 only)
is saved with ``dist_checkpointing`` and restored through ``restore_quantizer_config`` into fresh models
at TP=1 and at TP=2. The scales are sharded tensors of their own (a row-parallel layer's input scale is
split over TP like its input), so the restored model's scales, assembled over its ranks, are the saved
ones and its logits are the saved model's. Before, the restored model expected ``_pre_quant_scale``
buffers that no checkpoint held: ``load_state_dict`` failed with "Missing key(s)".
"""

from __future__ import annotations

import os

import pytest
import torch

pytest.importorskip("psutil", reason="Megatron dist checkpointing hangs without psutil")
pytest.importorskip("megatron.core", reason="needs megatron-core (pip install 'quantlib[megatron]')")

import quantlib as ql  # noqa: E402
from tests.test_plugins import megatron_shims as shims  # noqa: E402

pytestmark = [pytest.mark.megatron, pytest.mark.distributed]

WORLD, SEED, EVAL_SEED = 2, 0, 99
PRESETS = {"int4_awq": ql.INT4_AWQ_CFG, "int8_smoothquant": ql.INT8_SMOOTHQUANT_CFG}


def _gathered(model, suffix: str) -> tuple[dict, list]:
    pieces = [None] * WORLD
    torch.distributed.all_gather_object(pieces, shims.amax_pieces(model, suffix))
    return shims.assemble(pieces)


def _snapshot(model) -> dict:
    scales, problems = _gathered(model, "._pre_quant_scale")
    amax, amax_problems = _gathered(model, "._amax")
    return {"logits": shims.gpt_logits(model, shims.token_batches(1, EVAL_SEED)[0]), "scales": scales, "amax": amax, "problems": problems
            + amax_problems}


def _round_trip(rank: int, world: int, root: str) -> dict:
    from megatron.core import dist_checkpointing, parallel_state as mpu

    from quantlib.plugins.megatron import restore_quantizer_config

    out = {}
    for preset, cfg in PRESETS.items():
        shims.set_layout(1, 1)
        model = shims.build_gpt(1, 1, SEED, gated_linear_unit=True)
        dp, dp_rank = mpu.get_data_parallel_world_size(), mpu.get_data_parallel_rank()
        data = shims.token_batches(4, 1)[dp_rank::dp]
        ql.quantize(model, cfg, shims.forward_loop(data), parallel_state=ql.ParallelState.from_megatron())
        folder = os.path.join(root, preset)
        if rank == 0:
            os.makedirs(folder, exist_ok=True)
        torch.distributed.barrier()
        dist_checkpointing.save(model.sharded_state_dict(), folder)
        out[preset] = {"saved": _snapshot(model)}
        for tp in (1, 2):
            shims.set_layout(tp, 1)
            fresh = restore_quantizer_config(shims.build_gpt(tp, 1, SEED, gated_linear_unit=True), folder)
            fresh.load_state_dict(dist_checkpointing.load(fresh.sharded_state_dict(), folder))
            out[preset][f"tp{tp}"] = _snapshot(fresh)
    return out if rank == 0 else {}


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> dict:
    return shims.run_distributed(_round_trip, WORLD, str(tmp_path_factory.mktemp("pqs_ckpt")), timeout=240)[0]


@pytest.mark.parametrize("preset", list(PRESETS))
def test_pre_quant_scale_restores_at_tp1_and_tp2(results, preset):
    saved = results[preset]["saved"]
    assert saved["scales"], "the calibration set no pre_quant_scale: the test would prove nothing"
    assert not saved["problems"], saved["problems"]
    # a row-parallel layer's input scale is saved as one global vector whatever the layout
    assert any(k.endswith("linear_proj.input_quantizer._pre_quant_scale") for k in saved["scales"])
    for tp in (1, 2):
        got = results[preset][f"tp{tp}"]
        assert not got["problems"], (tp, got["problems"])
        assert sorted(got["scales"]) == sorted(saved["scales"]), tp
        for key, value in saved["scales"].items():
            assert torch.equal(got["scales"][key], value), (tp, key)
        for key, value in saved["amax"].items():
            assert torch.equal(got["amax"][key], value), (tp, key)
    assert torch.equal(results[preset]["tp1"]["logits"], saved["logits"])
    # TP=2 sums the row-parallel GEMMs in another order
    assert torch.allclose(results[preset]["tp2"]["logits"], saved["logits"], rtol=1e-4, atol=1e-4)
