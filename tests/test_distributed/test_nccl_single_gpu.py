"""sync_amax over NCCL with one process: what a single-GPU machine can check of the NCCL path (the
amax stay on the GPU, a NaN still fails fast). A group of one rank needs no collective, so none runs:
the collectives themselves need two GPUs (``test_distributed.py::*_nccl``)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn

import quantlib as ql
from tests.ranks import run_on_ranks

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.distributed,
    pytest.mark.skipif(torch.cuda.device_count() < 1, reason="needs a CUDA GPU (NCCL)"),
]


def _sync_on_one_gpu(rank: int, world: int, preset: str, poison: bool) -> dict:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 64)).cuda()
    data = [torch.randn(8, 64, device="cuda") for _ in range(2)]
    if poison:
        data[1][0, 0] = float("nan")
    calls = []
    real = dist.all_reduce

    def counting(t, *a, **k):
        calls.append((t.device.type, t.numel()))
        return real(t, *a, **k)

    dist.all_reduce = counting
    try:
        state = ql.ParallelState(data_group=dist.group.WORLD, tensor_group=dist.group.WORLD)
        ql.quantize(model, getattr(ql, preset), lambda m: [m(d) for d in data], parallel_state=state)
    except ql.CalibrationError as exc:
        return {"error": str(exc)}
    finally:
        dist.all_reduce = real
    amax = {n: q.amax for n, q in ql.model_quant.iter_leaf_quantizers(model) if q.amax is not None}
    from quantlib.collectives import device_for

    payload_device = device_for(dist.group.WORLD, torch.device("cpu")).type
    expected_in0 = torch.stack([d.abs().amax() for d in data]).amax()
    return {
        "devices": sorted({a.device.type for a in amax.values()}),
        "input0_exact": bool(torch.equal(amax["0.input_quantizer"], expected_in0)),
        "payload_device": payload_device,
        "collective_devices": sorted({device for device, _ in calls}),
        "num_collectives": len(calls),
    }


@pytest.mark.parametrize("preset", ["FP8_DEFAULT_CFG", "NVFP4_DEFAULT_CFG", "INT8_DEFAULT_CFG"])
def test_sync_amax_over_nccl_one_process(preset):
    (out,) = run_on_ranks(_sync_on_one_gpu, 1, preset, False, timeout=120, backend="nccl")
    assert out["devices"] == ["cuda"] and out["input0_exact"], out
    # groups of one rank are skipped (sync_amax issues no collective for them, NCCL or not)
    assert out["collective_devices"] == [] and out["num_collectives"] == 0, out


def test_nan_fails_fast_over_nccl():
    (out,) = run_on_ranks(_sync_on_one_gpu, 1, "FP8_DEFAULT_CFG", True, timeout=120, backend="nccl")
    assert "error" in out and "0.input_quantizer" in out["error"], out
