"""``sync_expert_weight_amax`` in one process: the README says expert weights then share one amax (the
max over the layer's experts); without a process group no sync ran and the flag was ignored."""

from __future__ import annotations

import copy

import pytest
import torch

pytest.importorskip("transformers")

import quantlib as ql  # noqa: E402
from tests.test_export._export_models import qwen3_moe, tokens  # noqa: E402


@pytest.mark.parametrize("preset", ["NVFP4_DEFAULT_CFG", "FP8_DEFAULT_CFG"])
def test_local_experts_share_the_max_weight_amax(preset):
    base = qwen3_moe()  # experts of magnitudes 1, 2, 4, 8 (x their init)
    cfg = copy.deepcopy(getattr(ql, preset))
    per_expert = ql.quantize(copy.deepcopy(base), cfg, lambda m: m(tokens()))
    cfg["sync_expert_weight_amax"] = True
    shared = ql.quantize(copy.deepcopy(base), cfg, lambda m: m(tokens()))
    for layer in range(2):
        for proj in ("gate_up_proj", "down_proj"):
            own = [q.amax for q in getattr(per_expert.model.layers[layer].mlp.experts, f"{proj}_weight_quantizer")]
            got = [q.amax for q in getattr(shared.model.layers[layer].mlp.experts, f"{proj}_weight_quantizer")]
            assert len({float(a) for a in own}) == 4  # the experts differ
            top = torch.stack(own).amax()
            assert all(torch.equal(a, top) for a in got), (layer, proj, [float(a) for a in got])
    # the attention's weights are no experts: untouched
    assert torch.equal(shared.model.layers[0].self_attn.q_proj.weight_quantizer.amax,
                       per_expert.model.layers[0].self_attn.q_proj.weight_quantizer.amax)


def test_dynamic_weight_sync_keeps_the_shared_expert_amax():
    """Scales from the weights being sent still follow the config: one global amax per layer's experts."""
    from quantlib.export import sync_pairs
    from quantlib.formats.nvfp4 import nvfp4_global_scale

    cfg = copy.deepcopy(ql.NVFP4_DEFAULT_CFG)
    cfg["quant_cfg"] = {"*weight_quantizer": cfg["quant_cfg"]["*weight_quantizer"], "default": {"enable": False}}
    cfg["sync_expert_weight_amax"] = True
    model = ql.quantize(qwen3_moe(), cfg, lambda m: m(tokens()))
    pairs = dict(sync_pairs(model, "modelopt_nvfp4"))
    experts = model.model.layers[1].mlp.experts
    for proj, key in (("gate_up_proj", "w13"), ("down_proj", "w2")):
        top = getattr(experts, proj).detach().abs().amax()
        s2 = pairs[f"model.layers.1.mlp.experts.{key}_weight_scale_2"]
        assert torch.equal(s2, nvfp4_global_scale(top).expand_as(s2)), (proj, s2)
    ql.model_quant.applied_config(model).sync_expert_weight_amax = False
    s2 = dict(sync_pairs(model, "modelopt_nvfp4"))["model.layers.1.mlp.experts.w2_weight_scale_2"]
    assert len(set(s2.tolist())) == 4  # per expert without the flag


class _ListMoE(torch.nn.Module):
    """A hand-built MoE: an ``nn.ModuleList`` of ``nn.Linear`` experts, which quantlib quantizes as plain linears."""

    def __init__(self) -> None:
        super().__init__()
        self.experts = torch.nn.ModuleList([torch.nn.Linear(32, 32, bias=False) for _ in range(4)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return sum(e(x) for e in self.experts)


def test_sync_expert_weight_amax_without_recognized_experts_is_refused():
    """The flag changed nothing there (each linear kept its own amax) and said nothing: now a ConfigError naming it
    and the modules that look like experts; the model is left as it was."""
    cfg = copy.deepcopy(ql.NVFP4_DEFAULT_CFG)
    cfg["sync_expert_weight_amax"] = True
    model = torch.nn.Sequential(_ListMoE())
    with pytest.raises(ql.ConfigError, match=r"sync_expert_weight_amax=True: no module of Sequential is an expert .*4 module\(s\) "
                                             r"named like experts .*\['0\.experts\.0', '0\.experts\.1', '0\.experts\.2'\]"):
        ql.quantize(model, cfg, lambda m: m(torch.randn(8, 32)))
    assert not any(isinstance(m, ql.QuantModule) for m in model.modules())
    cfg["sync_expert_weight_amax"] = False
    ql.quantize(model, cfg, lambda m: m(torch.randn(8, 32)))
