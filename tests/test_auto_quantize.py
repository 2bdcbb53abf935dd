"""auto_quantize: scores are the loss-gradient-weighted output errors ModelOpt defines, the search is the
optimum under the budget, the chosen formats are installed with their own calibration, and bad input is
refused by name."""

from __future__ import annotations

import copy
import itertools
import random

import pytest
import torch
from torch import nn

import quantlib as ql
from quantlib.auto_quantize import NONE, Decision, _search, auto_quantize, weight_bits
from quantlib.config import ConfigError


def mlp(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(64, 128), nn.GELU(), nn.Linear(128, 64), nn.GELU(), nn.Linear(64, 32))


def data(n: int = 4) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(8, 64, generator=g), torch.randint(0, 32, (8,), generator=g)) for _ in range(n)]


def step(m, batch):
    return m(batch[0])


def loss(out, batch):
    return nn.functional.cross_entropy(out, batch[1])


def test_weight_bits():
    cfg = ql.QuantizeConfig.from_any
    spec = lambda preset: ql.quantize(mlp(), preset)[0].weight_quantizer.spec  # noqa: E731
    assert weight_bits(spec(ql.NVFP4_DEFAULT_CFG)) == 4.5
    assert weight_bits(spec(ql.FP8_DEFAULT_CFG)) == 8.0
    assert weight_bits(spec(ql.MXFP8_DEFAULT_CFG)) == 8.25
    assert weight_bits(spec(ql.INT8_DEFAULT_CFG)) == 8.0
    assert weight_bits(None) == 16.0
    assert cfg(ql.NVFP4_DEFAULT_CFG)


def test_scores_are_gradient_weighted_output_errors():
    """Module 2's NVFP4 score equals sum((dL/dy * (Q(y) - y))^2), computed here by hand."""
    batches = data(2)
    model, state = auto_quantize(copy.deepcopy(mlp()), {"effective_bits": 16}, ["NVFP4_DEFAULT_CFG"], batches, step, loss,
                                 num_calib_steps=2, num_score_steps=2)
    ref_q = ql.quantize(mlp(), ql.NVFP4_DEFAULT_CFG, lambda m: [m(b[0]) for b in batches])
    plain = mlp()
    expected = 0.0
    for b in batches:
        x = b[0]
        h = plain[1](plain[0](x))
        y = plain[2](h)
        y.retain_grad()
        out = plain[4](plain[3](y))
        loss(out, b).backward()
        with torch.no_grad():
            diff = ref_q[2](h) - y
        expected += float((y.grad * diff).square().sum())
        plain.zero_grad()
    got = next(d for d in state["decisions"] if d["modules"] == ["2"])["score"]["NVFP4_DEFAULT_CFG"]
    assert got == pytest.approx(expected, rel=1e-5)
    assert state["best"]["effective_bits"] == 16.0  # a budget of 16 bits leaves everything unquantized
    assert all(r == NONE for r in state["best"]["recipe"].values())


def test_search_is_the_optimum_on_small_instances():
    rng = random.Random(0)
    cands = ["A", "B", NONE]
    for trial in range(60):
        ds = []
        for _ in range(rng.randint(1, 5)):
            d = Decision([f"m{len(ds)}"], rng.choice([64, 128, 256]))
            d.bits = {"A": 4.5, "B": 8.0, NONE: 16.0}
            d.score = {"A": rng.uniform(1, 10), "B": rng.uniform(0, 1), NONE: 0.0}
            ds.append(d)
        budget = rng.uniform(4.5, 16)
        total = sum(d.numel for d in ds)
        best = min(
            (sum(d.score[c] for d, c in zip(ds, combo)), combo)
            for combo in itertools.product(cands, repeat=len(ds))
            if sum(d.bits[c] * d.numel for d, c in zip(ds, combo)) <= budget * total
        )
        choice = _search(ds, budget, cands)
        got = sum(ds[i].score[c] for i, c in choice.items())
        assert sum(ds[i].bits[c] * ds[i].numel for i, c in choice.items()) <= budget * total
        assert got == pytest.approx(best[0], abs=1e-12), (trial, got, best)


def test_mixed_choice_is_installed_with_each_formats_calibration():
    batches = data()
    model, state = auto_quantize(mlp(), {"effective_bits": 6.0}, ["NVFP4_DEFAULT_CFG", "FP8_DEFAULT_CFG"], batches, step, loss)
    recipe = state["best"]["recipe"]
    assert set(recipe) == {"0", "2", "4"} and 4.5 <= state["best"]["effective_bits"] <= 6.0
    assert len(set(recipe.values())) > 1  # a budget between the two formats mixes them
    for name, cand in recipe.items():
        m = model.get_submodule(name)
        if cand == NONE:
            assert not m.weight_quantizer.is_enabled
            continue
        ref = ql.quantize(mlp(), getattr(ql, cand), lambda m: [m(b[0]) for b in batches]).get_submodule(name)
        assert m.weight_quantizer.spec == ref.weight_quantizer.spec
        assert torch.equal(m.weight_quantizer.amax, ref.weight_quantizer.amax)
        if cand == "FP8_DEFAULT_CFG":  # calibrated alone, on its own format's activations upstream
            assert m.input_quantizer.amax is not None
    # the returned config reproduces the choice on a fresh model
    fresh = ql.quantize(mlp(), state["config"])
    for name, cand in recipe.items():
        q = fresh.get_submodule(name).weight_quantizer
        assert q.is_enabled == (cand != NONE)
        if cand != NONE:
            assert q.spec == model.get_submodule(name).weight_quantizer.spec


def test_tighter_budget_costs_more_score():
    batches = data()
    scores = []
    for bits in (4.5, 6.0, 8.0, 16.0):
        _, state = auto_quantize(mlp(), {"effective_bits": bits}, ["NVFP4_DEFAULT_CFG", "FP8_DEFAULT_CFG"], batches, step, loss)
        scores.append(state["best"]["score"])
        assert state["best"]["effective_bits"] <= bits + 1e-9
    assert scores == sorted(scores, reverse=True) and scores[-1] == 0.0


def test_fused_siblings_take_one_format():
    pytest.importorskip("transformers")
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=4,
                                         num_key_value_heads=2, max_position_embeddings=32)).eval()
    ids = [torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(i)) for i in range(2)]
    _, state = auto_quantize(model, {"effective_bits": 6.0}, ["NVFP4_DEFAULT_CFG", "FP8_DEFAULT_CFG"], ids, lambda m, b: m(b).logits,
                             lambda out, b: nn.functional.cross_entropy(out[:, :-1].reshape(-1, 128), b[:, 1:].reshape(-1)),
                             disabled_layers="*lm_head*")
    r = state["best"]["recipe"]
    attn, mlp_ = "model.layers.0.self_attn", "model.layers.0.mlp"
    assert r[f"{attn}.q_proj"] == r[f"{attn}.k_proj"] == r[f"{attn}.v_proj"]
    assert r[f"{mlp_}.gate_proj"] == r[f"{mlp_}.up_proj"]
    assert "lm_head" not in r


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"constraints": {"effective_bits": 0}}, r"constraints\['effective_bits'\]=0: expected a number of bits in \(0, 16\]"),
        ({"constraints": {"bits": 4}}, r"constraints=\{'bits': 4\}: expected \{'effective_bits': float\}"),
        ({"constraints": {"effective_bits": 5, "cost_model": "active_moe"}}, r"cost_model'\]='active_moe': only 'weight'"),
        ({"constraints": {"effective_bits": 3.0}}, r"effective_bits'\]=3.0: the smallest the candidates reach is 4.500 bits"),
        ({"quantization_formats": []}, r"quantization_formats=\[\]: expected a non-empty list"),
        ({"quantization_formats": ["NVFP4"]}, r"quantization_formats\[0\]='NVFP4': not a quantlib preset name"),
        ({"quantization_formats": [{"quant_cfg": {"*weight_quantizer": {"num_bitz": 4}}}]}, r"unknown quantizer attribute 'num_bitz'"),
        ({"num_score_steps": 0}, r"num_score_steps=0: expected an int >= 1"),
    ],
)
def test_bad_input_refused_by_name(kwargs, match):
    args = {"constraints": {"effective_bits": 6.0}, "quantization_formats": ["NVFP4_DEFAULT_CFG"]} | kwargs
    with pytest.raises(ConfigError, match=match):
        auto_quantize(mlp(), args.pop("constraints"), args.pop("quantization_formats"), data(1), step, loss, **args)


def test_each_candidate_is_parsed_once(monkeypatch):
    """Two candidates and the chosen mix: three parses (each candidate was parsed to be checked, then again by
    its quantize call: five)."""
    from quantlib.config import QuantizeConfig

    parses = []
    real = QuantizeConfig.__post_init__
    monkeypatch.setattr(QuantizeConfig, "__post_init__", lambda self: (parses.append(self), real(self))[1])
    auto_quantize(mlp(), {"effective_bits": 6.0}, ["NVFP4_DEFAULT_CFG", "FP8_DEFAULT_CFG"], data(), step, loss)
    assert len(parses) == 3
