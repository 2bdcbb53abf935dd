"""The grouped forward of transformers' fused experts: no device-to-host read in the forward or the QAT
backward, for several families and presets; the same bits as the per-expert loop (outputs, QAT
gradients, calibrated amax); the loop kept where the grouped path cannot be exact.

On the CPU nothing syncs, so the test records the ops that would (:class:`~tests.test_plugins.host_reads.HostReads`),
with the "reference" kernels (the torch formulas that the GPU kernels implement: the C++ CPU kernels read
their scalars from host memory).
"""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch

pytest.importorskip("transformers", reason="needs transformers (pip install quantlib[transformers])")

import quantlib as ql  # noqa: E402
from quantlib.plugins import huggingface as hf  # noqa: E402
from quantlib.plugins.hf_experts import QuantFusedExperts, flag  # noqa: E402
from quantlib.traversal import iter_leaf_quantizers  # noqa: E402

from .host_reads import HostReads  # noqa: E402
from .test_hf_experts_layouts import assert_loop_bits, expert_modules, input_ids, tiny_model  # noqa: E402

PRESETS = {"fp8": ql.FP8_DEFAULT_CFG, "nvfp4": ql.NVFP4_DEFAULT_CFG, "int4-block": ql.INT4_BLOCKWISE_WEIGHT_ONLY_CFG}


@pytest.fixture(autouse=True)
def _plugin_sees_the_modeling_modules():
    hf.refresh()


def _quantized(family: str, preset: str):
    model = ql.quantize(tiny_model(family), PRESETS[preset], lambda m: m(input_ids(seed=5)))
    experts = [m for _, m in expert_modules(model)]
    assert experts and all(isinstance(m, QuantFusedExperts) for m in experts)
    return model, experts


def _hidden(m) -> int:
    return m.down_proj.shape[2] if flag(m, "is_transposed") else m.down_proj.shape[1]


def _routing(num_experts: int, tokens: int = 12, k: int = 2, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    idx = torch.stack([torch.randperm(num_experts, generator=g)[:k] for _ in range(tokens)])
    return idx, torch.rand(tokens, k, generator=g)


@pytest.mark.parametrize("preset", list(PRESETS))
@pytest.mark.parametrize("family", ["qwen3_moe", "gpt_oss"])
def test_forward_and_qat_backward_read_nothing_back_to_the_host(family, preset):
    model, experts = _quantized(family, preset)
    assert all(m._grouped_refusal(torch.zeros(1, _hidden(m)), False) == "" for m in experts)
    for _, q in iter_leaf_quantizers(model):
        enabled = q.is_enabled
        q.set_from_attribute_config(dataclasses.replace(q.attrs, backend="reference", enable=enabled))
    m = experts[0]
    idx, w = _routing(m.num_experts)
    hidden = torch.randn(idx.shape[0], _hidden(m), generator=torch.Generator().manual_seed(1))
    with torch.no_grad(), HostReads() as reads:
        m(hidden, idx, w)
    assert reads.seen == [], reads.seen
    m.train()
    x = hidden.clone().requires_grad_()
    with HostReads() as reads:
        m(x, idx, w).square().sum().backward()
    assert reads.seen == [], reads.seen
    assert x.grad is not None and m.down_proj.grad is not None


@pytest.mark.parametrize("preset", list(PRESETS))
@pytest.mark.parametrize("family", ["qwen3_moe", "gpt_oss", "phimoe"])
def test_grouped_forward_and_qat_gradients_equal_the_per_expert_loop(family, preset):
    _, experts = _quantized(family, preset)
    m = experts[0]
    idx, w = _routing(m.num_experts, seed=2)
    idx[0] = torch.tensor([0, 1])
    idx[:, 0][idx[:, 0] == m.num_experts - 1] = 0  # an expert no token reaches in slot 0 only
    hidden = torch.randn(idx.shape[0], _hidden(m), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        assert_loop_bits(m._grouped_forward(hidden, idx, w, False), m._loop_forward(hidden, idx, w, False), family)
    m.train()
    grads = []
    for forward in (m._grouped_forward, m._loop_forward):
        x = hidden.clone().requires_grad_()
        m.zero_grad(set_to_none=True)
        forward(x, idx, w, False).square().sum().backward()
        grads.append([x.grad] + [getattr(m, p).grad for p in m.projections])
    for a, b in zip(*grads):
        assert_loop_bits(a, b, family)


def test_an_expert_without_tokens_gets_no_rows_and_no_nan():
    _, experts = _quantized("qwen3_moe", "fp8")
    m = experts[0]
    idx = torch.tensor([[0, 1]] * 5)  # experts 2 and 3 get nothing
    hidden = torch.randn(5, _hidden(m), generator=torch.Generator().manual_seed(4))
    w = torch.full((5, 2), 0.5)
    with torch.no_grad():
        out = m._grouped_forward(hidden, idx, w, False)
        assert torch.isfinite(out).all()
        assert torch.equal(out, m._loop_forward(hidden, idx, w, False))


@pytest.mark.parametrize("family", ["qwen3_moe", "gpt_oss"])
def test_calibration_through_the_grouped_path_gives_the_loops_amax(family):
    """Max calibration of FP8 inputs: the grouped forward (one call per projection) and the per-expert
    loop (forced by an observer that records nothing) collect the same amax and tokens per expert."""
    data = [input_ids(seed=s) for s in (5, 6)]
    results = []
    for loop in (False, True):
        model = copy.deepcopy(tiny_model(family))
        if loop:
            for _, m in expert_modules(model):
                m.__dict__["_input_observer"] = lambda *a: None  # survives conversion (the dict is copied)
        model = ql.quantize(model, ql.FP8_DEFAULT_CFG, lambda mod: [mod(x) for x in data])
        results.append([(m.gate_up_proj_input_quantizer.amax, m.down_proj_input_quantizer.amax, m.tokens_per_expert.clone())
                        for _, m in expert_modules(model)])
    for grouped, looped in zip(*results):
        for a, b in zip(grouped, looped):
            assert torch.equal(a, b)


def test_unaligned_shapes_and_dynamic_input_scales_take_the_loop():
    _, experts = _quantized("qwen3_moe", "fp8")
    m = experts[0]
    hidden = torch.zeros(1, _hidden(m))
    assert m._grouped_refusal(hidden, False) == ""
    assert "observer" in (m.__dict__.__setitem__("_input_observer", lambda *a: None) or m._grouped_refusal(hidden, False))
    del m.__dict__["_input_observer"]
    m.down_proj_input_quantizer.reset_amax()  # an uncalibrated static input: its amax would come from each expert's rows
    assert "down_proj_input_quantizer" in m._grouped_refusal(hidden, False)
    assert "aligned" in m._grouped_refusal(hidden.double(), False)


def test_expert_parallel_sentinels_add_nothing_and_get_no_gradient():
    """Under transformers' expert parallelism an index equal to num_experts marks a remote expert (its
    weight zero): the grouped path leaves those rows out, as the loop does, and the backward gives them none."""
    _, experts = _quantized("qwen3_moe", "fp8")
    m = experts[0]
    m._is_expert_parallel = True
    idx, w = _routing(m.num_experts, seed=6)
    idx[::3, 1] = m.num_experts
    w = torch.where(idx == m.num_experts, 0.0, w)
    hidden = torch.randn(idx.shape[0], _hidden(m), generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        assert torch.equal(m._grouped_forward(hidden, idx, w, False), m._loop_forward(hidden, idx, w, False))
    m.train()
    x = hidden.clone().requires_grad_()
    m._grouped_forward(x, idx, w, False).square().sum().backward()
    assert torch.isfinite(x.grad).all() and torch.isfinite(m.gate_up_proj.grad).all()
    assert "expert-parallel" in m._grouped_refusal(hidden, True)


def test_the_stacked_weight_cache_is_reused_and_left_behind_by_copies():
    import pickle

    _, experts = _quantized("qwen3_moe", "int4-block")
    m = experts[0]
    idx, w = _routing(m.num_experts, seed=8)
    hidden = torch.randn(idx.shape[0], _hidden(m), generator=torch.Generator().manual_seed(9))
    with torch.no_grad():
        out = m(hidden, idx, w)
        cached = m._weight_cache[("stacked", "gate_up_proj_weight_quantizer")][1]
        assert torch.equal(m(hidden, idx, w), out)
        assert m._weight_cache[("stacked", "gate_up_proj_weight_quantizer")][1] is cached  # reused, not recomputed
        m.gate_up_proj.mul_(2)  # an in-place write: the next forward quantizes again
        m(hidden, idx, w)
        assert m._weight_cache[("stacked", "gate_up_proj_weight_quantizer")][1] is not cached
    assert "_weight_cache" not in copy.deepcopy(m).__dict__ and "_weight_cache" not in pickle.loads(pickle.dumps(m)).__dict__


@pytest.mark.parametrize("preset", ["nvfp4", "nvfp4-static-blocks"])
@pytest.mark.parametrize("family", ["qwen3_moe", "gpt_oss"])
def test_nvfp4_qat_quantizes_each_projection_in_one_kernel_call(family, preset, monkeypatch):
    """NVFP4 weights (a global amax per expert, static blocks too): one fake-quant call over the stacked
    (E, out, in) weights per projection, not one per expert; the same bits as the per-expert loop."""
    from quantlib.kernels import ops

    cfg = {"nvfp4": ql.NVFP4_DEFAULT_CFG, "nvfp4-static-blocks": ql.NVFP4_W4A4_WEIGHT_MSE_FP8_SWEEP_CFG}[preset]
    model = ql.quantize(tiny_model(family), cfg, lambda m: m(input_ids(seed=5)))
    m = [e for _, e in expert_modules(model)][0]
    assert all(q.block_amax is not None for q in m.gate_up_proj_weight_quantizer.children()) == (preset != "nvfp4")
    real, shapes = ops.select, []

    def counting(op, backend, device):
        fn = real(op, backend, device)
        if op != "fake_quant":
            return fn
        return lambda x, *args: shapes.append(tuple(x.shape)) or fn(x, *args)

    monkeypatch.setattr(ops, "select", counting)
    idx, w = _routing(m.num_experts, seed=10)
    hidden = torch.randn(idx.shape[0], _hidden(m), generator=torch.Generator().manual_seed(11))
    m.train()
    m(hidden.clone().requires_grad_(), idx, w).sum().backward()
    stacked = sorted(tuple(getattr(m, p).transpose(1, 2).shape if flag(m, "is_transposed") else getattr(m, p).shape) for p in m.projections)
    assert sorted(s for s in shapes if len(s) == 3) == stacked
    assert len([s for s in shapes if len(s) == 2]) == len(m.projections)  # the input quantizers, on the sorted rows
    monkeypatch.undo()
    with torch.no_grad():
        assert torch.equal(m._grouped_forward(hidden, idx, w, False), m._loop_forward(hidden, idx, w, False))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("preset", list(PRESETS))
@pytest.mark.parametrize("family", ["qwen3_moe", "gpt_oss"])
def test_no_synchronising_call_on_the_gpu(family, preset):
    """On a GPU, torch's sync debug mode raises at any synchronising call: none in the eval forward (the
    weight cache) nor in the QAT forward + backward, after a first pass that compiles the kernels."""
    model, experts = _quantized(family, preset)
    model.to("cuda", torch.bfloat16)
    m = experts[0]
    idx, w = _routing(m.num_experts, tokens=64)
    idx, w = idx.cuda(), w.to("cuda", torch.bfloat16)
    hidden = torch.randn(idx.shape[0], _hidden(m), generator=torch.Generator().manual_seed(1)).to("cuda", torch.bfloat16)
    assert m._grouped_refusal(hidden, False) == ""

    def qat_step():
        m.zero_grad(set_to_none=True)
        x = hidden.clone().requires_grad_()
        m(x, idx, w).float().square().sum().backward()

    m.eval()
    with torch.no_grad():
        m(hidden, idx, w)
    m.train()
    qat_step()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        m.eval()
        with torch.no_grad():
            m(hidden, idx, w)
            m(hidden, idx, w)
        m.train()
        qat_step()
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert m.down_proj.grad is not None
