"""mse with ``fp8_scale_sweep`` (NVFP4 static block scales): every block gets the E4M3 scale of least
squared error, as a brute-force loop written here picks it and as ModelOpt 0.47's NVFP4MSECalibrator
picks it (its candidate set and argmin, with quantlib's static NVFP4 fake quant as the quantizer: its
own static NVFP4 fake quant is a Triton kernel that needs CUDA); never worse than max per block; the
same on every CPU backend; saved, restored and exported with the chosen scales."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import quantlib as ql
from quantlib.calib.mse import fp8_scale_candidates, search_block_amax
from quantlib.config import QuantizerAttributeConfig
from quantlib.export.quantize import real_quantize
from quantlib.formats import block_amax, dequantize
from quantlib.formats.blocks import to_blocks
from quantlib.kernels import ops

from ._models import loop, mlp, outlier_data

STATIC = {"num_bits": (2, 1), "block_sizes": {-1: 16, "type": "static", "scale_bits": (4, 3)}}
SWEEP = {"method": "mse", "fp8_scale_sweep": True}
_GRID = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])


def _weight(seed: int = 0, shape=(24, 80)) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(shape, generator=g) * torch.linspace(0.01, 2.0, shape[1])
    w[5, 9] = 30.0  # sets the global amax; most blocks then sit far below it
    return w


def _e2m1_round(y: torch.Tensor) -> torch.Tensor:
    """Nearest E2M1 magnitude (ties to the even code), saturating at 6: by distance, written afresh."""
    mag = y.abs().clamp(max=6.0)
    dist = (mag.unsqueeze(-1) - _GRID).abs()
    best = dist.min(dim=-1, keepdim=True).values
    ties = dist == best
    # of tied grid points, the one with the even index (codes 0, 2, 4, 6 are the even ones)
    even = ties & (torch.arange(8) % 2 == 0)
    idx = torch.where(even.any(-1), even.float().argmax(-1), ties.float().argmax(-1))
    return torch.sign(y) * _GRID[idx]


def _brute_force(w: torch.Tensor, global_amax: torch.Tensor) -> torch.Tensor:
    """Per block of 16, the index of the first E4M3 value v (of the 126 positive finite ones, ascending)
    whose dequant scale ``v * A / 2688`` gives the least summed squared error: one block at a time."""
    s2 = global_amax / torch.tensor(2688.0)
    values = torch.arange(0, 128, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    values = values[torch.isfinite(values) & (values > 0)]
    blocks = to_blocks(w, (16,)).reshape(-1, 16)
    best = torch.empty(blocks.shape[0], dtype=torch.long)
    for b in range(blocks.shape[0]):
        errs = []
        for v in values:
            d = v * s2
            errs.append(float((_e2m1_round(blocks[b] / d) * d - blocks[b]).square().sum()))
        best[b] = min(range(len(errs)), key=lambda k: (errs[k], k))
    return best.reshape(to_blocks(w, (16,)).shape[:-1])


def _spec():
    return QuantizerAttributeConfig.from_dict(STATIC).format_spec()


def test_candidates_are_modelopts():
    mo = pytest.importorskip("modelopt.torch.kernels.quantization.gemm._fp8_scale_candidates")
    assert torch.equal(fp8_scale_candidates(), mo.fp8_scale_candidates("cpu"))
    assert fp8_scale_candidates().numel() == 126


def test_sweep_picks_what_a_brute_force_loop_over_blocks_and_scales_picks():
    w = _weight()
    g = w.abs().amax()
    chosen, idx = search_block_amax(w, _spec(), g, block_amax(w, (16,)), fp8_scale_candidates(), sweep=True)
    assert torch.equal(idx, _brute_force(w, g))
    assert torch.equal(chosen, g * fp8_scale_candidates()[idx])  # ModelOpt's stored value: A * v / 448


def test_sweep_picks_what_modelopts_nvfp4_mse_calibrator_picks():
    mse = pytest.importorskip("modelopt.torch.quantization.calib.mse")
    w = _weight(seed=3)
    g = w.abs().amax()
    spec = _spec()
    blocks = w.reshape(-1, 16)  # ModelOpt's blocked layout [n_blocks, 16]
    initial = blocks.abs().amax(dim=-1)

    def quant_func(x, amax):  # quantlib's static NVFP4 fake quant with ModelOpt's candidate block amax
        return ops.fake_quant(x, spec, g, "reference", block_amax=amax.reshape(-1, 1).expand(x.shape[0], 1).contiguous())

    cal = mse.NVFP4MSECalibrator(amax=initial, global_amax=g, axis=0, quant_func=quant_func)
    cal.collect(blocks)
    theirs = cal.compute_amax()
    ours, _ = search_block_amax(w, spec, g, block_amax(w, (16,)), fp8_scale_candidates(), sweep=True)
    assert torch.equal(ours.reshape(-1), theirs)


def test_every_block_is_at_least_as_good_as_max():
    w = _weight(seed=5)
    spec, g = _spec(), w.abs().amax()
    by_max = block_amax(w, (16,))
    chosen, _ = search_block_amax(w, spec, g, by_max, fp8_scale_candidates(), sweep=True)
    err_max = to_blocks((ops.fake_quant(w, spec, g, block_amax=by_max) - w).square(), (16,)).sum(-1)
    err_mse = to_blocks((ops.fake_quant(w, spec, g, block_amax=chosen) - w).square(), (16,)).sum(-1)
    assert bool((err_mse <= err_max).all())
    assert float(err_mse.sum()) < 0.9 * float(err_max.sum())  # the planted global outlier leaves room


@pytest.mark.parametrize("backend", ["cpu", "auto"])
def test_backends_choose_the_same_blocks(backend):
    w = _weight(seed=7, shape=(16, 72)).to(torch.bfloat16)  # a partial last block, bf16 weights
    spec, g = _spec(), w.float().abs().amax()
    ref = search_block_amax(w, spec, g, block_amax(w.float(), (16,)), fp8_scale_candidates(), True, "reference")
    other = search_block_amax(w, spec, g, block_amax(w.float(), (16,)), fp8_scale_candidates(), True, backend)
    assert torch.equal(ref[0], other[0]) and torch.equal(ref[1], other[1])


def test_max_calibrated_static_blocks_equal_dynamic_nvfp4_bit_for_bit():
    data = outlier_data()
    static_cfg = {"quant_cfg": {"*weight_quantizer": STATIC, "default": {"enable": False}}, "algorithm": "max"}
    dynamic_cfg = copy.deepcopy(static_cfg)
    dynamic_cfg["quant_cfg"]["*weight_quantizer"]["block_sizes"]["type"] = "dynamic"
    a = ql.quantize(mlp(), static_cfg, loop(data))
    b = ql.quantize(mlp(), dynamic_cfg, loop(data))
    assert a[0].weight_quantizer.block_amax is not None and b[0].weight_quantizer.block_amax is None
    assert torch.equal(a[0].weight_quantizer.block_amax, block_amax(a[0].weight.detach(), (16,)))
    for x in data:
        assert torch.equal(a(x), b(x))


def test_preset_searches_nvfp4_weights_and_keeps_max_elsewhere():
    data = outlier_data()
    cfg = copy.deepcopy(ql.NVFP4_W4A4_WEIGHT_MSE_FP8_SWEEP_CFG)
    cfg["quant_cfg"]["2.weight_quantizer"] = {"num_bits": 8, "axis": 0}  # INT8: the sweep leaves it at max
    by_sweep = ql.quantize(mlp(), cfg, loop(data))
    by_max = ql.quantize(mlp(), dict(cfg, algorithm="max"), loop(data))
    q, qm = by_sweep[0].weight_quantizer, by_max[0].weight_quantizer
    assert torch.equal(q.amax, qm.amax)  # the global amax stays the max-calibrated one
    assert not torch.equal(q.block_amax, qm.block_amax)
    w = by_sweep[0].weight.detach()
    assert float((q(w) - w).square().sum()) < float((qm(w) - w).square().sum())
    assert torch.equal(by_sweep[2].weight_quantizer.amax, by_max[2].weight_quantizer.amax)
    assert by_sweep[0].input_quantizer.block_amax is None  # dynamic NVFP4 activations


def test_multiplier_search_without_sweep_moves_static_block_amax():
    data = outlier_data()
    cfg = {"quant_cfg": {"*weight_quantizer": STATIC, "default": {"enable": False}}, "algorithm": "mse"}
    by_mse = ql.quantize(mlp(), cfg, loop(data))
    q = by_mse[0].weight_quantizer
    w = by_mse[0].weight.detach()
    ratio = q.block_amax / block_amax(w, (16,))
    assert bool(((ratio >= 0.25 - 1e-6) & (ratio <= 4.0 + 1e-6)).all()) and not bool((ratio == 1).all())


def _swept() -> nn.Module:
    return ql.quantize(mlp(), ql.NVFP4_W4A4_WEIGHT_MSE_FP8_SWEEP_CFG, loop(outlier_data()))


def test_save_restore_keeps_the_chosen_block_scales(tmp_path):
    model = _swept()
    ql.save(model, tmp_path / "q.pt")
    fresh = ql.restore(mlp(seed=0), tmp_path / "q.pt")
    assert torch.equal(fresh[0].weight_quantizer.block_amax, model[0].weight_quantizer.block_amax)
    x = outlier_data(n=1, seed=9)[0]
    assert torch.equal(fresh(x), model(x))
    sd = copy.deepcopy(model.state_dict())
    again = ql.convert(mlp(seed=0))
    ql.set_quantizer_by_cfg(again, ql.NVFP4_W4A4_WEIGHT_MSE_FP8_SWEEP_CFG)
    again.load_state_dict(sd)
    assert torch.equal(again(x), model(x))


def test_restore_refuses_a_block_amax_that_does_not_fit(tmp_path):
    model = _swept()
    state = ql.quantizer_state(model)
    state["quantizers"]["0.weight_quantizer"]["_block_amax"] = torch.ones(3, 3)
    with pytest.raises(ql.CheckpointError, match="_block_amax"):
        ql.restore_state(mlp(seed=0), state)


def test_real_quantization_packs_the_stored_block_scales():
    model = _swept()
    q, w = model[0].weight_quantizer, model[0].weight.detach()
    packed = real_quantize(w, q.spec, q.amax, block_amax=q.block_amax)
    assert torch.equal(dequantize(packed), q(w))
    plain = real_quantize(w, q.spec, q.amax)  # without them: the max-calibrated scales, another weight
    assert not torch.equal(dequantize(plain), q(w))


def test_block_amax_on_a_dynamic_quantizer_is_refused_by_name():
    q = ql.TensorQuantizer(QuantizerAttributeConfig.from_dict(dict(STATIC, block_sizes={-1: 16, "type": "dynamic", "scale_bits": (4, 3)})))
    with pytest.raises(ValueError, match="static blocks"):
        q.block_amax = torch.ones(2, 1)


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.q_proj, self.k_proj, self.o_proj = nn.Linear(32, 32), nn.Linear(32, 32), nn.Linear(32, 32)
        self.gate_proj, self.up_proj = nn.Linear(32, 64), nn.Linear(32, 64)
        with torch.no_grad():
            for i, m in enumerate((self.q_proj, self.k_proj, self.o_proj, self.gate_proj, self.up_proj)):
                m.weight.mul_(1 + i)  # every global amax differs

    def forward(self, x):
        return self.o_proj(self.q_proj(x) + self.k_proj(x)) + (self.gate_proj(x) * self.up_proj(x)).sum(-1, keepdim=True)


def test_siblings_share_their_global_amax_before_the_search():
    model = ql.quantize(_Block(), ql.NVFP4_W4A4_WEIGHT_MSE_FP8_SWEEP_CFG, lambda m: m(torch.randn(4, 32)))
    amax = {n: float(getattr(model, n).weight_quantizer.amax) for n in ("q_proj", "k_proj", "o_proj", "gate_proj", "up_proj")}
    own = {n: float(getattr(model, n).weight.abs().max()) for n in amax}
    assert amax["q_proj"] == amax["k_proj"] == max(own["q_proj"], own["k_proj"])
    assert amax["gate_proj"] == amax["up_proj"] == max(own["gate_proj"], own["up_proj"])
    assert amax["o_proj"] == own["o_proj"]
    dynamic = ql.quantize(_Block(), ql.NVFP4_DEFAULT_CFG, lambda m: m(torch.randn(4, 32)))
    assert float(dynamic.q_proj.weight_quantizer.amax) == own["q_proj"] != own["k_proj"]  # max calibration shares nothing


def test_restore_into_a_meta_built_model_keeps_the_block_amax(tmp_path):
    model = _swept()
    ql.save(model, tmp_path / "q.pt")
    with torch.device("meta"):
        fresh = mlp(seed=0)
    fresh = ql.restore(fresh, tmp_path / "q.pt")
    fresh.to_empty(device="cpu")
    fresh.load_state_dict({k: v for k, v in model.state_dict().items() if not k.split(".")[-1].startswith("_")}, strict=False)
    assert torch.equal(fresh[0].weight_quantizer.block_amax, model[0].weight_quantizer.block_amax)
    x = outlier_data(n=1, seed=9)[0]
    assert torch.equal(fresh(x), model(x))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_sweep_on_the_gpu_chooses_what_the_cpu_reference_chooses():
    w = _weight(seed=11, shape=(256, 520))
    spec, g = _spec(), w.abs().amax()
    ref = search_block_amax(w, spec, g, block_amax(w, (16,)), fp8_scale_candidates(), True, "reference")
    got = search_block_amax(w.cuda(), spec, g.cuda(), block_amax(w, (16,)).cuda(), fp8_scale_candidates(), True, "auto")
    assert got[0].is_cuda
    assert torch.equal(got[1].cpu(), ref[1]) and torch.equal(got[0].cpu(), ref[0])


def test_max_calibration_of_static_blocks_shares_sibling_global_amax_too():
    cfg = dict(ql.NVFP4_W4A4_WEIGHT_MSE_FP8_SWEEP_CFG, algorithm="max")
    model = ql.quantize(_Block(), cfg, lambda m: m(torch.randn(4, 32)))
    assert float(model.q_proj.weight_quantizer.amax) == float(model.k_proj.weight_quantizer.amax) == float(model.k_proj.weight.abs().max())
    # the block amax stay the blocks' own max: shared global amax, max block scales
    assert torch.equal(model.q_proj.weight_quantizer.block_amax, block_amax(model.q_proj.weight.detach(), (16,)))


def test_sweep_under_tensor_parallelism_is_refused_by_name():
    from quantlib.calib.activations import max_calibrate
    from quantlib.calib.mse import run_mse
    from quantlib.calib.registry import CalibContext
    from quantlib.calib_config import MseConfig

    model = ql.convert(mlp())
    ql.set_quantizer_by_cfg(model, ql.NVFP4_W4A4_WEIGHT_MSE_FP8_SWEEP_CFG)
    ctx = CalibContext(None, lambda m: max_calibrate(m, None, "max_of_peers"), tensor_parallel=True)
    with pytest.raises(ValueError, match=r"0.weight_quantizer: mse on NVFP4 static block scales under tensor parallelism"):
        run_mse(model, MseConfig(fp8_scale_sweep=True), ctx)
