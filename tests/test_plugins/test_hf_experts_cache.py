"""The stacked expert-weight cache (quantlib.plugins.expert_weights) is validated by the members'
generations (TensorQuantizer.generation) and buffer versions: every change of one member's state makes the
next forward quantize again, and a forward that reuses it equals one without any cache. (Writes through
``.data`` bypass version counters: ``quantlib.clear_weight_cache``, see tests/test_nn/test_weight_cache.py.)"""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch

pytest.importorskip("transformers", reason="needs transformers (pip install quantlib[transformers])")

import quantlib as ql  # noqa: E402
from quantlib.nn import TensorQuantizer  # noqa: E402
from quantlib.nn.quant_module import _quantizer_token  # noqa: E402
from quantlib.plugins import huggingface as hf  # noqa: E402

from .test_hf_experts_grouped import _hidden, _routing  # noqa: E402
from .test_hf_experts_layouts import expert_modules, input_ids, tiny_model  # noqa: E402

KEY = ("stacked", "gate_up_proj_weight_quantizer")


def _replace_member(m, q):
    fresh = TensorQuantizer(q.attrs)
    fresh.amax = q.amax * 2
    m.gate_up_proj_weight_quantizer[1] = fresh


def _replace_by_copy(m, q):
    twin = copy.deepcopy(q)
    twin.amax.mul_(2)
    m.gate_up_proj_weight_quantizer[1] = twin


MUTATIONS = {
    "amax setter": lambda m, q: setattr(q, "amax", q.amax * 2),
    "amax written in place": lambda m, q: q.amax.mul_(2),
    "reset_amax": lambda m, q: q.reset_amax(),
    "disable": lambda m, q: q.disable(),
    "disable_quant": lambda m, q: q.disable_quant(),
    "enable_calib": lambda m, q: q.enable_calib(),
    "a switch set directly": lambda m, q: setattr(q, "_disabled", True),
    "set_from_attribute_config": lambda m, q: q.set_from_attribute_config(dataclasses.replace(q.attrs, num_bits=(5, 2))),
    "load_state_dict": lambda m, q: q.load_state_dict({"_amax": q.amax * 3}),
    "pre_quant_scale": lambda m, q: setattr(q, "pre_quant_scale", torch.full((q_in(m),), 2.0)),
    "to (buffers moved)": lambda m, q: q.to(torch.float64),
    "member replaced": _replace_member,
    "member replaced by a copy, then changed": _replace_by_copy,
}


def q_in(m) -> int:
    return m.gate_up_proj.shape[-1]


@pytest.fixture(autouse=True)
def _plugin_sees_the_modeling_modules():
    hf.refresh()


@pytest.mark.parametrize("mutation", list(MUTATIONS))
def test_every_change_of_a_member_invalidates_the_stacked_cache(mutation):
    model = ql.quantize(tiny_model("qwen3_moe"), ql.FP8_DEFAULT_CFG, lambda mm: mm(input_ids(seed=5)))
    m = [e for _, e in expert_modules(model)][0]
    idx, w = _routing(m.num_experts, seed=3)
    hidden = torch.randn(idx.shape[0], _hidden(m), generator=torch.Generator().manual_seed(4))
    group = m.gate_up_proj_weight_quantizer
    with torch.no_grad():
        m(hidden, idx, w)
        entry = m._weight_cache[KEY]
        token = _quantizer_token(list(group.leaves()))
        assert m(hidden, idx, w) is not None and m._weight_cache[KEY] is entry  # reused while nothing changed
        MUTATIONS[mutation](m, group[1])
        after = _quantizer_token(list(m.gate_up_proj_weight_quantizer.leaves()))
        assert after != token
        got = m(hidden, idx, w)
        assert after is None or m._weight_cache.get(KEY) is not entry  # None: calibrating, nothing cached
        m.__dict__.pop("_weight_cache")
        assert torch.equal(got, m(hidden, idx, w))  # what no cache at all gives


def test_generations_are_never_shared():
    """A copy takes a new generation (so it can never validate the original's cache entry), as does a
    quantizer built later; a change of state gives a generation above every earlier one."""
    q = TensorQuantizer()
    q.amax = torch.tensor(1.0)
    twin = copy.deepcopy(q)
    other = TensorQuantizer()
    assert len({q.generation, twin.generation, other.generation}) == 3
    before = max(q.generation, twin.generation, other.generation)
    q.disable()
    assert q.generation > before


PLAN = ("plan", KEY)


@pytest.mark.parametrize("mutation", ["amax setter", "amax written in place", "reset_amax", "disable_quant", "pre_quant_scale",
                                      "member replaced by a copy, then changed"])
def test_qat_reuses_the_members_stacked_scales_until_one_changes(mutation):
    """Under autograd (QAT) the weights are fake-quantized every step, but the members' stacked amax are kept
    (E reshapes, a stack and E checks per step otherwise): reused while nothing changed, rebuilt after any
    change, and the forward and its gradients equal those of a module with no cache."""
    model = ql.quantize(tiny_model("qwen3_moe"), ql.FP8_DEFAULT_CFG, lambda mm: mm(input_ids(seed=5)))
    m = [e for _, e in expert_modules(model)][0]
    m.train()
    idx, w = _routing(m.num_experts, seed=3)
    hidden = torch.randn(idx.shape[0], _hidden(m), generator=torch.Generator().manual_seed(4))

    def step():
        m.zero_grad(set_to_none=True)
        out = m(hidden, idx, w)
        out.square().sum().backward()
        return out.detach(), m.gate_up_proj.grad

    step()
    plan = m._weight_cache[PLAN]
    entry = next(iter(plan.values()))
    assert entry[1] is not None and entry[1][1].shape[0] == m.num_experts  # the stacked amax (E, 1, 1)
    step()
    assert next(iter(m._weight_cache[PLAN].values())) is entry  # reused while nothing changed
    MUTATIONS[mutation](m, m.gate_up_proj_weight_quantizer[1])
    got = step()
    assert next(iter(m._weight_cache[PLAN].values())) is not entry
    m.__dict__.pop("_weight_cache")
    want = step()
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
