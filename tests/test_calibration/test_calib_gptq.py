"""gptq: lower output error than max on correlated inputs, the textbook algorithm (a reference written
here) bit for bit, fake quant of the updated weight is the weight, layer by layer equals in memory,
options refused by name, fused experts each on their own routed tokens."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import quantlib as ql
from quantlib.calib.gptq import gptq_quantize
from quantlib.calib_config import GptqConfig, parse_algorithm
from quantlib.nn.tensor_quantizer import CalibrationError

from ._models import loop

D_IN, D_OUT = 96, 40
INT4 = {"num_bits": 4, "block_sizes": {-1: 32, "type": "static"}, "narrow_range": False}
WEIGHTS = {
    "int4-block": INT4,
    "int8-channel": {"num_bits": 8, "axis": 0},
    "int4-tensor": {"num_bits": 4, "axis": None},
    "fp8-tensor": {"num_bits": (4, 3), "axis": None},
    "nvfp4-static": {"num_bits": (2, 1), "block_sizes": {-1: 16, "type": "static", "scale_bits": (4, 3)}},
    "w4a8-chain": [INT4, {"num_bits": (4, 3), "axis": None}],
}


def _cfg(algorithm, weight=INT4, pattern: str = "*") -> dict:
    return {"quant_cfg": {"default": {"enable": False}, f"{pattern}weight_quantizer": weight}, "algorithm": algorithm}


def correlated(n: int = 4, rows: int = 64, seed: int = 1) -> list[torch.Tensor]:
    """Inputs with strongly correlated channels (a random mixing of white noise), where GPTQ helps most."""
    mix = torch.randn(D_IN, D_IN, generator=torch.Generator().manual_seed(0))
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(rows, D_IN, generator=g) @ mix for _ in range(n)]


def linear(seed: int = 0, dtype: torch.dtype = torch.float32) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(D_IN, D_OUT, bias=False)).eval().to(dtype)


def output_error(model: nn.Module, ref: nn.Module, data: list[torch.Tensor]) -> float:
    with torch.no_grad():
        return sum(float((model(x) - ref(x)).float().pow(2).mean()) for x in data)


@pytest.mark.parametrize("weight", list(WEIGHTS))
def test_lower_output_error_than_max_and_fake_quant_of_the_weight_is_the_weight(weight):
    cal, held = correlated(seed=1), correlated(seed=2)
    base = linear()
    err = {}
    for algo in ("max", "gptq"):
        model = ql.quantize(copy.deepcopy(base), _cfg(algo, WEIGHTS[weight]), loop(cal))
        err[algo] = output_error(model, base, held)
    assert err["gptq"] < 0.8 * err["max"], err
    wq, w = model[0].weight_quantizer, model[0].weight.detach()
    with torch.no_grad():  # what the forward (and export) quantizes is what GPTQ chose
        first = wq if isinstance(wq, ql.TensorQuantizer) else wq[0]
        assert torch.equal(first(w), w)
    assert not torch.equal(w, base[0].weight)


def test_bf16_weight_is_updated_in_place_and_stays_a_fixed_point():
    base = linear(dtype=torch.bfloat16)
    param = base[0].weight
    model = ql.quantize(base, _cfg("gptq"), loop([x.bfloat16() for x in correlated()]))
    w = model[0].weight
    assert w is param and w.dtype == torch.bfloat16
    with torch.no_grad():
        assert torch.equal(model[0].weight_quantizer(w), w)


# ------------------------------------------------------------------------------ the textbook algorithm


def _int4_column(col: torch.Tensor, amax: torch.Tensor, j: int, block: int = 32) -> torch.Tensor:
    """Column ``j`` of a weight in full-range INT4 with its block's amax (docs/design.md §3), by hand."""
    a = amax[:, j // block]
    scale = torch.full_like(a, 7.0) / a  # one IEEE division (7.0 / a would be reciprocal(a) * 7)
    return torch.clamp(torch.round(col * scale), -8, 7) / scale


def textbook_gptq(w: torch.Tensor, xs: list[torch.Tensor], amax: torch.Tensor, perc_damp: float, act_order: bool) -> torch.Tensor:
    """Frantar et al.'s Algorithm 1 without lazy batches: after each column, every later column is updated."""
    W = w.clone().float()
    H = torch.zeros(W.shape[1], W.shape[1])
    n = 0
    for x in xs:
        H += x.T @ x
        n += x.shape[0]
    H = H * (2.0 / n)
    dead = torch.diag(H) == 0
    H[dead, dead] = 1
    W[:, dead] = 0
    perm = torch.argsort(torch.diag(H), descending=True) if act_order else torch.arange(W.shape[1])
    W, H = W[:, perm], H[perm][:, perm]
    H += perc_damp * torch.mean(torch.diag(H)) * torch.eye(H.shape[0])
    U = torch.linalg.cholesky(torch.cholesky_inverse(torch.linalg.cholesky(H)), upper=True)
    for i in range(W.shape[1]):
        q = _int4_column(W[:, i], amax, int(perm[i]))  # the column's own group (its index in w)
        err = (W[:, i] - q) / U[i, i]
        W[:, i:] -= torch.outer(err, U[i, i:])
        W[:, i] = q
    return W[:, torch.argsort(perm)]


@pytest.mark.parametrize("act_order", [False, True])
def test_one_block_equals_the_textbook_algorithm_bit_for_bit(act_order):
    cal = correlated(seed=3)
    base = linear(seed=4)
    w = base[0].weight.detach().clone()
    amax = w.abs().reshape(D_OUT, -1, 32).amax(-1)
    model = ql.quantize(base, _cfg({"method": "gptq", "block_size": D_IN, "act_order": act_order, "perc_damp": 0.05}), loop(cal))
    want = textbook_gptq(w, cal, amax, 0.05, act_order)
    assert torch.equal(model[0].weight_quantizer.amax, amax)
    assert torch.equal(model[0].weight.detach(), want)


def test_lazy_batches_equal_the_textbook_algorithm_to_fp32_rounding():
    cal = correlated(seed=3)
    base = linear(seed=4)
    w = base[0].weight.detach().clone()
    want = textbook_gptq(w, cal, w.abs().reshape(D_OUT, -1, 32).amax(-1), 0.01, False)
    got = ql.quantize(base, _cfg({"method": "gptq", "block_size": 16}), loop(cal))[0].weight.detach()
    step = (w.abs().reshape(D_OUT, -1, 32).amax(-1) / 7.0).repeat_interleave(32, dim=1)
    differ = (got != want).float().mean().item()
    assert differ < 0.01, differ  # a rounding tie may fall the other way after fp32-different updates
    assert bool(((got - want).abs() <= step * 1.0001).all())


def test_dead_input_columns_are_zeroed():
    cal = [x.clone() for x in correlated()]
    for x in cal:
        x[:, 5] = 0
    model = ql.quantize(linear(), _cfg("gptq"), loop(cal))
    assert bool((model[0].weight[:, 5] == 0).all())


# ------------------------------------------------------------------------------ layer by layer


class Blocks(nn.Module):
    """Two residual MLP blocks in a ModuleList (the decoder layers layer-by-layer calibration finds)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(5)
        self.layers = nn.ModuleList(nn.Sequential(nn.Linear(D_IN, 64), nn.ReLU(), nn.Linear(64, D_IN)) for _ in range(2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = x + layer(x)
        return x


def test_layer_by_layer_equals_in_memory():
    cal = correlated()
    mem = ql.quantize(Blocks().eval(), _cfg("gptq"), loop(cal))
    seq = ql.quantize(Blocks().eval(), _cfg("gptq"), loop(cal), sequential=True)
    changed = 0
    for (name, p), (_, q) in zip(mem.named_parameters(), seq.named_parameters()):
        assert torch.equal(p, q), name
        changed += not torch.equal(p, Blocks().get_parameter(name))
    assert changed == 4  # the four weights (biases are not quantized)


@pytest.mark.parametrize("option", ["offload_folder", "resume_file"])
def test_layer_by_layer_refuses_what_would_lose_the_updated_weights(option, tmp_path):
    """Two config values that cannot go together: a ConfigError (as every other config refusal)."""
    with pytest.raises(ql.ConfigError, match=f"'gptq' rewrites the weights.*{option}"):
        ql.quantize(Blocks().eval(), _cfg("gptq"), loop(correlated()), sequential={option: str(tmp_path / "x")})


# ------------------------------------------------------------------------------ options and refusals


@pytest.mark.parametrize(
    "bad, words",
    [
        ({"perc_damp": 0.0}, ["perc_damp=0.0"]),
        ({"perc_damp": 1.5}, ["perc_damp=1.5"]),
        ({"block_size": 0}, ["block_size=0"]),
        ({"block_size": 1.5}, ["block_size", "1.5"]),
        ({"act_order": "yes"}, ["act_order", "'yes'"]),
        ({"actorder": "group"}, ["actorder='group'"]),
        ({"perc_damp": 0.1, "dampening_frac": 0.2}, ["'dampening_frac'", "0.2", "'perc_damp'"]),
        ({"percdamp": 0.1}, ["'percdamp'", "0.1"]),
    ],
)
def test_invalid_options_are_refused_naming_key_and_value(bad, words):
    with pytest.raises(ql.ConfigError) as info:
        ql.QuantizeConfig.from_any(_cfg(dict(method="gptq", **bad)))
    for w in words:
        assert w in str(info.value), (w, str(info.value))


def test_other_libraries_names_are_read_as_modelopts():
    assert parse_algorithm("gptq") == GptqConfig(perc_damp=0.01, block_size=128, act_order=False)
    assert parse_algorithm({"method": "gptq", "dampening_frac": 0.05, "actorder": "static"}) == GptqConfig(perc_damp=0.05, act_order=True)
    autogptq = {"method": "gptq", "damp_percent": 0.1, "desc_act": True, "fused": True}
    assert parse_algorithm(autogptq) == GptqConfig(perc_damp=0.1, act_order=True, fused=True)
    assert parse_algorithm({"method": "gptq", "perc_damp": None, "block_size": None, "actorder": None}) == GptqConfig()


@pytest.mark.parametrize(
    "weight, words",
    [
        ({"num_bits": (2, 1), "block_sizes": {-1: 16, "type": "dynamic", "scale_bits": (4, 3)}}, ["dynamic block scales"]),
        ({"num_bits": (4, 3), "block_sizes": {-1: 32, "type": "dynamic", "scale_bits": (8, 0)}}, ["dynamic"]),
        ({"num_bits": 4, "block_sizes": {-1: 32, "type": "dynamic"}}, ["dynamic"]),
    ],
)
def test_dynamic_scales_are_refused_by_quantizer_name(weight, words):
    with pytest.raises(CalibrationError, match="0.weight_quantizer: gptq .*" + words[0]):
        ql.quantize(linear(), _cfg("gptq", weight), loop(correlated()))


def test_weight_pre_quant_scale_is_refused_by_name():
    model = ql.quantize(linear(), _cfg("awq_lite"), loop(correlated()))
    with pytest.raises(CalibrationError, match="0.weight_quantizer: gptq .*pre_quant_scale"):
        ql.calibrate(model, "gptq", loop(correlated()))


def test_without_forward_loop_weights_get_max_and_a_warning(caplog):
    base = linear()
    model = ql.quantize(copy.deepcopy(base), _cfg("gptq"), None)
    assert torch.equal(model[0].weight, base[0].weight)
    assert "gptq needs a forward_loop" in caplog.text


def test_unreached_linear_is_named():
    class Skip(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.used, self.unused = nn.Linear(D_IN, 8), nn.Linear(D_IN, 8)

        def forward(self, x):
            return self.used(x)

    with pytest.raises(CalibrationError, match="never reached.*unused"):
        ql.quantize(Skip(), _cfg("gptq"), loop(correlated()))


def test_nan_input_is_refused_by_name():
    cal = correlated()
    cal[1][3, 4] = float("nan")
    with pytest.raises(CalibrationError, match="0.input_quantizer: gptq's Hessian saw NaN"):
        ql.quantize(linear(), _cfg("gptq"), loop(cal))


def test_gptq_quantize_does_not_modify_its_inputs():
    w, h = torch.randn(8, 16), torch.eye(16) * 2
    w0, h0 = w.clone(), h.clone()
    gptq_quantize(w, h, lambda c, j: (c.round(), c.round()), GptqConfig(block_size=4))
    assert torch.equal(w, w0) and torch.equal(h, h0)


# ------------------------------------------------------------------------------ fused experts


@pytest.mark.parametrize("family", ["qwen3_moe", "gpt_oss"])
def test_each_expert_equals_a_linear_gptqd_on_its_routed_tokens(family):
    pytest.importorskip("transformers")
    from .test_calib_fused_experts import IDLE, E, batches, build, reference, routed_inputs

    data = batches()
    model = build(family=family)
    before = {proj: getattr(model.model.layers[0].mlp.experts, proj).detach().clone() for proj in ("gate_up_proj", "down_proj")}
    routed = routed_inputs(model, data)
    ql.quantize(model, _cfg("gptq", INT4, "*experts*"), loop(data))
    experts = model.model.layers[0].mlp.experts
    for proj in ("gate_up_proj", "down_proj"):
        stored = getattr(experts, proj)
        for e in range(E):
            if e == IDLE:  # no tokens: max calibration, the weight untouched
                assert torch.equal(stored[e], before[proj][e]), (proj, e)
                continue
            ref = reference(build(family=family), proj, e, routed[(proj, e)], "gptq", INT4, None)
            got = stored[e].transpose(0, 1) if experts.is_transposed else stored[e]
            assert torch.equal(got, ref.weight), (proj, e)
            assert torch.equal(getattr(experts, f"{proj}_weight_quantizer")[e].amax, ref.weight_quantizer.amax), (proj, e)


# ------------------------------------------------------------------------------ ModelOpt, data parallel


def test_same_weights_as_modelopt_gptq_up_to_fp32_rounding():
    mtq = pytest.importorskip("modelopt.torch.quantization")
    cfg = copy.deepcopy(mtq.INT4_AWQ_CFG)
    cfg["algorithm"] = {"method": "gptq", "perc_damp": 0.01, "block_size": 128}
    cal, base = correlated(), nn.Sequential(nn.Linear(D_IN, 256, bias=False), nn.Linear(256, D_OUT, bias=False)).eval()
    theirs = mtq.quantize(copy.deepcopy(base), cfg, loop(cal))
    w = {"num_bits": 4, "block_sizes": {-1: 128, "type": "static"}, "narrow_range": False}
    ours = ql.quantize(copy.deepcopy(base), _cfg({"method": "gptq", "perc_damp": 0.01, "block_size": 128}, w), loop(cal))
    for i in (0, 1):
        a, b = ours[i].weight.detach(), theirs[i].weight.detach()
        # their Hessian is a running mean (other fp32 roundings), so a tie may round the other way
        assert (a != b).float().mean().item() < 0.01, i
        amax = ours[i].weight_quantizer.amax
        torch.testing.assert_close(amax, theirs[i].weight_quantizer.amax.reshape(amax.shape).float())


def _dp_rank(rank: int, world: int, data: list[torch.Tensor]) -> torch.Tensor:
    return ql.quantize(linear(), _cfg("gptq"), loop(data[rank::world]))[0].weight.detach()


@pytest.mark.distributed
def test_dp2_ranks_update_alike_and_as_one_process_on_the_global_data():
    from tests.ranks import run_on_ranks

    data = correlated(n=4)
    outs = run_on_ranks(_dp_rank, 2, data, timeout=120)
    assert torch.equal(outs[0], outs[1])  # one summed Hessian on every rank
    single = _dp_rank(0, 1, data)
    assert (outs[0] != single).float().mean().item() < 0.01  # the same Hessian summed in another order
    assert not torch.equal(outs[0], linear()[0].weight)


def test_export_writes_the_updated_weights(tmp_path):
    pytest.importorskip("compressed_tensors")
    from quantlib.export import export_checkpoint
    from tests.test_export._export_models import llama, tokens
    from tests.test_export.test_compressed_tensors import _decompress, _ulp_distance

    cfg = copy.deepcopy(ql.INT4_BLOCKWISE_WEIGHT_ONLY_CFG)
    cfg["algorithm"] = "gptq"
    maxed = ql.quantize(llama(), {**cfg, "algorithm": "max"}, loop([tokens(3), tokens(4)]))
    model = ql.quantize(llama(), cfg, loop([tokens(3), tokens(4)]))
    export_checkpoint(model, tmp_path / "c", "ct_int_pack")
    _, got, _ = _decompress(tmp_path / "c")
    assert got
    for name, out in got.items():
        m = model.get_submodule(name)
        with torch.no_grad():
            assert int(_ulp_distance(out, m.weight).max()) <= 1, name  # the consumer's codes x scale: GPTQ's weight
            ref = maxed.get_submodule(name)
            assert not torch.equal(m.weight_quantizer(m.weight), ref.weight_quantizer(ref.weight)), name  # not round to nearest


@pytest.mark.parametrize("weight", ["int4-block", "int8-channel", "int4-tensor", "fp8-tensor", "w4a8-chain", "uint8-channel"])
def test_column_steps_equal_the_fake_quant_op_on_each_column(weight):
    # the sweep quantizes a column with its scales precomputed; each must equal the op on that column, for
    # values inside and beyond the amax and for groups whose amax is zero (a zero row: the reference's zeros)
    from quantlib.calib.gptq import _column_amax, _leaves, column_quantizer
    from quantlib.kernels import ops

    spec = {"num_bits": 8, "axis": 0, "unsigned": True} if weight == "uint8-channel" else WEIGHTS[weight]
    base = linear(seed=5)
    with torch.no_grad():
        base[0].weight[3].zero_()
        base[0].weight[4].fill_(1e-30)  # a group under the format's tiny-amax floor
        if weight == "uint8-channel":
            base[0].weight.abs_()
    model = ql.quantize(base, _cfg("max", spec), loop(correlated(n=1)))
    q, w = model[0].weight_quantizer, model[0].weight.detach()
    fn = column_quantizer(q, D_IN, D_OUT)
    g = torch.Generator().manual_seed(7)
    for j in range(D_IN):
        col = torch.randn(D_OUT, generator=g) * w.abs().max() * 1.5
        col[3] = 0.25 if j % 2 else 0.0  # values in the zero group (0 * an infinite scale is NaN)
        col[4] = 0.5
        want = col.unsqueeze(1)
        stored_want = None
        for leaf in _leaves(q):
            want = ops.fake_quant(want, leaf.spec, _column_amax(leaf.amax.float(), leaf.spec.block, D_IN, j), leaf.attrs.backend)
            stored_want = want if stored_want is None else stored_want
        got, stored = fn(col, j)
        assert torch.equal(got, want.squeeze(1)), j
        assert torch.equal(stored, stored_want.squeeze(1)), j


@pytest.mark.parametrize("sequential", [False, True])
def test_shared_expert_weight_amax_is_refused_by_name(sequential):
    # the closing amax sync would give every expert its layer's max amax: GPTQ's rounded weights off their grid
    pytest.importorskip("transformers")
    from .test_calib_fused_experts import batches, build

    model = build(family="qwen3_moe")
    with pytest.raises(ql.ConfigError, match="'gptq' rounds each expert's weight .* sync_expert_weight_amax=True"):
        ql.quantize(model, {**_cfg("gptq", INT4, "*experts*"), "sync_expert_weight_amax": True}, loop(batches()), sequential=sequential)
