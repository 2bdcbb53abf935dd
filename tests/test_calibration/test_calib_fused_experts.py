"""AWQ / SmoothQuant on transformers' fused experts: each expert searched on the tokens routed to it.

The reference for expert e of a projection is a hand-built ``nn.Linear`` holding that expert's slice,
calibrated with the same algorithm on exactly the tokens the router sent to e (gate_up: the routed
hidden states, down: act(gate) * up of those tokens), batch by batch: its alpha, ``pre_quant_scale``
and amax must equal the fused expert's bit for bit. A tiny Qwen3-MoE from a config (no downloads);
expert 3 of layer 0 gets no tokens (the router's choice of it is redirected) to test the policies.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

pytest.importorskip("transformers", reason="needs transformers (pip install quantlib[transformers])")
from transformers import GptOssConfig, GptOssForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM  # noqa: E402

import quantlib as ql  # noqa: E402
from quantlib.nn.tensor_quantizer import CalibrationError  # noqa: E402
from quantlib.plugins import huggingface as hf  # noqa: E402

E, H, INTER, IDLE = 4, 64, 32, 3
INT4 = {"num_bits": 4, "block_sizes": {-1: 32, "type": "static"}, "narrow_range": False}
FP8 = {"num_bits": (4, 3), "axis": None}
INT8_W, INT8_IN = {"num_bits": 8, "axis": 0}, {"num_bits": 8, "axis": None}
CASES = {
    "awq_lite-w4a16": ("awq_lite", INT4, None),
    "awq_lite-w4a8": ("awq_lite", INT4, FP8),
    "awq_full-w4a16": ("awq_full", INT4, None),
    "awq_clip-w4a8": ("awq_clip", INT4, FP8),
    "smoothquant-int8": ("smoothquant", INT8_W, INT8_IN),
}


def _cfg(algorithm, weight, inp, pattern: str = "*experts*") -> dict:
    quant_cfg = {"default": {"enable": False}, f"{pattern}weight_quantizer": weight}
    if inp is not None:
        quant_cfg[f"{pattern}input_quantizer"] = inp
    return {"quant_cfg": quant_cfg, "algorithm": algorithm}


def _starve(gate: nn.Module, _args, out):
    """Router hook: expert IDLE is never chosen (replaced by the lowest expert the token lacks)."""
    logits, scores, idx = out
    idx = idx.clone()
    for t in torch.nonzero((idx == IDLE).any(-1)).flatten().tolist():
        free = [e for e in range(E) if e not in idx[t].tolist()][0]
        idx[t][idx[t] == IDLE] = free
    return logits, scores, idx


def build(seed: int = 0, layers: int = 1, family: str = "qwen3_moe") -> nn.Module:
    """Qwen3-MoE (experts (out, in), no bias) or GPT-OSS (experts stored (in, out), biased, clamped
    interleaved SwiGLU); expert IDLE of layer 0 gets no tokens."""
    hf.refresh()
    torch.manual_seed(seed)
    common = dict(vocab_size=64, hidden_size=H, num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                  num_experts_per_tok=2, max_position_embeddings=64, experts_implementation="eager")  # fmt: skip
    if family == "gpt_oss":
        model = GptOssForCausalLM(GptOssConfig(intermediate_size=INTER, num_local_experts=E, **common)).eval()
        with torch.no_grad():
            for layer in model.model.layers:  # transformers leaves these uninitialised (torch.empty)
                for p in layer.mlp.experts.parameters():
                    p.copy_(torch.randn_like(p) * 0.2)
            model.model.layers[0].mlp.router.bias[IDLE] = -1e4  # never among the top 2
    else:
        model = Qwen3MoeForCausalLM(Qwen3MoeConfig(intermediate_size=96, moe_intermediate_size=INTER, num_experts=E, **common)).eval()
        model.model.layers[0].mlp.gate.register_forward_hook(_starve)
    with torch.no_grad():  # outlier hidden channels, so the scales matter
        model.model.embed_tokens.weight.mul_(torch.linspace(0.2, 6.0, H))
    return model


def batches(n: int = 3, seed: int = 1) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 64, (2, 8), generator=g) for _ in range(n)]


def loop(data):
    return lambda m: [m(x) for x in data]


def routed_inputs(model: nn.Module, data: list[torch.Tensor]) -> dict[tuple[str, int], list[torch.Tensor]]:
    """Per (projection, expert) of layer 0's experts, the per-batch inputs of its GEMM in the unquantized model."""
    experts = model.model.layers[0].mlp.experts
    seen = []
    handle = experts.register_forward_pre_hook(lambda _m, args: seen.append([a.detach() for a in args]))
    with torch.no_grad():
        for x in data:
            model(x)
    handle.remove()
    out: dict = {}
    for hidden, idx, _ in seen:
        for e in range(E):
            _, tok = torch.where((idx == e).T)  # the fused forward's order: by top-k slot, then token
            if tok.numel() == 0:
                continue
            xe = hidden[tok]
            out.setdefault(("gate_up_proj", e), []).append(xe)
            with torch.no_grad():
                out.setdefault(("down_proj", e), []).append(experts._apply_gate(_gemm(experts, "gate_up_proj", e, xe)))
    return out


def _gemm(experts: nn.Module, proj: str, e: int, x: torch.Tensor) -> torch.Tensor:
    """Expert e's unquantized GEMM as transformers computes it: transposed layouts (GPT-OSS) as
    ``x @ W + b``, the others as a linear; the down projection's inputs must be those bits."""
    w, b = _slice(experts, proj, e)
    if not experts.is_transposed:
        return F.linear(x, w, b)
    h = x @ w.transpose(0, 1)  # W as stored, (in, out)
    return h if b is None else h + b


def _slice(experts: nn.Module, proj: str, e: int) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Expert e's (out, in) weight of ``proj`` and its bias, as the fused forward uses them."""
    w = getattr(experts, proj)[e]
    if experts.is_transposed:
        w = w.transpose(0, 1)
    return w, (getattr(experts, f"{proj}_bias")[e] if experts.has_bias else None)


def reference(model: nn.Module, proj: str, e: int, inputs: list[torch.Tensor], algorithm, weight, inp) -> nn.Module:
    """A plain linear holding expert e's slice of ``proj``, calibrated on ``inputs`` with the same algorithm."""
    w, b = _slice(model.model.layers[0].mlp.experts, proj, e)
    lin = nn.Linear(w.shape[1], w.shape[0], bias=b is not None)
    with torch.no_grad():
        lin.weight.copy_(w)
        if b is not None:
            lin.bias.copy_(b)
    return ql.quantize(nn.Sequential(lin), _cfg(algorithm, weight, inp, pattern="*"), loop(inputs))[0]


@pytest.fixture(scope="module")
def data():
    return batches()


@pytest.mark.parametrize("family", ["qwen3_moe", "gpt_oss"])
@pytest.mark.parametrize("case", list(CASES))
def test_each_expert_equals_a_linear_calibrated_on_its_routed_tokens(case, family, data):
    algorithm, weight, inp = CASES[case]
    model = build(family=family)
    routed = routed_inputs(model, data)
    ql.quantize(model, _cfg(algorithm, weight, inp), loop(data))
    experts = model.model.layers[0].mlp.experts
    assert experts.tokens_per_expert[IDLE] == 0
    for proj in ("gate_up_proj", "down_proj"):
        iq, wq = getattr(experts, f"{proj}_input_quantizer"), getattr(experts, f"{proj}_weight_quantizer")
        ref_amax = []
        for e in range(E):
            if e == IDLE:
                continue
            ref = reference(build(family=family), proj, e, routed[(proj, e)], algorithm, weight, inp)
            if algorithm != "awq_clip":
                assert torch.equal(iq.pre_quant_scale[e], ref.input_quantizer.pre_quant_scale), (proj, e)
                assert torch.equal(wq[e].pre_quant_scale, ref.weight_quantizer.pre_quant_scale), (proj, e)
            assert torch.equal(wq[e].amax, ref.weight_quantizer.amax), (proj, e)
            if algorithm in ("awq_lite", "awq_full"):
                assert experts.awq_lite_alpha[proj][e] == ref.awq_lite_alpha, (proj, e)
            if algorithm in ("awq_clip", "awq_full"):
                assert torch.equal(experts.awq_clip_ratio[proj][e], ref.awq_clip_ratio), (proj, e)
            if inp is not None:
                ref_amax.append(ref.input_quantizer.amax)
        if inp is not None:  # one activation scale per layer: the max over the experts' own
            assert torch.equal(iq.amax, torch.stack(ref_amax).amax()), proj


def _hand_experts(experts: nn.Module, refs: dict, hidden: torch.Tensor, idx: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """The MoE experts' output computed from the reference linears (transformers' eager loop, by hand)."""
    out = torch.zeros_like(hidden)
    for e in range(E):
        pos, tok = torch.where((idx == e).T)
        if tok.numel() == 0:
            continue
        h = experts._apply_gate(refs[("gate_up_proj", e)](hidden[tok]))
        h = refs[("down_proj", e)](h) * weights[tok, pos, None]
        out.index_add_(0, tok, h.to(out.dtype))
    return out


@pytest.mark.parametrize("case", ["awq_lite-w4a8", "smoothquant-int8"])
def test_logits_equal_the_hand_reference(case, data):
    algorithm, weight, inp = CASES[case]
    model = build()
    routed = routed_inputs(model, data)
    ql.quantize(model, _cfg(algorithm, weight, inp), loop(data))
    experts = model.model.layers[0].mlp.experts
    refs = {}
    for proj in ("gate_up_proj", "down_proj"):
        for e in range(E):
            if e != IDLE:
                refs[(proj, e)] = reference(build(), proj, e, routed[(proj, e)], algorithm, weight, inp)
                refs[(proj, e)].input_quantizer.amax = getattr(experts, f"{proj}_input_quantizer").amax  # the layer's one scale
    hand = build()
    hand.model.layers[0].mlp.experts.forward = lambda hidden, idx, w: _hand_experts(experts, refs, hidden, idx, w)
    with torch.no_grad():
        for x in batches(2, seed=5):
            assert torch.equal(model(x).logits, hand(x).logits)


@pytest.mark.parametrize("policy", ["max_of_peers", "skip"])
@pytest.mark.parametrize("algorithm", ["awq_lite", "smoothquant"])
def test_expert_without_tokens_keeps_max_calibration_with_ones(policy, algorithm, data):
    weight, inp = (INT4, FP8) if algorithm == "awq_lite" else (INT8_W, INT8_IN)
    model = build()
    cfg = _cfg(algorithm, weight, inp)
    cfg["expert_input_policy"] = policy
    ql.quantize(model, cfg, loop(data))
    experts = model.model.layers[0].mlp.experts
    assert experts.tokens_per_expert[IDLE] == 0 and experts.tokens_per_expert.sum() > 0
    for proj in ("gate_up_proj", "down_proj"):
        iq, member = getattr(experts, f"{proj}_input_quantizer"), getattr(experts, f"{proj}_weight_quantizer")[IDLE]
        assert torch.equal(iq.pre_quant_scale[IDLE], torch.ones(iq.pre_quant_scale.shape[1]))
        assert member.pre_quant_scale is None
        own = ql.TensorQuantizer(weight)
        own.calibrate(getattr(experts, proj)[IDLE])
        assert torch.equal(member.amax, own.amax)  # max calibration of its own slice
        assert not torch.equal(iq.pre_quant_scale[0], torch.ones(iq.pre_quant_scale.shape[1]))
        if algorithm == "awq_lite":
            assert experts.awq_lite_alpha[proj][IDLE] is None


@pytest.mark.parametrize("algorithm", ["awq_lite", "smoothquant"])
def test_expert_without_tokens_raises_under_policy_error(algorithm, data):
    weight, inp = (INT4, FP8) if algorithm == "awq_lite" else (INT8_W, INT8_IN)
    cfg = _cfg(algorithm, weight, inp)
    cfg["expert_input_policy"] = "error"
    model = build()
    with pytest.raises(CalibrationError, match=r"model\.layers\.0\.mlp\.experts\.gate_up_proj\[3\].*expert_input_policy='error'"):
        ql.quantize(model, cfg, loop(data))


def test_save_restore_round_trip(tmp_path, data):
    model = ql.quantize(build(), _cfg("awq_lite", INT4, FP8), loop(data))
    path = tmp_path / "q.pt"
    ql.save(model, str(path))
    fresh = ql.restore(build(seed=3), str(path))
    fresh.load_state_dict(model.state_dict())
    a, b = model.model.layers[0].mlp.experts, fresh.model.layers[0].mlp.experts
    for proj in ("gate_up_proj", "down_proj"):
        assert torch.equal(getattr(a, f"{proj}_input_quantizer").pre_quant_scale, getattr(b, f"{proj}_input_quantizer").pre_quant_scale)
        for qa, qb in zip(getattr(a, f"{proj}_weight_quantizer"), getattr(b, f"{proj}_weight_quantizer")):
            assert (qa.pre_quant_scale is None and qb.pre_quant_scale is None) or torch.equal(qa.pre_quant_scale, qb.pre_quant_scale)
    with torch.no_grad():
        x = batches(1, seed=9)[0]
        assert torch.equal(model(x).logits, fresh(x).logits)


@pytest.mark.parametrize("where", ["wrong_rows", "linear_input"])
def test_restore_refuses_a_per_expert_scale_that_does_not_fit(where, data):
    model = ql.quantize(build(), _cfg("awq_lite", INT4, FP8), loop(data))
    state = ql.quantizer_state(model)
    key = "model.layers.0.mlp.experts.gate_up_proj_input_quantizer"
    if where == "wrong_rows":
        state["quantizers"][key]["_pre_quant_scale"] = state["quantizers"][key]["_pre_quant_scale"][:2]
        match = (r"gate_up_proj_input_quantizer: _pre_quant_scale of shape \(2, 64\) does not fit gate_up_proj \(expected \(experts, in\) "
                 r"= "
                 r"\(4, 64\)\)")
    else:  # a table moved onto a plain linear's input quantizer
        cfg = _cfg("max", INT4, FP8, pattern="*")
        linear = ql.quantize(build(), cfg, loop(data))
        state = ql.quantizer_state(linear)
        state["quantizers"]["model.layers.0.self_attn.q_proj.input_quantizer"]["_pre_quant_scale"] = torch.ones(E, H)
        match = r"q_proj.input_quantizer: a per-expert \(2-D\) _pre_quant_scale"
    with pytest.raises(ql.CheckpointError, match=match):
        ql.restore_state(build(), state)


def test_row_less_call_of_a_per_expert_scale_is_refused_by_name(data):
    model = ql.quantize(build(), _cfg("awq_lite", INT4, FP8), loop(data))
    iq = model.model.layers[0].mlp.experts.gate_up_proj_input_quantizer
    with pytest.raises(ValueError, match=r"gate_up_proj_input_quantizer: pre_quant_scale holds one row per expert"):
        iq(torch.randn(3, H))


def test_sequential_equals_in_memory(data):
    cfg = _cfg("awq_lite", INT4, FP8)
    mem = ql.quantize(build(layers=2), cfg, loop(data))
    seq = ql.quantize(build(layers=2), cfg, loop(data), sequential=True)
    for i in range(2):
        a, b = mem.model.layers[i].mlp.experts, seq.model.layers[i].mlp.experts
        assert a.awq_lite_alpha == b.awq_lite_alpha
        for name, q in a.named_modules():
            if isinstance(q, ql.TensorQuantizer):
                other = b.get_submodule(name)
                for attr in ("amax", "pre_quant_scale"):
                    x, y = getattr(q, attr), getattr(other, attr)
                    assert (x is None and y is None) or torch.equal(x, y), (i, name, attr)


def _dp_rank(rank: int, world: int, data: list[torch.Tensor], algorithm: str) -> dict:
    weight, inp = (INT4, FP8) if algorithm == "awq_lite" else (INT8_W, INT8_IN)
    model = ql.quantize(build(), _cfg(algorithm, weight, inp), loop(data[rank::world]))
    experts = model.model.layers[0].mlp.experts
    out = {"alpha": copy.deepcopy(getattr(experts, "awq_lite_alpha", None)), "tokens": experts.tokens_per_expert.clone()}
    for proj in ("gate_up_proj", "down_proj"):
        out[proj] = [getattr(experts, f"{proj}_input_quantizer").pre_quant_scale, getattr(experts, f"{proj}_input_quantizer").amax]
        out[proj] += [q.pre_quant_scale for q in getattr(experts, f"{proj}_weight_quantizer")]
        out[proj] += [q.amax for q in getattr(experts, f"{proj}_weight_quantizer")]  # awq_full: the clipped amax
    return out


@pytest.mark.distributed
@pytest.mark.parametrize("algorithm", ["awq_lite", "awq_full", "smoothquant"])
def test_dp2_ranks_choose_alike(algorithm):
    from tests.ranks import run_on_ranks

    data = batches(4, seed=2)
    outs = run_on_ranks(_dp_rank, 2, data, algorithm, timeout=180)
    assert not torch.equal(outs[0]["tokens"], outs[1]["tokens"])  # the ranks saw different tokens
    assert outs[0]["alpha"] == outs[1]["alpha"]
    for proj in ("gate_up_proj", "down_proj"):
        for x, y in zip(outs[0][proj], outs[1][proj]):
            assert (x is None and y is None) or torch.equal(x, y), proj
    single = _dp_rank(0, 1, data, algorithm)  # one process on every rank's batches: the same choices
    assert single["alpha"] == outs[0]["alpha"]
    for proj in ("gate_up_proj", "down_proj"):
        for x, y in zip(single[proj], outs[0][proj]):
            assert (x is None and y is None) or torch.allclose(x, y, rtol=1e-5, atol=0), proj


def test_export_refuses_per_expert_scales_by_name(data):
    from quantlib.export import ExportError, iter_packed

    model = ql.quantize(build(), _cfg("awq_lite", INT4, None), loop(data))
    with pytest.raises(ExportError, match=r"experts\.gate_up_proj_input_quantizer: pre_quant_scale of shape \(\d+, \d+\) .* folds nowhere"):
        list(iter_packed(model, "ct_int_pack"))
