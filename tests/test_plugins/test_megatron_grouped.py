"""quantlib's Megatron-Core SequentialMLP runs its quantized experts with grouped GEMMs (no host loop): no
device-to-host read in the forward or the backward, and the bits of Megatron's own per-expert loop
(outputs, input / probability / weight gradients) for FP8, NVFP4 and INT4-block, swiglu and biases;
Megatron's loop where the grouped path cannot be exact.

On the CPU nothing syncs, so :class:`~tests.test_plugins.host_reads.HostReads` records the ops that would,
with the "reference" kernels (the C++ CPU kernels read their scalars from host memory; the GPU ones do not).
Each case runs on one gloo rank (Megatron's layers need a process group), the GPT model of
``megatron_shims`` (2 layers, 4 experts, top-2).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

pytest.importorskip("megatron.core", reason="needs megatron-core (pip install 'quantlib[megatron]')")

import quantlib as ql  # noqa: E402
from quantlib.traversal import iter_leaf_quantizers  # noqa: E402
from tests.test_plugins import megatron_shims as shims  # noqa: E402
from tests.test_plugins.host_reads import HostReads  # noqa: E402

pytestmark = [pytest.mark.megatron, pytest.mark.distributed]

def _on_a_fresh_rank(case, *args, timeout: float = 300.0):
    """Run ``case`` on one spawned gloo rank. Not forked: a pytest worker that has compiled or run a backward
    before (test_compile.py) forks children whose autograd refuses to run ("autograd's threading in combination
    with fork") or whose inductor build hangs on the parent's compile pool (CI's newest line, Megatron-Core 0.19
    compiles its fused swiglu); a fresh interpreter inherits neither."""
    return shims.run_distributed(case, 1, *args, timeout=timeout, method="spawn")


PRESETS = {"fp8": "FP8_DEFAULT_CFG", "nvfp4": "NVFP4_DEFAULT_CFG", "int4_block": "INT4_BLOCKWISE_WEIGHT_ONLY_CFG"}


def _model_kwargs(model: str) -> dict:
    import torch.nn.functional as F

    return {
        "plain": {},
        "swiglu": {"gated_linear_unit": True, "activation_func": F.silu},
        "swiglu_fused": {"gated_linear_unit": True, "activation_func": F.silu, "bias_activation_fusion": True},
        "swiglu_bias": {"gated_linear_unit": True, "activation_func": F.silu, "add_bias_linear": True},
        "gelu_bias": {"add_bias_linear": True},
    }[model]


def _quantized(preset: str, model: str):
    shims.set_layout(1, 1)
    net = ql.quantize(shims.build_gpt(1, 1, 0, **_model_kwargs(model)), ql.PRESETS[PRESETS[preset]],
                      shims.forward_loop(shims.token_batches(2, 1)))
    for _, q in iter_leaf_quantizers(net):
        q.set_from_attribute_config(dataclasses.replace(q.attrs, backend="reference", enable=q.is_enabled))
    return net


def _experts(net):
    return net.decoder.layers[0].mlp.experts


def _inputs(experts, counts: list[int], seed: int):
    g = torch.Generator().manual_seed(seed)
    rows = sum(counts)
    x = torch.randn(rows, experts.config.hidden_size, generator=g)
    return x, torch.tensor(counts), torch.rand(rows, generator=g)


def _refusal(experts, x, probs) -> str:
    from quantlib.plugins import megatron as qm

    return qm.grouped_refusal(experts, qm.structure(experts, qm._local), x, probs)


def _linears(experts) -> tuple[list, list]:
    from quantlib.plugins import megatron as qm

    st = qm.structure(experts, qm._local)
    return st.fc1s, st.fc2s


def _megatron_loop(experts, x, counts, probs):
    from megatron.core.transformer.moe.experts import SequentialMLP

    return SequentialMLP.forward(experts, x, counts, probs)


def _fwd_bwd(forward, experts, x, counts, probs):
    """(output, x grad, probs grad, every expert weight's grad) of one QAT step."""
    experts.zero_grad(set_to_none=True)
    x, probs = x.clone().requires_grad_(), probs.clone().requires_grad_()
    out, bias = forward(experts, x, counts, probs)
    assert bias is None
    out.square().sum().backward()
    return [out.detach(), x.grad, probs.grad] + [p.grad for _, p in sorted(experts.named_parameters()) if p.grad is not None]


def _grouped_case(rank: int, world: int, preset: str, model: str) -> dict:
    from quantlib.kernels import ops

    net = _quantized(preset, model)
    experts = _experts(net)
    x, counts, probs = _inputs(experts, [3, 0, 5, 4], seed=1)  # expert 1 gets no token
    res: dict = {"refusal": _refusal(experts, x, probs)}
    experts.train()
    with HostReads() as reads:
        out, _ = experts(x.clone().requires_grad_(), counts, probs.clone().requires_grad_())
        out.square().sum().backward()
    res["reads"] = reads.seen
    with torch.no_grad():
        res["eval_equal"] = torch.equal(experts(x, counts, probs)[0], _megatron_loop(experts, x, counts, probs)[0])
    grouped = _fwd_bwd(type(experts).forward, experts, x, counts, probs)
    looped = _fwd_bwd(_megatron_loop, experts, x, counts, probs)
    res["n_grads"] = (len(grouped), len(looped))
    res["unequal"] = [i for i, (a, b) in enumerate(zip(grouped, looped)) if not torch.equal(a, b)]
    # one fake-quant call per projection's stacked weights (+ one per projection's inputs) in QAT
    real, shapes = ops.select, []

    def counting(op, backend, device):
        fn = real(op, backend, device)
        return fn if op != "fake_quant" else (lambda t, *args: shapes.append(tuple(t.shape)) or fn(t, *args))

    ops.select = counting
    try:
        experts(x, counts, probs)  # (QAT: the weights require grad, no cache)
    finally:
        ops.select = real
    res["fake_quant_shapes"] = shapes
    first = experts.local_experts[0]
    res["weight_shapes"] = sorted(tuple(lin.weight.shape) for lin in (first.linear_fc1, first.linear_fc2))
    res["experts"] = experts.num_local_experts
    return res


@pytest.mark.parametrize("preset", list(PRESETS))
def test_forward_and_backward_read_nothing_back_and_equal_megatrons_loop(preset):
    (res,) = _on_a_fresh_rank(_grouped_case, preset, "plain")
    assert res["refusal"] == ""
    assert res["reads"] == [], res["reads"]
    assert res["eval_equal"]
    assert res["n_grads"][0] == res["n_grads"][1] == 3 + 2 * res["experts"]
    assert res["unequal"] == []
    e = res["experts"]
    assert sorted(s for s in res["fake_quant_shapes"] if len(s) == 3) == sorted((e,) + s for s in res["weight_shapes"])
    inputs = [s for s in res["fake_quant_shapes"] if len(s) == 2]
    assert len(inputs) == (0 if preset == "int4_block" else 2)  # weight-only INT4: inputs not quantized


@pytest.mark.parametrize("model", ["swiglu", "swiglu_fused"])
def test_swiglu_experts_equal_megatrons_loop(model):
    """Gated experts through Megatron's own activation code: its glu, or its fused weighted-swiglu kernel."""
    (res,) = _on_a_fresh_rank(_grouped_case, "fp8", model)
    assert res["refusal"] == "" and res["reads"] == [] and res["eval_equal"] and res["unequal"] == []


def _bias_case(rank: int, world: int, model: str) -> dict:

    net = _quantized("fp8", model)
    experts = _experts(net)
    x, counts, probs = _inputs(experts, [2, 6, 0, 3], seed=2)
    with torch.no_grad():
        with HostReads() as reads:
            out = experts(x, counts, probs)[0]
        # (under autograd Megatron 0.16's loop itself fails on an expert's fc2 bias: an in-place add on a view)
        res = {"reads": reads.seen, "equal": torch.equal(out, _megatron_loop(experts, x, counts, probs)[0])}
        res["eval_refusal"] = _refusal(experts, x, probs)
        # the experts' stacked biases are kept between forwards: a bias written in place, or replaced, is seen
        from quantlib.plugins import megatron as qm

        st = qm.structure(experts, qm._local)
        calls, fc2 = st.calls, experts.local_experts[1].linear_fc2
        fc2.bias.add_(0.25)
        changed = experts(x, counts, probs)[0]
        res["in_place_seen"] = not torch.equal(changed, out) and torch.equal(changed, _megatron_loop(experts, x, counts, probs)[0])
        experts.local_experts[3].linear_fc1.bias = torch.nn.Parameter(experts.local_experts[3].linear_fc1.bias * 2)  # (expert 2: no row)
        replaced = experts(x, counts, probs)[0]
        res["replaced_seen"] = not torch.equal(replaced, changed) and torch.equal(replaced, _megatron_loop(experts, x, counts, probs)[0])
        # the two modules MLP.forward calls are the structure's, built once, holding nothing after the forward
        res["calls_kept"] = qm.structure(experts, qm._local).calls is calls and all(c.__dict__["fn"] is None for c in calls)
    with torch.enable_grad():
        res["train_refusal"] = _refusal(experts, x, probs)
    return res


@pytest.mark.parametrize("model", ["swiglu_bias", "gelu_bias"])
def test_expert_biases_follow_megatrons_activation_in_eval(model):
    """fc1's bias through Megatron's own activation code (swiglu, gelu), fc2's
    times the routing probability: the loop's bits. Trainable biases take the loop (their gradients
    would be summed in another order)."""
    (res,) = _on_a_fresh_rank(_bias_case, model)
    assert res["eval_refusal"] == "" and res["reads"] == [] and res["equal"]
    assert res["in_place_seen"] and res["replaced_seen"] and res["calls_kept"]
    assert "linear_fc1.bias: trainable" in res["train_refusal"]


def _gpt_case(rank: int, world: int, preset: str) -> dict:
    from quantlib.plugins import megatron as qm

    net = _quantized(preset, "plain").train()
    tokens = shims.token_batches(1, 5)[0]
    b, s = tokens.shape
    positions = torch.arange(s).unsqueeze(0).expand(b, s)
    mask = torch.triu(torch.ones(s, s, dtype=torch.bool), diagonal=1).view(1, 1, s, s)

    def step():
        net.zero_grad(set_to_none=True)
        with HostReads() as reads:
            logits = net(tokens, positions, attention_mask=mask)
            logits.float().square().mean().backward()
        return logits.detach(), {n: p.grad for n, p in net.named_parameters() if p.grad is not None}, reads.seen

    refusals, real = [], qm.grouped_refusal
    qm.grouped_refusal = lambda *a: refusals.append(real(*a)) or refusals[-1]
    grouped = step()
    qm.grouped_refusal = lambda *a: "forced: Megatron's loop"
    try:
        looped = step()
    finally:
        qm.grouped_refusal = real
    return {
        "refusals": refusals, "logits": torch.equal(grouped[0], looped[0]), "grads": sorted(grouped[1]) == sorted(looped[1]),
        "unequal": [n for n in grouped[1] if not torch.equal(grouped[1][n], looped[1][n])], "reads": (grouped[2], looped[2]),
    }  # fmt: skip


@pytest.mark.parametrize("preset", list(PRESETS))
def test_quantized_moe_gpt_training_step_equals_megatrons_loop(preset):
    """A whole quantized GPT's forward + backward: logits and every parameter's gradient equal those of
    Megatron's expert loop; the only host reads left are the allgather dispatcher's own (its token
    permutation), none from the experts."""
    (res,) = _on_a_fresh_rank(_gpt_case, preset)
    assert res["refusals"] == ["", ""]  # both MoE layers grouped
    assert res["logits"] and res["grads"] and res["unequal"] == []
    grouped, looped = res["reads"]
    assert not [r for r in grouped if "quantlib" in r or "experts.py" in r], grouped
    assert [r for r in looped if "experts.py" in r]  # (the recorder sees Megatron's loop read its counts)
    # the dispatcher's own reads (masked_select; Megatron 0.19 also reads a scalar) are read in both runs
    assert set(grouped) <= set(looped) and len(grouped) < len(looped), (grouped, looped)


def _fallback_case(rank: int, world: int) -> dict:

    net = _quantized("fp8", "plain")
    experts = _experts(net)
    x, counts, probs = _inputs(experts, [1, 2, 3, 4], seed=3)
    fc1s, fc2s = _linears(experts)
    handle = fc1s[1].register_forward_pre_hook(lambda *a: None)  # (AWQ / SmoothQuant record each linear's input so)
    out = {"hook": _refusal(experts, x, probs)}
    handle.remove()
    fc2s[1].output_quantizer.enable()
    out["output"] = _refusal(experts, x, probs)
    fc2s[1].output_quantizer.disable()
    fc1s[2].input_quantizer.reset_amax()  # uncalibrated: its scale would come from the rows it sees together
    out["uncalibrated"] = _refusal(experts, x, probs)
    with torch.no_grad():
        out["equal"] = torch.equal(experts(x, counts, probs)[0], _megatron_loop(experts, x, counts, probs)[0])
    out["double"] = _refusal(experts, x.double(), probs)
    return out


def test_what_the_grouped_path_cannot_reproduce_takes_megatrons_loop():
    (res,) = _on_a_fresh_rank(_fallback_case)
    assert "local_experts.1.linear_fc1: forward hooks" in res["hook"]
    assert "output_quantizer" in res["output"]
    assert "local_experts.2.linear_fc1.input_quantizer" in res["uncalibrated"] and "no calibrated amax" in res["uncalibrated"]
    assert res["equal"]  # (through the loop)
    assert "aligned" in res["double"]


def _input_amax_case(rank: int, world: int, preset: str, axis) -> dict:
    """Max calibration of the experts' inputs through the grouped path and through Megatron's loop."""
    experts = _experts(_quantized(preset, "plain"))
    fc1s, fc2s = _linears(experts)
    inputs = [q for lin in fc1s + fc2s for q in (lin.input_quantizer,)]
    batches = [_inputs(experts, counts, seed=10 + i) for i, counts in enumerate([[3, 0, 5, 4], [2, 0, 1, 6]])]
    if axis is not None:
        for q in inputs:
            q.set_from_attribute_config(dataclasses.replace(q.attrs, axis=axis))
    found, reads = [], []
    for forward in (type(experts).forward, _megatron_loop):
        for q in inputs:
            q.reset_amax()
            q.enable_calib()
            q.disable_quant()
        with torch.no_grad(), HostReads() as seen:
            for x, counts, probs in batches:
                forward(experts, x, counts, probs)
        reads.append(seen.seen)
        for q in inputs:
            q.disable_calib()
            q.enable_quant()
            q.load_calib_amax()
        found.append([None if q.amax is None else q.amax.clone() for q in inputs])
    return {"found": found, "reads": reads, "enabled": all(q.is_enabled for q in inputs)}


@pytest.mark.parametrize("preset,axis", [("fp8", None), ("nvfp4", None), ("fp8", (-1,))], ids=["fp8", "nvfp4", "fp8-per-channel"])
def test_calibration_collects_each_experts_amax_on_the_device(preset, axis):
    """Each expert's input amax from its own rows, reduced per expert on the device (no host read): the
    loop's amax bit for bit; an expert that no token reaches keeps no amax, as in the loop."""
    (res,) = _on_a_fresh_rank(_input_amax_case, preset, axis)
    assert res["enabled"]
    grouped, looped = res["found"]
    assert [a is None for a in grouped] == [a is None for a in looped] == [False, True, False, False] * 2
    assert all(a is None or torch.equal(a, b) for a, b in zip(grouped, looped))
    assert res["reads"][0] == [] and res["reads"][1]  # (the loop reads its counts back)


def _calibration_case(rank: int, world: int) -> dict:
    from quantlib.plugins import megatron as qm

    real, out = qm.grouped_refusal, {}
    for mode in ("grouped", "loop"):
        if mode == "loop":
            qm.grouped_refusal = lambda *a: "forced: Megatron's loop"
        try:
            with HostReads() as reads:
                net = _quantized("fp8", "plain")
        finally:
            qm.grouped_refusal = real
        amax = {n: b.clone() for n, b in net.named_buffers() if n.endswith("_amax")}
        tokens = {n: m.tokens_per_expert.clone() for n, m in net.named_modules() if hasattr(m, "tokens_per_expert")}
        out[mode] = (amax, tokens, [r for r in reads.seen if "experts.py" in r or "quantlib" in r])
    return out


def test_calibrating_a_quantized_moe_gpt_through_the_grouped_path_gives_the_loops_amax():
    (res,) = _on_a_fresh_rank(_calibration_case)
    (ga, gt, greads), (la, lt, lreads) = res["grouped"], res["loop"]
    assert sorted(ga) == sorted(la) and all(torch.equal(ga[n], la[n]) for n in ga)
    assert sorted(gt) == sorted(lt) and all(torch.equal(gt[n], lt[n]) for n in gt) and sum(int(t.sum()) for t in gt.values()) > 0
    # the loop reads each forward's counts; the grouped path none (what is left: the end-of-calibration report)
    assert len(lreads) > len(greads) and all("experts.py" not in r for r in greads), greads


def _compile_case(rank: int, world: int, preset: str) -> list[bool]:
    experts = _experts(_quantized(preset, "swiglu"))
    torch._dynamo.reset()
    compiled = torch.compile(experts, fullgraph=True, backend="aot_eager")
    equal = []
    with torch.no_grad():
        for step, counts in enumerate([[3, 0, 5, 4], [1, 6, 2, 3]]):  # another routing, the same number of rows
            x, cnt, probs = _inputs(experts, counts, seed=step)
            with torch.compiler.set_stance("fail_on_recompile" if step else "default"):
                equal.append(torch.equal(compiled(x, cnt, probs)[0], experts(x, cnt, probs)[0]))
    torch._dynamo.reset()
    return equal


@pytest.mark.slow
@pytest.mark.parametrize("preset", list(PRESETS))
def test_fullgraph_compile_of_the_experts_serves_every_routing_and_equals_eager(preset):
    """``torch.compile(fullgraph=True)`` of the quantized SequentialMLP: one graph (a host read would break
    it), no recompile when the tokens route elsewhere, eager's bits."""
    (res,) = _on_a_fresh_rank(_compile_case, preset, timeout=600)
    assert res == [True, True]
