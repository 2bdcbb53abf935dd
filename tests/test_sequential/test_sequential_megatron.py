"""Layer-by-layer calibration of a Megatron-Core MoE GPT (local spec, 4 SequentialMLP experts a layer) on
gloo: at TP=2 (max) the amax equal in-memory calibration's bit for bit, synced over TP the same way; over
two data-parallel ranks, at TP=2 and at EP=2 with AWQ (each data-parallel rank its own tokens) amax
and pre_quant_scale equal too. The
experts' ModuleList is longer than the layers' and must not be taken for the decoder layers."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("megatron.core", reason="needs megatron-core (pip install 'quantlib[megatron]')")

import quantlib as ql  # noqa: E402
from quantlib.calib.sequential import decoder_layers  # noqa: E402
from quantlib.model_quant import iter_leaf_quantizers  # noqa: E402
from tests.test_plugins import megatron_shims as shims  # noqa: E402

pytestmark = [pytest.mark.megatron, pytest.mark.distributed]


def _run(rank: int, world: int) -> dict:
    shims.set_layout(2, 1)
    cfg = ql.merge_kv_config(ql.FP8_DEFAULT_CFG, ql.FP8_KV_CFG)
    data = shims.token_batches(3, 1)
    state = ql.ParallelState.from_megatron()
    name, _ = decoder_layers(shims.build_gpt(2, 1, 0))
    memory = ql.quantize(shims.build_gpt(2, 1, 0), cfg, shims.forward_loop(data), parallel_state=state)
    layered = ql.quantize(shims.build_gpt(2, 1, 0), cfg, shims.forward_loop(data), parallel_state=state, sequential=True)
    a = {n: q.amax for n, q in iter_leaf_quantizers(memory) if q.amax is not None}
    b = {n: q.amax for n, q in iter_leaf_quantizers(layered) if q.amax is not None}
    return {"layers": name, "same_keys": a.keys() == b.keys(), "differ": [n for n in a if n in b and not torch.equal(a[n], b[n])],
            "count": len(a)}


def test_sequential_megatron_tp2_amax_equal_in_memory():
    for res in shims.run_distributed(_run, 2):
        assert res["layers"] == "decoder.layers"
        assert res["same_keys"] and res["count"] > 40
        assert not res["differ"], res["differ"][:5]


def _state(model) -> dict:
    out = {}
    for n, q in iter_leaf_quantizers(model):
        for key, value in (("amax", q.amax), ("pre_quant_scale", q.pre_quant_scale)):
            if value is not None:
                out[f"{n}/{key}"] = value
    return out


def _run_awq_dp(rank: int, world: int) -> dict:
    shims.set_layout(1, 1)  # two data-parallel ranks
    cfg = dict(ql.W4A8_AWQ_BETA_CFG, algorithm={"method": "awq_full", "alpha_step": 0.5, "max_tokens_per_batch": 4})
    data = shims.token_batches(2, 10 + rank)  # each rank its own tokens: the searches reduce over both
    state = ql.ParallelState.from_megatron()
    memory = _state(ql.quantize(shims.build_gpt(1, 1, 0), cfg, shims.forward_loop(data), parallel_state=state))
    layered = _state(ql.quantize(shims.build_gpt(1, 1, 0), cfg, shims.forward_loop(data), parallel_state=state, sequential=True))
    experts = [n for n in memory if "local_experts" in n and n.endswith("input_quantizer/pre_quant_scale")]
    return {"same_keys": memory.keys() == layered.keys(), "differ": [n for n in memory if n in layered
                                                                     and not torch.equal(memory[n], layered[n])], "experts": len(experts),
                                                                     "layered": layered}


def test_sequential_megatron_dp2_awq_full_equal_in_memory():
    results = shims.run_distributed(_run_awq_dp, 2)
    for res in results:
        assert res["same_keys"] and res["experts"] > 0
        assert not res["differ"], res["differ"][:5]
    assert all(torch.equal(v, results[1]["layered"][k]) for k, v in results[0]["layered"].items())  # both ranks chose the same


def _run_awq_split(rank: int, world: int, tp: int, ep: int) -> dict:
    from megatron.core import parallel_state as mpu

    shims.set_layout(tp, ep)
    cfg = dict(ql.W4A8_AWQ_BETA_CFG, algorithm={"method": "awq_full", "alpha_step": 0.5, "max_tokens_per_batch": 4})
    data = shims.token_batches(2, 10 + mpu.get_data_parallel_rank())
    state = ql.ParallelState.from_megatron()
    memory = _state(ql.quantize(shims.build_gpt(tp, ep, 0), cfg, shims.forward_loop(data), parallel_state=state))
    layered = _state(ql.quantize(shims.build_gpt(tp, ep, 0), cfg, shims.forward_loop(data), parallel_state=state, sequential=True))
    return {"same_keys": memory.keys() == layered.keys(), "differ": [n for n in memory if n in layered
                                                                     and not torch.equal(memory[n], layered[n])],
                                                                     "scales": sum(n.endswith("pre_quant_scale") for n in memory)}


@pytest.mark.parametrize("tp, ep", [(2, 1), (1, 2)], ids=["tp2", "ep2"])
def test_sequential_megatron_split_awq_full_equal_in_memory(tp, ep):
    for res in shims.run_distributed(_run_awq_split, 2, tp, ep):
        assert res["same_keys"] and res["scales"] > 0
        assert not res["differ"], res["differ"][:5]
