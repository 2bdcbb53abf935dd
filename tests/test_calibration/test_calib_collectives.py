"""The searches' sync routine (quantlib/collectives.py) on gloo ranks: an expert's statistics meet
only its replicas' and min/max/sum reduce as named; and its fail-fast rules: an error on one rank, or
ranks that search different linears, raise on every rank instead of leaving one waiting in a
collective. (Megatron TP / EP results against one process: tests/test_plugins/test_megatron_scaling.py.)"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import quantlib as ql
from quantlib.collectives import StatSync

from ._models import loop, mlp, outlier_data

pytestmark = pytest.mark.distributed

INT4 = {"num_bits": 4, "block_sizes": {-1: 16, "type": "static"}}


def _cfg(algorithm: str = "awq_lite", inp=None) -> dict:
    quant_cfg = {"default": {"enable": False}, "*weight_quantizer": INT4}
    if inp is not None:
        quant_cfg["*input_quantizer"] = inp
    return {"quant_cfg": quant_cfg, "algorithm": algorithm}


def _replicas_rank(rank: int, world: int) -> dict:
    # 4 ranks, all data parallel for dense layers; experts over [0, 1] and [2, 3]: expert position
    # rank % 2, so ranks 0 and 2 hold the same experts, 1 and 3 the others
    experts = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    sync = StatSync(ql.ParallelState(data_group=dist.group.WORLD, expert_group=experts[rank // 2]))
    t = torch.tensor([float(rank + 1), -float(rank + 1)])
    return {op: (sync.over_replicas(t, op, expert=True), sync.over_replicas(t, op, expert=False)) for op in ("sum", "max", "min")}


def test_an_expert_statistic_meets_only_its_replicas():
    from tests.ranks import run_on_ranks

    outs = run_on_ranks(_replicas_rank, 4, timeout=60)
    for rank, out in enumerate(outs):
        peers = [r + 1.0 for r in range(4) if r % 2 == rank % 2]
        assert out["sum"][0].tolist() == [sum(peers), -sum(peers)]
        assert out["max"][0].tolist() == [max(peers), -min(peers)]
        assert out["min"][0].tolist() == [min(peers), -max(peers)]
        assert out["sum"][1].tolist() == [10.0, -10.0] and out["max"][1].tolist() == [4.0, -1.0]


def _error(fn) -> str:
    try:
        fn()
    except ql.CalibrationError as exc:
        return str(exc)
    return "no error"


def _sequence_parallel_rank(rank: int, world: int) -> str:
    model = ql.convert(mlp())
    model[0].parallel_role, model[0].sequence_parallel = "column", True  # as a Megatron column layer with SP
    return _error(lambda: ql.quantize(model, _cfg(), loop(outlier_data()), parallel_state=ql.ParallelState(tensor_group=dist.group.WORLD)))


def test_sequence_parallel_column_linears_are_refused_on_every_rank():
    from tests.ranks import run_on_ranks

    outs = run_on_ranks(_sequence_parallel_rank, 2, timeout=60)
    assert all("awq_lite under sequence parallelism is not supported: ['0']" in o for o in outs), outs


def _nan_shard_rank(rank: int, world: int, algorithm: str) -> str:
    model = ql.convert(mlp())
    for i in (0, 2):
        model[i].parallel_role = "row"  # each shard's input channels are its own: a NaN stays on its rank
    data = outlier_data()
    if rank == 1:
        data[1][0, 5] = float("nan")
    inp = {"num_bits": 8, "axis": None} if algorithm == "smoothquant" else None
    weight = {"num_bits": 8, "axis": 0} if algorithm == "smoothquant" else INT4
    cfg = _cfg(algorithm, inp)
    cfg["quant_cfg"]["*weight_quantizer"] = weight
    return _error(lambda: ql.quantize(model, cfg, loop(data), parallel_state=ql.ParallelState(tensor_group=dist.group.WORLD)))


@pytest.mark.parametrize("algorithm", ["smoothquant", "awq_lite"])
def test_a_nan_on_one_shard_raises_on_every_rank(algorithm):
    from tests.ranks import run_on_ranks

    outs = run_on_ranks(_nan_shard_rank, 2, algorithm, timeout=60)  # a rank left waiting: RankTimeout
    # every rank raises the amax sync's report: rank 1's NaN, named, and rank 0 failing because of it
    assert all("rank 1: 0.input_quantizer: calibration saw NaN" in o and "rank 0: " + algorithm
               + ": calibration failed on another rank" in o for o in outs), outs


def _different_rank(rank: int, world: int) -> str:
    model = ql.convert(mlp())
    cfg = _cfg()
    if rank == 1:
        cfg["quant_cfg"]["2.weight_quantizer"] = {"enable": False}  # one linear fewer to search
    return _error(lambda: ql.quantize(model, cfg, loop(outlier_data()), parallel_state=ql.ParallelState(data_group=dist.group.WORLD)))


def test_ranks_that_search_different_linears_raise_on_every_rank():
    from tests.ranks import run_on_ranks

    outs = run_on_ranks(_different_rank, 2, timeout=60)
    assert all("the ranks of the data group search different linears" in o for o in outs), outs


def _replicated_rank(rank: int, world: int, algorithm: str) -> dict:
    # every tensor rank holds the whole linears and feeds them the same input up to rounding (as after
    # an MoE layer, whose output each rank combines in another order): here one ulp-scale difference
    data = [x * (1 + 1e-6 * rank) for x in outlier_data()]
    cfg = _cfg(algorithm, {"num_bits": 8, "axis": None})
    if algorithm == "smoothquant":
        cfg["quant_cfg"]["*weight_quantizer"] = {"num_bits": 8, "axis": 0}
    model = ql.quantize(mlp(), cfg, loop(data), parallel_state=ql.ParallelState(tensor_group=dist.group.WORLD))
    return {f"{i}.{q}.{attr}": getattr(getattr(model[i], q), attr) for i in (0, 2) for q in ("input_quantizer", "weight_quantizer")
            for attr in ("pre_quant_scale", "amax")}


@pytest.mark.parametrize("algorithm", ["smoothquant", "awq_full"])
def test_tensor_ranks_holding_whole_linears_choose_alike(algorithm):
    from tests.ranks import run_on_ranks

    outs = run_on_ranks(_replicated_rank, 2, algorithm, timeout=60)
    assert outs[0]["0.input_quantizer.pre_quant_scale"] is not None
    for key, value in outs[0].items():
        assert torch.equal(value, outs[1][key]), key
