"""gptq on Megatron-Core's GPT at TP=2 and EP=2 (2 gloo ranks on the CPU) against one process at TP=1 /
EP=1 on the same global data (the harness and data of test_megatron_scaling.py): every quantized
linear's weight, in its checkpoint's global form, must be the same on every replica and the one
process's bit for bit (the row-parallel linear_proj / linear_fc2 GPTQ'd over their joined shards).
This model's TP forward gives the one process's activations bit for bit on the CPU; where a TP forward
rounds otherwise (a row-parallel output summed over the ranks in another order), the Hessians differ in
the last bits and a rounding tie may go the other way (tests/test_calibration/test_calib_gptq_parallel.py
feeds the linears directly, independently of that)."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("psutil", reason="Megatron dist checkpointing hangs without psutil")
pytest.importorskip("megatron.core", reason="needs megatron-core (pip install 'quantlib[megatron]')")

import quantlib as ql  # noqa: E402
from tests.test_plugins import megatron_shims as shims  # noqa: E402
from tests.test_plugins.test_megatron_scaling import BATCHES, JOINED, SEED, WORLD, _int4  # noqa: E402

pytestmark = [pytest.mark.megatron, pytest.mark.distributed]

CFG = _int4(8, "gptq")
LAYOUTS = {"tp2": (2, 1), "ep2": (1, 2)}


def _weights(model) -> list:
    return [p for p in shims.amax_pieces(model, ".weight") if p[0].rsplit(".", 2)[-2].startswith("linear_")]  # the quantized linears


def _sweep(rank: int, world: int) -> dict:
    from megatron.core import parallel_state as mpu

    data = shims.token_batches(BATCHES, 1)
    out: dict = {}
    for layout, (tp, ep) in LAYOUTS.items():
        shims.set_layout(tp, ep)
        dp, dp_rank = mpu.get_data_parallel_world_size(), mpu.get_data_parallel_rank()
        model = shims.build_gpt(tp, ep, SEED)
        ql.quantize(model, CFG, shims.forward_loop(data[dp_rank::dp]), parallel_state=ql.ParallelState.from_megatron())
        pieces = [None] * world
        torch.distributed.all_gather_object(pieces, _weights(model))
        out[layout] = shims.assemble(pieces) if rank == 0 else None
    shims.set_layout(1, 1)
    if rank == 0:
        out["before"] = shims.assemble([_weights(shims.build_gpt(1, 1, SEED))])[0]
        for layout in LAYOUTS:
            k = JOINED[layout]
            model = shims.build_gpt(1, 1, SEED)
            joined = [torch.cat(data[i : i + k]) for i in range(0, BATCHES, k)]
            ql.quantize(model, CFG, shims.forward_loop(joined), parallel_state=ql.ParallelState())
            out[("single", layout)] = shims.assemble([_weights(model)])[0]
    torch.distributed.barrier()
    return out if rank == 0 else {}


@pytest.fixture(scope="module")
def sweep() -> dict:
    return shims.run_distributed(_sweep, WORLD, timeout=480)[0]


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_gptq_weights_match_one_process_on_the_global_data(sweep, layout):
    (got, problems), want, before = sweep[layout], sweep[("single", layout)], sweep["before"]
    assert not problems, problems  # every replica holds the same weights
    assert sorted(got) == sorted(want) and any("linear_proj" in k for k in got) and any("experts" in k for k in got)
    for key, w in want.items():
        assert not torch.equal(w, before[key]), f"{key}: gptq left the weight as it was"
        assert torch.equal(got[key], w), f"{layout} {key}: {int((got[key] != w).sum())} of {w.numel()} differ"
