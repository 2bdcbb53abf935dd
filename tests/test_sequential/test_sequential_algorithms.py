"""Layer-by-layer calibration with every registered algorithm on tiny transformers Llama and Qwen3-MoE
models: amax, pre_quant_scale, the runners' choices and the quantized logits equal in-memory calibration
with the same algorithm bit for bit, also from a disk offload, after a crash and a resume, with a layer
the algorithm serves nothing in, and over two data-parallel ranks."""

from __future__ import annotations

import copy
import os

import pytest
import torch
from torch import nn

pytest.importorskip("transformers", reason="needs transformers (pip install quantlib[transformers])")

import quantlib as ql  # noqa: E402
from quantlib.calib.registry import RESULT_ATTRIBUTES  # noqa: E402
from quantlib.calib.sequential import offload_to_disk  # noqa: E402
from quantlib.calib_config import ALGORITHMS  # noqa: E402
from quantlib.model_quant import iter_leaf_quantizers, quant_modules  # noqa: E402
from tests.ranks import run_on_ranks  # noqa: E402
from tests.test_sequential.test_sequential_hf import MODELS, _with_head_input, build, data, loop_over  # noqa: E402


def _algo(base: dict, algorithm) -> dict:
    cfg = _with_head_input(copy.deepcopy(base))
    cfg["algorithm"] = algorithm
    return cfg


#: one config per registered algorithm, each one that the algorithm acts on (scales, searched amax)
CONFIGS = {
    "max": _algo(ql.FP8_DEFAULT_CFG, "max"),
    "mse": _algo(ql.INT8_DEFAULT_CFG, {"method": "mse", "step_size": 0.25}),
    "smoothquant": _algo(ql.INT8_SMOOTHQUANT_CFG, {"method": "smoothquant", "alpha": 0.5}),
    "awq_lite": _algo(ql.W4A8_AWQ_BETA_CFG, {"method": "awq_lite", "alpha_step": 0.25, "debug": True}),
    "awq_clip": _algo(ql.INT4_AWQ_CFG, {"method": "awq_clip", "max_tokens_per_batch": 8}),
    "awq_full": _algo(ql.NVFP4_AWQ_FULL_CFG, {"method": "awq_full", "alpha_step": 0.25}),
    "mse_fp8_sweep": _algo(ql.NVFP4_W4A4_WEIGHT_MSE_FP8_SWEEP_CFG, {"method": "mse", "fp8_scale_sweep": True}),
}
SCALED = {"smoothquant", "awq_lite", "awq_full"}  # algorithms that set pre_quant_scale


#: algorithms whose layer-by-layer tests live elsewhere: gptq rewrites weights, so it refuses the offload folder
#: and resume file these tests use (tests/test_calibration/test_calib_gptq.py has its layer-by-layer equality)
ELSEWHERE = {"gptq"}


def test_every_registered_algorithm_has_a_config_here():
    assert {c["algorithm"] if isinstance(c["algorithm"], str) else c["algorithm"]["method"]
            for c in CONFIGS.values()} == set(ALGORITHMS) - ELSEWHERE


def state_of(model: nn.Module) -> dict:
    """amax, pre_quant_scale and the runners' module results, by name."""
    out = {}
    for n, q in iter_leaf_quantizers(model):
        if q.amax is not None:
            out[f"{n}/amax"] = q.amax.cpu()
        if q.pre_quant_scale is not None:
            out[f"{n}/pre_quant_scale"] = q.pre_quant_scale.cpu()
        if q.block_amax is not None:
            out[f"{n}/block_amax"] = q.block_amax.cpu()
    for n, m in quant_modules(model):
        for attr in RESULT_ATTRIBUTES:
            if hasattr(m, attr):
                value = getattr(m, attr)
                out[f"{n}/{attr}"] = _as_tensor(value)
    return out


def _as_tensor(value) -> torch.Tensor:
    """A result as one tensor: fused experts keep ``{proj: [per expert]}`` (None for an expert no token
    reached, here -1), linears a number, a tensor or ``{alpha: loss}``."""
    if isinstance(value, torch.Tensor):
        return value.cpu().float().flatten()
    if isinstance(value, dict):
        return torch.cat([_as_tensor(v) for v in value.values()])
    if isinstance(value, (list, tuple)):
        return torch.cat([_as_tensor(v) for v in value])
    return torch.tensor([-1.0 if value is None else float(value)])


def assert_same(got: dict, expected: dict) -> None:
    assert got.keys() == expected.keys(), sorted(set(got) ^ set(expected))[:5]
    bad = [n for n in expected if got[n].dtype != expected[n].dtype or not torch.equal(got[n], expected[n])]
    assert not bad, bad[:5]


def logits(model: nn.Module) -> torch.Tensor:
    with torch.no_grad():
        return model(data(1)[0]).logits


@pytest.fixture(scope="module")
def in_memory() -> dict:
    """(state, logits) of in-memory calibration, by (model, algorithm), built on first use."""
    cache = {}

    def get(name: str, algo: str):
        if (name, algo) not in cache:
            model = ql.quantize(build(name), CONFIGS[algo], loop_over(data()))
            cache[(name, algo)] = (state_of(model), logits(model))
        return cache[(name, algo)]

    return get


@pytest.mark.parametrize("algo", sorted(CONFIGS))
@pytest.mark.parametrize("name", sorted(MODELS))
def test_sequential_algorithm_equal_in_memory(in_memory, name, algo):
    state, expected_logits = in_memory(name, algo)
    model = ql.quantize(build(name), CONFIGS[algo], loop_over(data()), sequential=True)
    got = state_of(model)
    if algo in SCALED:  # the search did set scales, in the layers and not only in the first one
        assert "model.layers.3.self_attn.q_proj.input_quantizer/pre_quant_scale" in got
    assert "lm_head.input_quantizer/amax" in got  # the quantizer outside the layers
    assert_same(got, state)
    assert torch.equal(logits(model), expected_logits)


@pytest.mark.parametrize("name", sorted(MODELS))
def test_sequential_awq_lite_from_disk_offload_equal_in_memory(tmp_path, in_memory, name):
    model = build(name)
    offload_to_disk(model, str(tmp_path))
    model = ql.quantize(model, CONFIGS["awq_lite"], loop_over(data()), sequential={"offload_folder": str(tmp_path)})
    assert all(p.device.type == "meta" for p in model.model.layers.parameters())  # back on disk
    assert_same(state_of(model), in_memory(name, "awq_lite")[0])


class _Boom(RuntimeError):
    pass


def _crash_in_layer_2(tmp_path, name: str, algo: str) -> tuple[str, dict, dict]:
    """(resume file, sequential options, its saved state) of a layer-by-layer run killed in layer 2."""
    resume = str(tmp_path / "resume.pt")
    opts = {"resume_file": resume}
    model = build(name)
    handle = model.model.layers[2].self_attn.register_forward_pre_hook(lambda *_: (_ for _ in ()).throw(_Boom("killed in layer 2")))
    with pytest.raises(_Boom):
        ql.quantize(model, CONFIGS[algo], loop_over(data()), sequential=opts)
    handle.remove()
    return resume, opts, torch.load(resume, weights_only=True)


@pytest.mark.parametrize("name", sorted(MODELS))
def test_sequential_awq_lite_resume_after_crash_equal_in_memory(tmp_path, in_memory, name):
    resume, opts, saved = _crash_in_layer_2(tmp_path, name, "awq_lite")
    assert saved["done"] == 2 and any(k.startswith("model.layers.1.") for k in saved["pre_quant_scale"])
    assert not any(k.startswith("model.layers.2.") for k in saved["pre_quant_scale"])

    fresh = build(name)  # as a new process would: a fresh model, the same config and data
    calls = {0: 0, 1: 0, 2: 0}
    for i in calls:
        fresh.model.layers[i].self_attn.register_forward_pre_hook(lambda *_, i=i: calls.__setitem__(i, calls[i] + 1))
    fresh = ql.quantize(fresh, CONFIGS["awq_lite"], loop_over(data()), sequential=opts)
    assert calls == {0: 0, 1: 0, 2: 3}  # finished layers never ran again
    assert not os.path.exists(resume)
    state, expected_logits = in_memory(name, "awq_lite")
    assert_same(state_of(fresh), state)
    assert torch.equal(logits(fresh), expected_logits)


@pytest.mark.parametrize("name", sorted(MODELS)[:1])
def test_sequential_fp8_sweep_resume_keeps_the_searched_block_amax(tmp_path, in_memory, name):
    _, opts, saved = _crash_in_layer_2(tmp_path, name, "mse_fp8_sweep")
    assert any(k.startswith("model.layers.1.") for k in saved["block_amax"])
    fresh = ql.quantize(build(name), CONFIGS["mse_fp8_sweep"], loop_over(data()), sequential=opts)
    state, expected_logits = in_memory(name, "mse_fp8_sweep")
    assert_same(state_of(fresh), state)
    assert torch.equal(logits(fresh), expected_logits)


def test_sequential_resume_file_of_another_algorithm_refused(tmp_path):
    resume = str(tmp_path / "resume.pt")
    model = build("llama")
    model.model.layers[3].self_attn.register_forward_pre_hook(lambda *_: (_ for _ in ()).throw(_Boom("stop")))
    with pytest.raises(_Boom):
        ql.quantize(model, CONFIGS["awq_lite"], loop_over(data()), sequential={"resume_file": resume})
    other = _algo(ql.W4A8_AWQ_BETA_CFG, {"method": "awq_lite", "alpha_step": 0.5})
    with pytest.raises(ValueError, match="another model, config or algorithm"):
        ql.quantize(build("llama"), other, loop_over(data()), sequential={"resume_file": resume})


@pytest.mark.parametrize("algo", ["awq_full", "smoothquant"])
def test_sequential_layer_with_nothing_to_serve_equal_in_memory(algo):
    """Layer 1 quantizes nothing: the algorithm runs on it with no target and the next layers still match."""
    cfg = copy.deepcopy(CONFIGS[algo])
    cfg["quant_cfg"].append({"quantizer_name": "*layers.1.*", "enable": False})
    memory = ql.quantize(build("llama"), cfg, loop_over(data()))
    layered = ql.quantize(build("llama"), cfg, loop_over(data()), sequential=True)
    got = state_of(layered)
    assert not any(k.startswith("model.layers.1.") for k in got) and any(k.startswith("model.layers.2.") and "pre_quant_scale" in k
                                                                         for k in got)
    assert_same(got, state_of(memory))
    assert torch.equal(logits(layered), logits(memory))


def test_sequential_recalibration_replaces_old_scales_as_in_memory():
    """calibrate() on a model that already has AWQ scales: the search starts over from the same state."""
    models = [ql.quantize(build("llama"), CONFIGS["awq_lite"], loop_over(data())) for _ in range(2)]
    algo = {"method": "awq_lite", "alpha_step": 0.5}
    ql.calibrate(models[0], algo, loop_over(data()[:2]))
    ql.calibrate(models[1], algo, loop_over(data()[:2]), sequential=True)
    assert_same(state_of(models[1]), state_of(models[0]))


def _dp_rank(rank: int, world: int, algo: str) -> dict:
    """Each rank its own batches; the search's losses and statistics are reduced over both."""
    state = ql.ParallelState(data_group=torch.distributed.group.WORLD)
    batches = [b + rank for b in data()]
    memory = ql.quantize(build("llama"), CONFIGS[algo], loop_over(batches), parallel_state=state)
    layered = ql.quantize(build("llama"), CONFIGS[algo], loop_over(batches), parallel_state=state, sequential=True)
    return {"memory": state_of(memory), "layered": state_of(layered)}


@pytest.mark.distributed
@pytest.mark.parametrize("algo", ["awq_full", "smoothquant"])
def test_sequential_data_parallel_equal_in_memory(algo):
    results = run_on_ranks(_dp_rank, 2, algo, timeout=240)
    for res in results:
        assert_same(res["layered"], res["memory"])
    assert_same(results[1]["layered"], results[0]["layered"])  # every rank chose the same


@pytest.mark.parametrize("name", sorted(MODELS))
def test_sequential_max_of_chained_weight_quantizers_equal_in_memory(name):
    """W4A8's chain: the FP8 member calibrates on the INT4 member's output, so quantization must be on
    while the layer's weights calibrate (it is off for the passes)."""
    cfg = _algo(ql.W4A8_AWQ_BETA_CFG, "max")
    memory = ql.quantize(build(name), cfg, loop_over(data()))
    layered = ql.quantize(build(name), cfg, loop_over(data()), sequential=True)
    assert_same(state_of(layered), state_of(memory))
    assert torch.equal(logits(layered), logits(memory))


class _ExpertLayer(nn.Module):
    """Every token to every expert but ``idle`` (which no token reaches)."""

    def __init__(self, idle) -> None:
        super().__init__()
        self.experts = nn.ModuleList([nn.Linear(16, 16) for _ in range(3)])
        self.idle = idle

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h + sum(e(h) for i, e in enumerate(self.experts) if i != self.idle)


class _TinyMoE(nn.Module):
    """Three layers of linear experts (layer 1's expert 1 gets no tokens) and a head the algorithm serves."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(3)
        self.layers = nn.ModuleList([_ExpertLayer(None), _ExpertLayer(1), _ExpertLayer(None)])
        self.head = nn.Linear(16, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


def _tiny_moe() -> nn.Module:
    model = ql.model_quant.convert(_TinyMoE())
    for layer in model.layers:
        for e in layer.experts:
            e.is_expert = True  # what an MoE plugin sets
    return model


def _moe_batches() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(9)
    return [torch.randn(2, 5, 16, generator=g) for _ in range(3)]


@pytest.mark.parametrize("algo", ["awq_lite", "awq_full"])
def test_sequential_expert_without_tokens_follows_policy_as_in_memory(algo, caplog):
    cfg = copy.deepcopy(ql.W4A8_AWQ_BETA_CFG if algo == "awq_lite" else ql.NVFP4_AWQ_FULL_CFG)
    cfg["algorithm"], cfg["expert_input_policy"] = algo, "max_of_peers"
    memory = ql.quantize(_tiny_moe(), cfg, loop_over(_moe_batches()))
    layered = ql.quantize(_tiny_moe(), cfg, loop_over(_moe_batches()), sequential=True)
    got = state_of(layered)
    idle = layered.layers[1].experts[1]
    assert torch.equal(idle.input_quantizer.pre_quant_scale, torch.ones(16)) and idle.input_quantizer.amax is not None
    assert "head.input_quantizer/pre_quant_scale" in got  # the resident head was searched too
    assert_same(got, state_of(memory))
    x = _moe_batches()[0]
    assert torch.equal(layered(x), memory(x))

    cfg["expert_input_policy"] = "error"
    with pytest.raises(ql.CalibrationError, match=r"layers\.1\.experts\.1.*expert_input_policy='error'"):
        ql.quantize(_tiny_moe(), cfg, loop_over(_moe_batches()), sequential=True)
