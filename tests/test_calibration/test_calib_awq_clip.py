"""awq_clip / awq_full: the ratio grid, the per-block choice a brute-force loop makes, ModelOpt 0.47's
amax on the same layers and data, NVFP4's global clip, and DP2."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import quantlib as ql
from quantlib.calib.awq_clip import clip_ratios
from quantlib.calib_config import AwqClipConfig

from ._models import loop, mlp, outlier_data

INT4 = {"num_bits": 4, "block_sizes": {-1: 32, "type": "static"}, "narrow_range": False}


def _cfg(algorithm, weight=INT4, inp=None) -> dict:
    quant_cfg = {"default": {"enable": False}, "*weight_quantizer": weight}
    if inp is not None:
        quant_cfg["*input_quantizer"] = inp
    return {"quant_cfg": quant_cfg, "algorithm": algorithm}


def test_ratio_grid_is_modelopts():
    assert clip_ratios(AwqClipConfig()) == [0.5, 0.55, 0.6, 0.65, 0.7, 0.75, 0.8, 0.85, 0.9, 0.95, 1.0]
    assert clip_ratios(AwqClipConfig(min_clip_ratio=0.7, shrink_step=0.1)) == [0.7, 0.8, 0.9, 1.0]


def test_each_block_gets_the_ratio_a_brute_force_loop_picks():
    torch.manual_seed(3)
    lin = nn.Sequential(nn.Linear(64, 6, bias=False)).eval()
    with torch.no_grad():
        lin[0].weight[2, 5] = 3.0  # an outlier: its block clips
    data = [torch.randn(40, 64, generator=torch.Generator().manual_seed(4))]
    w = lin[0].weight.detach().clone()
    model = ql.quantize(lin, _cfg({"method": "awq_clip", "max_tokens_per_batch": 1000}), loop(data))
    q = ql.TensorQuantizer(INT4)
    x = data[0]
    amax0 = w.abs().reshape(6, 2, 32).amax(-1)
    want = torch.empty(6, 2)
    for row in range(6):
        for b in range(2):
            best = None
            for r in clip_ratios(AwqClipConfig()):
                q.amax = amax0 * r
                wq = q(w)
                cols = slice(32 * b, 32 * (b + 1))
                err = float(((x[:, cols] * (wq[row, cols] - w[row, cols])).sum(-1)).pow(2).mean())
                if best is None or err < best[0]:
                    best = (err, r)
            want[row, b] = best[1]
    torch.testing.assert_close(model[0].awq_clip_ratio, want)
    torch.testing.assert_close(model[0].weight_quantizer.amax, amax0 * want)
    assert want[2, 0] < 1.0


def test_clip_and_full_beat_max_at_int4_blocks():
    data = outlier_data()
    ref = mlp()
    errs = {}
    for algo in ("max", "awq_clip", "awq_full"):
        m = ql.quantize(mlp(), _cfg(algo), loop(data))
        with torch.no_grad():
            errs[algo] = sum(float((m(x) - ref(x)).square().sum()) for x in data)
    assert errs["awq_clip"] < errs["max"] and errs["awq_full"] < errs["max"]


def test_nvfp4_clips_its_global_amax():
    data = outlier_data()
    model = ql.quantize(mlp(), ql.NVFP4_AWQ_CLIP_CFG, loop(data))
    w = model[0].weight.detach()
    ratio = model[0].awq_clip_ratio
    assert bool((torch.tensor(clip_ratios(AwqClipConfig())) == ratio).any())
    assert torch.equal(model[0].weight_quantizer.amax, w.abs().amax() * ratio)


@pytest.mark.parametrize("algo", ["awq_clip", "awq_full"])
def test_same_amax_scales_and_alpha_as_modelopt(algo):
    mtq = pytest.importorskip("modelopt.torch.quantization")
    data = outlier_data()
    cfg = copy.deepcopy(mtq.INT4_AWQ_CFG)
    cfg["algorithm"] = {"method": algo, "debug": True}
    theirs = mtq.quantize(mlp(), cfg, loop(data))
    w = {"num_bits": 4, "block_sizes": {-1: 128, "type": "static"}, "narrow_range": False}
    ours = ql.quantize(mlp(), _cfg(algo, weight=w), loop(data))
    for i in (0, 2):
        a = ours[i].weight_quantizer.amax
        torch.testing.assert_close(a, theirs[i].weight_quantizer.amax.reshape(a.shape).float(), rtol=1e-6, atol=0)
        if algo == "awq_full":
            assert ours[i].awq_lite_alpha == pytest.approx(theirs[i].awq_lite.best_alpha, abs=1e-7)
            torch.testing.assert_close(ours[i].input_quantizer.pre_quant_scale, theirs[i].input_quantizer.pre_quant_scale, rtol=1e-6,
                                       atol=0)
    with torch.no_grad():
        torch.testing.assert_close(ours(data[0]), theirs(data[0]), rtol=1e-5, atol=1e-5)


def test_chained_weight_quantizer_keeps_its_amax_with_a_warning(caplog):
    data = outlier_data()
    cfg = dict(ql.W4A8_AWQ_BETA_CFG, algorithm="awq_full")
    model = ql.quantize(mlp(), cfg, loop(data))
    assert "keeps its amax" in caplog.text
    assert model[0].input_quantizer.pre_quant_scale is not None  # the lite half ran


@pytest.mark.parametrize("bad", [{"min_clip_ratio": 1.0}, {"shrink_step": 0}, {"max_co_batch_size": 0}, {"max_tokens_per_batch": 2.5}])
def test_invalid_fields_are_refused_by_name(bad):
    with pytest.raises(ql.ConfigError, match=next(iter(bad))):
        ql.QuantizeConfig.from_any(_cfg(dict(method="awq_clip", **bad)))


def _dp_rank(rank: int, world: int, data: list[torch.Tensor]) -> dict:
    model = ql.quantize(mlp(), _cfg("awq_full", inp={"num_bits": 8}), loop(data[rank::world]))
    return {"amax": [model[i].weight_quantizer.amax for i in (0, 2)], "pqs": [model[i].input_quantizer.pre_quant_scale for i in (0, 2)]}


@pytest.mark.distributed
def test_dp2_awq_full_ranks_agree_and_match_one_process():
    from tests.ranks import run_on_ranks

    data = outlier_data(n=4)
    outs = run_on_ranks(_dp_rank, 2, data, timeout=120)
    single = ql.quantize(mlp(), _cfg("awq_full", inp={"num_bits": 8}), loop(data))
    for k, i in enumerate((0, 2)):
        assert torch.equal(outs[0]["amax"][k], outs[1]["amax"][k]) and torch.equal(outs[0]["pqs"][k], outs[1]["pqs"][k])
        torch.testing.assert_close(outs[0]["amax"][k], single[i].weight_quantizer.amax, rtol=1e-5, atol=0)
        torch.testing.assert_close(outs[0]["pqs"][k], single[i].input_quantizer.pre_quant_scale, rtol=1e-5, atol=0)


def _per_ratio_losses(q, w, xs, w_amax, ratios, cfg, block):
    """The search one ratio at a time (the loop before ratios were batched): per call, ratio and
    ``max_co_batch_size`` output channels, one quantized weight and one bmm."""
    from quantlib.calib.awq_clip import _blocked, _quantize

    def outputs(xb, wb):
        return [torch.bmm(xb, wb[:, :, s : s + cfg.max_co_batch_size]).permute(2, 1, 0)
                for s in range(0, wb.shape[-1], cfg.max_co_batch_size)]

    losses = torch.zeros((len(ratios),) + tuple(w_amax.shape))
    for x in xs:
        x = x.reshape(-1, x.shape[-1])
        x = x[0 :: max(1, x.shape[0] // cfg.max_tokens_per_batch)]
        xb = x.reshape(x.shape[0], -1, block).transpose(0, 1)
        refs = outputs(xb, _blocked(w, block))
        for k, r in enumerate(ratios):
            curs = outputs(xb, _blocked(_quantize(q, w, w_amax * r), block))
            losses[k] += torch.cat([(c - ref).float().pow(2).mean(dim=1) for c, ref in zip(curs, refs)])
    return losses


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("chunk", [None, 1])
def test_batched_ratios_give_the_per_ratio_losses_bit_for_bit(monkeypatch, dtype, chunk):
    from quantlib.calib import awq_clip

    if chunk is not None:  # one ratio per product, re-quantized every call
        monkeypatch.setattr(awq_clip, "CHUNK_ELEMENTS", chunk)
    g = torch.Generator().manual_seed(5)
    model = ql.quantize(nn.Sequential(nn.Linear(96, 40, bias=False)).to(dtype), _cfg("max"))
    q, w = model[0].weight_quantizer, model[0].weight.detach()
    xs = [torch.randn(n, 96, generator=g).to(dtype) for n in (70, 300)]
    cfg = AwqClipConfig(max_co_batch_size=16)  # three output-channel pieces
    ratios = clip_ratios(cfg)
    got = awq_clip.block_losses(q, w, xs, q.amax, ratios, cfg)
    assert torch.equal(got, _per_ratio_losses(q, w, xs, q.amax, ratios, cfg, 32))


def test_search_reads_nothing_back_per_linear_or_ratio(monkeypatch):
    from torch.profiler import ProfilerActivity, profile

    from quantlib.calib import awq_clip

    counts = {}
    inner = awq_clip.clip

    def profiled(*args, **kwargs):
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            inner(*args, **kwargs)
        counts.update({e.key: e.count for e in prof.key_averages()})

    monkeypatch.setattr(awq_clip, "clip", profiled)
    ql.quantize(mlp(), _cfg("awq_clip"), loop(outlier_data()))
    assert counts.get("aten::bmm", 0) > 0 and counts.get("aten::_local_scalar_dense", 0) == 0 and counts.get("aten::is_nonzero", 0) == 0
