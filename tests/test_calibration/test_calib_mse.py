"""mse: the amax each group picks is the one a brute-force loop over candidates and groups picks, a
known closed-form case, the end-to-end recipe, and ModelOpt 0.47's choice on the same layer."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import quantlib as ql
from quantlib import formats
from quantlib.calib.mse import multipliers, search_amax
from quantlib.calib_config import MseConfig
from quantlib.config import QuantizerAttributeConfig
from quantlib.formats.blocks import to_blocks

FORMATS = {
    "int4_block128": {"num_bits": 4, "block_sizes": {-1: 128}},
    "int4_block16_partial": {"num_bits": 4, "block_sizes": {-1: 16}},
    "int8_per_channel": {"num_bits": 8, "axis": 0},
    "int8_per_tensor": {"num_bits": 8, "axis": None},
    "fp8_per_tensor": {"num_bits": (4, 3), "axis": None},
    "fp8_per_channel": {"num_bits": (4, 3), "axis": 0},
    "fp8_block_2d": {"num_bits": (4, 3), "block_sizes": {-1: 32, -2: 32}},
}


def _weight(seed: int = 0, shape=(40, 200)) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(shape, generator=g)
    w[3, 7] = 25.0  # an outlier: its group's best amax is well away from the others'
    return w


def _brute_force(w: torch.Tensor, attrs: QuantizerAttributeConfig, amax: torch.Tensor, cands: torch.Tensor) -> torch.Tensor:
    """Index of the best candidate per group, one reference quantization per candidate and one
    Python comparison per group (the slow, obvious way)."""
    spec = attrs.format_spec()
    flat_amax = amax.reshape(-1)
    best = torch.zeros(flat_amax.numel(), dtype=torch.long)
    best_loss = torch.full((flat_amax.numel(),), float("inf"))
    for k, c in enumerate(cands):
        xq = formats.fake_quant(w, spec, amax * c)
        err = (xq - w).square()
        if spec.block is not None:
            per_group = to_blocks(err, spec.block).sum(-1).reshape(-1)
        elif amax.dim() == 0:
            per_group = err.sum().reshape(1)
        else:
            per_group = err.sum_to_size(amax.shape).reshape(-1)
        for g in range(flat_amax.numel()):
            if per_group[g] < best_loss[g]:
                best_loss[g], best[g] = per_group[g], k
    return best.reshape(amax.shape)


@pytest.mark.parametrize("fmt", sorted(FORMATS))
def test_search_picks_what_a_brute_force_loop_picks(fmt):
    attrs = QuantizerAttributeConfig.from_dict(FORMATS[fmt])
    w = _weight()
    q = ql.TensorQuantizer(attrs)
    q.calibrate(w)
    cands = multipliers(MseConfig())
    best_amax, idx = search_amax(w, attrs.format_spec(), q.amax, cands)
    want = _brute_force(w, attrs, q.amax, cands)
    assert torch.equal(idx, want)
    assert torch.equal(best_amax, q.amax * cands[want])
    assert best_amax.shape == q.amax.shape


def test_grid_is_modelopts():
    c = multipliers(MseConfig())
    assert c.numel() == 39 and c[0] == 0.25 and c[-1] == 4.0
    assert multipliers(MseConfig(step_size=0.5, start_multiplier=0.5, stop_multiplier=2.0)).tolist() == [0.5, 1.0, 1.5, 2.0]


def test_exactly_representable_channel_keeps_its_max_amax():
    """Closed form: a channel whose values are k * amax / 127 quantizes without error at multiplier
    1 and with some at every other candidate, so 1 is chosen; an INT4 channel with one large outlier
    among small values is clipped."""
    g = torch.Generator().manual_seed(1)
    exact = torch.randint(-127, 128, (1, 64), generator=g).float() * (2.0 / 127)
    exact[0, 0] = 2.0
    attrs = QuantizerAttributeConfig(num_bits=8, axis=0)
    cands = multipliers(MseConfig(step_size=0.125, start_multiplier=0.5, stop_multiplier=1.5))
    best, idx = search_amax(exact, attrs.format_spec(), exact.abs().amax(1, keepdim=True), cands)
    assert cands[idx[0, 0]] == 1.0 and best[0, 0] == 2.0
    # INT4, 1023 values uniform in [-1, 1] and one at 8: at amax 8 (step 8/7) each costs ~0.1 (~100
    # in all); at amax 4 the outlier costs 16 and the rest ~ 1023 * (4/7)^2 / 12 = 28
    outlier = torch.linspace(-1, 1, 1024).reshape(1, 1024)
    outlier[0, 5] = 8.0
    int4 = QuantizerAttributeConfig(num_bits=4, axis=0)
    best, idx = search_amax(outlier, int4.format_spec(), outlier.abs().amax(1, keepdim=True), multipliers(MseConfig()))
    assert 0.25 < best[0, 0] / 8.0 < 0.75


def test_candidate_chunks_do_not_change_the_choice(monkeypatch):
    from quantlib.calib import mse

    attrs = QuantizerAttributeConfig(num_bits=4, block_sizes={-1: 16})
    w = _weight()
    amax = formats.block_amax(w, (16,))
    whole = search_amax(w, attrs.format_spec(), amax, multipliers(MseConfig()))
    monkeypatch.setattr(mse, "CPU_CHUNK_ELEMENTS", w.numel() * 3)  # 13 chunks of 3 candidates
    assert all(torch.equal(a, b) for a, b in zip(whole, search_amax(w, attrs.format_spec(), amax, multipliers(MseConfig()))))
    monkeypatch.setattr(mse, "CPU_CHUNK_ELEMENTS", 1 << 24)  # every candidate in one call
    assert all(torch.equal(a, b) for a, b in zip(whole, search_amax(w, attrs.format_spec(), amax, multipliers(MseConfig()))))


def test_cpu_search_keeps_each_call_cache_sized(monkeypatch):
    """On the CPU a kernel call of the search quantizes at most 2^18 elements (1 MiB of fp32 per
    temporary): the 2^24 of a GPU call made the CPU search memory-bound, slower than ModelOpt's."""
    from quantlib.calib import mse

    sizes = []
    fake_quant = mse.ops.fake_quant
    monkeypatch.setattr(mse.ops, "fake_quant", lambda x, *a, **k: sizes.append(x.numel()) or fake_quant(x, *a, **k))
    attrs = QuantizerAttributeConfig(num_bits=4, block_sizes={-1: 128})
    w = _weight(shape=(128, 256))  # 32768 elements: 8 of the 39 candidates a call
    search_amax(w, attrs.format_spec(), formats.block_amax(w, (128,)), multipliers(MseConfig()))
    assert max(sizes) <= 1 << 18 and sum(sizes) == len(multipliers(MseConfig())) * w.numel()
    assert mse.chunk_elements(torch.device("cuda")) == 1 << 24  # a GPU needs large calls


@pytest.mark.parametrize("backend", ["reference", "cpu"])
def test_backends_choose_the_same(backend):
    attrs = QuantizerAttributeConfig(num_bits=4, block_sizes={-1: 32})
    w = _weight(2)
    amax = formats.block_amax(w, (32,))
    ref = search_amax(w, attrs.format_spec(), amax, multipliers(MseConfig()), "reference")
    got = search_amax(w, attrs.format_spec(), amax, multipliers(MseConfig()), backend)
    assert torch.equal(ref[1], got[1]) and torch.equal(ref[0], got[0])


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(256, 64), nn.ReLU(), nn.Linear(64, 32)).eval()


def _data():
    g = torch.Generator().manual_seed(4)
    return [torch.randn(8, 256, generator=g) for _ in range(2)]


def test_quantize_with_mse_lowers_the_weight_error_and_keeps_activation_max():
    cfg = {"quant_cfg": {"default": {"enable": False}, "*weight_quantizer": {"num_bits": 4, "block_sizes": {-1: 128}},
                         "*input_quantizer": {"num_bits": 8}}}
    data = _data()
    loop = lambda m: [m(x) for x in data]  # noqa: E731
    by_max = ql.quantize(_mlp(), dict(cfg, algorithm="max"), loop)
    by_mse = ql.quantize(_mlp(), dict(cfg, algorithm={"method": "mse"}), loop)
    for i in (0, 2):
        w = by_max[i].weight.detach()
        err_max = (by_max[i].weight_quantizer(w) - w).square().sum()
        err_mse = (by_mse[i].weight_quantizer(w) - w).square().sum()
        assert err_mse < err_max
        assert not torch.equal(by_mse[i].weight_quantizer.amax, by_max[i].weight_quantizer.amax)
        assert torch.equal(by_mse[i].input_quantizer.amax, by_max[i].input_quantizer.amax)


@pytest.mark.parametrize("value", [{"step_size": 0}, {"start_multiplier": -1.0}, {"stop_multiplier": 0.1}, {"step_size": "0.1"}])
def test_invalid_fields_are_refused_by_name(value):
    key = next(iter(value))
    with pytest.raises(ql.ConfigError, match=key):
        ql.QuantizeConfig.from_any({"quant_cfg": {}, "algorithm": dict(method="mse", **value)})


def test_same_amax_as_modelopt_int4_blocks():
    mtq = pytest.importorskip("modelopt.torch.quantization")
    data = _data()
    loop = lambda m: [m(x) for x in data]  # noqa: E731
    mo_cfg = copy.deepcopy(mtq.INT4_BLOCKWISE_WEIGHT_ONLY_CFG)
    mo_cfg["algorithm"] = {"method": "mse", "step_size": 0.1}
    theirs = mtq.quantize(_mlp(), mo_cfg, loop)
    # ModelOpt's integers are full range ([-8, 7]): narrow_range=False for the same numerics
    ours = ql.quantize(_mlp(), {"quant_cfg": {"default": {"enable": False}, "*weight_quantizer": {"num_bits": 4, "block_sizes": {-1: 128},
                                                                                                  "narrow_range": False}},
                                                                                                  "algorithm": "mse"}, loop)
    for i in (0, 2):
        a, b = theirs[i].weight_quantizer.amax, ours[i].weight_quantizer.amax
        assert torch.equal(a.reshape(b.shape).float(), b)


def test_grouped_members_are_searched_each_on_its_own_weight(two_experts):
    cfg = {"quant_cfg": {"default": {"enable": False}, "*weight_quantizer": {"num_bits": 4, "axis": 0}}, "algorithm": "mse"}
    model = ql.quantize(two_experts(), cfg, None)
    attrs = QuantizerAttributeConfig(num_bits=4, axis=0)
    cands = multipliers(MseConfig())
    for member, w in zip(model.weight_quantizer, (model.w0, model.w1)):
        w = w.detach()
        want, _ = search_amax(w, attrs.format_spec(), w.abs().amax(1, keepdim=True), cands)
        assert torch.equal(member.amax, want)
    assert not torch.equal(model.weight_quantizer[0].amax, model.weight_quantizer[1].amax)
    assert any(not torch.equal(m.amax, w.detach().abs().amax(1, keepdim=True)) for m, w in zip(model.weight_quantizer,
                                                                                               (model.w0, model.w1)))
