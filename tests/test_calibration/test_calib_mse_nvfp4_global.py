"""mse on NVFP4 weights with dynamic block scales searches the global amax: among ModelOpt's multiples of
the max amax, the one whose fake quant (block scales recomputed against it) has the least squared error
over the whole weight; a planted case with a known answer below the max, a brute-force loop written
here, every CPU backend choosing alike, and ModelOpt 0.47's own mse_calibrate on the
same layer (its CUDA-only dynamic block op replaced by quantlib's fake quant)."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import quantlib as ql
from quantlib.calib.mse import multipliers, search_global_amax
from quantlib.calib_config import MseConfig
from quantlib.config import QuantizerAttributeConfig
from quantlib.export.iterate import iter_packed
from quantlib.export.quantize import real_quantize
from quantlib.formats import dequantize
from quantlib.kernels import ops

DYNAMIC = {"num_bits": (2, 1), "block_sizes": {-1: 16, "type": "dynamic", "scale_bits": (4, 3)}}
_GRID = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])


def _spec():
    return QuantizerAttributeConfig.from_dict(DYNAMIC).format_spec()


def _e2m1_round(y: torch.Tensor) -> torch.Tensor:
    """Nearest E2M1 magnitude (ties to the even code), saturating at 6: by distance, written afresh."""
    mag = y.abs().clamp(max=6.0)
    dist = (mag.unsqueeze(-1) - _GRID).abs()
    ties = dist == dist.min(dim=-1, keepdim=True).values
    even = ties & (torch.arange(8) % 2 == 0)
    idx = torch.where(even.any(-1), even.float().argmax(-1), ties.float().argmax(-1))
    return torch.sign(y) * _GRID[idx]


def _nvfp4(w: torch.Tensor, global_amax: torch.Tensor) -> torch.Tensor:
    """NVFP4 fake quant with dynamic blocks of 16 (``w``'s last dim a multiple of 16), from the spec."""
    s2 = global_amax / torch.tensor(2688.0)
    blocks = w.reshape(-1, 16)
    sb = blocks.abs().amax(-1, keepdim=True) / (6.0 * s2)
    sb = torch.where(sb == 0, torch.ones_like(sb), sb).clamp(2.0**-9, 448.0).to(torch.float8_e4m3fn).float()
    d = sb * s2
    return (_e2m1_round(blocks / d) * d).reshape(w.shape)


def _brute_force(w: torch.Tensor, amax: torch.Tensor, cands: torch.Tensor) -> int:
    """Index of the first candidate multiplier of least summed squared error, one at a time."""
    errs = [float((_nvfp4(w, amax * c) - w).square().sum()) for c in cands]
    return min(range(len(errs)), key=lambda k: (errs[k], k))


def _planted(k: int = 7, rows: int = 16, cols: int = 64, seed: int = 0) -> torch.Tensor:
    """Every block holds E2M1 values times the dequant scale ``d`` that global amax ``cands[k]`` gives a
    block of max ``6 d`` (its E4M3 scale is then 448): exact there, and off the grid under every other
    candidate; one outlier 1.0 (the max amax) costs ``(1 - cands[k])^2`` there, clipped to ``6 d``."""
    g = torch.Generator().manual_seed(seed)
    s2 = (torch.tensor(1.0) * multipliers(MseConfig())[k]) / torch.tensor(2688.0)
    d = torch.tensor(448.0) * s2
    values = _GRID[torch.randint(0, 8, (rows, cols), generator=g)] * (torch.randint(0, 2, (rows, cols), generator=g) * 2 - 1)
    values[:, ::16] = 6.0  # each block's max is 6 d
    w = values * d
    w[3, 5] = 1.0
    return w


def test_planted_outlier_chooses_the_smaller_global_amax_a_brute_force_loop_chooses():
    w, cands = _planted(), multipliers(MseConfig())
    amax = w.abs().amax()
    want = _brute_force(w, amax, cands)
    assert want == 7 and cands[want] < 1  # 0.9408: the one candidate under which the bulk is exact
    best, idx = search_global_amax(w, _spec(), amax, cands)
    assert int(idx) == want and torch.equal(best, amax * cands[want])
    err_best = float((ops.fake_quant(w, _spec(), best) - w).square().sum())
    err_max = float((ops.fake_quant(w, _spec(), amax) - w).square().sum())
    assert err_best == pytest.approx((1 - float(cands[7])) ** 2, rel=1e-3) and err_best < err_max / 5


@pytest.mark.parametrize("seed", [0, 1])
def test_random_weight_picks_what_a_brute_force_loop_picks(seed):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(24, 80, generator=g) * torch.linspace(0.01, 2.0, 80)
    w[5, 9] = 12.0
    amax, cands = w.abs().amax(), multipliers(MseConfig())
    best, idx = search_global_amax(w, _spec(), amax, cands)
    assert int(idx) == _brute_force(w, amax, cands) and torch.equal(best, amax * cands[idx])


@pytest.mark.parametrize("backend", ["reference", "cpu"])
def test_every_backend_chooses_alike(backend):
    w = _planted(seed=3)
    cands = multipliers(MseConfig())
    ref = search_global_amax(w, _spec(), w.abs().amax(), cands, "reference")
    got = search_global_amax(w, _spec(), w.abs().amax(), cands, backend)
    assert torch.equal(got[0], ref[0]) and torch.equal(got[1], ref[1])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_on_the_gpu_the_choice_is_the_cpus():
    g = torch.Generator().manual_seed(11)
    w = torch.randn(256, 528, generator=g) * torch.logspace(-4, 1, 528)
    ref = search_global_amax(w, _spec(), w.abs().amax(), multipliers(MseConfig()))
    on_gpu = search_global_amax(w.cuda(), _spec(), w.abs().amax().cuda(), multipliers(MseConfig()))
    assert on_gpu[0].is_cuda and torch.equal(on_gpu[0].cpu(), ref[0]) and torch.equal(on_gpu[1].cpu(), ref[1])


def _linear_with(w: torch.Tensor) -> nn.Module:
    m = nn.Sequential(nn.Linear(w.shape[1], w.shape[0]))
    with torch.no_grad():
        m[0].weight.copy_(w)
    return m.eval()


def test_quantize_stores_the_searched_global_amax_and_fake_quant_and_export_use_it():
    w = _planted()
    cfg = {"quant_cfg": {"default": {"enable": False}, "*weight_quantizer": DYNAMIC}, "algorithm": "mse"}
    by_mse = ql.quantize(_linear_with(w), cfg, None)
    by_max = ql.quantize(_linear_with(w), dict(cfg, algorithm="max"), None)
    q = by_mse[0].weight_quantizer
    assert torch.equal(by_max[0].weight_quantizer.amax, w.abs().amax())
    assert torch.equal(q.amax.reshape(()), w.abs().amax() * multipliers(MseConfig())[7])
    assert torch.equal(q(w), ops.fake_quant(w, _spec(), q.amax))  # the forward uses it
    assert not torch.equal(q(w), by_max[0].weight_quantizer(w))
    (packed,) = iter_packed(by_mse, "modelopt_nvfp4")  # so does the export: its global scale is amax / 2688
    assert torch.equal(packed.tensors["weight_scale_2"], q.amax.reshape(()) / 2688.0)
    assert torch.equal(dequantize(real_quantize(w, q.spec, q.amax)), q(w))


def test_same_global_amax_as_modelopts_mse_calibrate(monkeypatch):
    """ModelOpt 0.47's mse on W4A16_NVFP4_CFG: its MseCalibrator searches the per-tensor amax of each
    dynamic-block NVFP4 weight quantizer (the op's global amax); its op needs CUDA, so it runs here with
    quantlib's fake quant given the same arguments."""
    mtq = pytest.importorskip("modelopt.torch.quantization")
    from modelopt.torch.quantization import tensor_quant

    seen = []

    def op(inputs, block_size, amax, num_bits, exponent_bits, scale_num_bits, scale_exponent_bits):
        assert (block_size, num_bits, exponent_bits, scale_num_bits, scale_exponent_bits) == (16, 4, 2, 8, 4)
        seen.append(float(amax))
        return ops.fake_quant(inputs, _spec(), amax.reshape(()), "reference").to(inputs.dtype)

    monkeypatch.setattr(tensor_quant, "dynamic_block_quantize_op", op)

    def model() -> nn.Module:
        torch.manual_seed(0)
        m = nn.Sequential(nn.Linear(64, 48), nn.ReLU(), nn.Linear(48, 16), nn.ReLU(), nn.Linear(16, 32)).eval()
        with torch.no_grad():
            m[4].weight.copy_(_planted(rows=32, cols=16, seed=5))
        return m

    g = torch.Generator().manual_seed(4)
    data = [torch.randn(8, 64, generator=g) for _ in range(2)]
    loop = lambda m: [m(x) for x in data]  # noqa: E731
    cfg = copy.deepcopy(mtq.W4A16_NVFP4_CFG)
    cfg["algorithm"] = {"method": "mse"}
    theirs = mtq.quantize(model(), copy.deepcopy(cfg), loop)
    assert len(set(seen)) >= 3 * 39  # every candidate of the three weights went through the op
    ours = ql.quantize(model(), cfg, loop)
    for i in (0, 2, 4):
        a, b = theirs[i].weight_quantizer.amax, ours[i].weight_quantizer.amax
        assert torch.equal(a.reshape(b.shape).float(), b)
    assert torch.equal(ours[4].weight_quantizer.amax.reshape(()), ours[4].weight.detach().abs().amax() * multipliers(MseConfig())[7])
