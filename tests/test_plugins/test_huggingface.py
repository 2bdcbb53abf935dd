"""HF transformers fused MoE experts: per-expert GroupedQuantizers over the 3-D expert parameters.

Tiny Qwen3-MoE models are built from a config (no downloads). Expert e's weights are scaled by 2**e,
so a quantizer that used any other expert's amax (or one shared amax) is caught by construction.
Needs ``transformers`` (the ``transformers`` extra).
"""

from __future__ import annotations

import logging

import pytest
import torch
import torch.nn.functional as F
from torch import nn

transformers = pytest.importorskip("transformers", reason="needs transformers (pip install quantlib[transformers])")
from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM  # noqa: E402
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts  # noqa: E402

import quantlib as ql  # noqa: E402
from quantlib.nn import GroupedQuantizer, QuantModuleRegistry  # noqa: E402
from quantlib.plugins import huggingface as hf  # noqa: E402

E, H, INTER, K = 4, 32, 16, 2

FP8_IN_INT8_W = {
    "quant_cfg": {"*weight_quantizer": {"num_bits": 8, "axis": 0}, "*input_quantizer": {"num_bits": (4, 3), "axis": None},
                  "default": {"enable": False}},
    "algorithm": "max",
}
CONFIGS = {
    "fp8-in-int8-channel-w": FP8_IN_INT8_W,
    "fp8": ql.FP8_DEFAULT_CFG,
    "nvfp4-weight-only": {"quant_cfg": {"*weight_quantizer": ql.NVFP4_DEFAULT_CFG["quant_cfg"]["*weight_quantizer"],
                                        "default": {"enable": False}}, "algorithm": "max"},
    "int4-block-weight-only": ql.INT4_BLOCKWISE_WEIGHT_ONLY_CFG,
}


@pytest.fixture(autouse=True)
def _registered():
    hf.refresh()  # the plugin may have loaded before transformers' modeling code did
    assert QuantModuleRegistry.is_registered(Qwen3MoeExperts)


def tiny_config(**kw) -> Qwen3MoeConfig:
    base = dict(vocab_size=64, hidden_size=H, intermediate_size=48, moe_intermediate_size=INTER, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, head_dim=8, num_experts=E, num_experts_per_tok=K, max_position_embeddings=64,
                experts_implementation="eager")  # fmt: skip
    base.update(kw)
    return Qwen3MoeConfig(**base)


def tiny_model(seed: int = 0, **kw) -> Qwen3MoeForCausalLM:
    torch.manual_seed(seed)
    model = Qwen3MoeForCausalLM(tiny_config(**kw)).eval()
    with torch.no_grad():
        for layer in model.model.layers:
            for e in range(layer.mlp.experts.num_experts):
                layer.mlp.experts.gate_up_proj[e].mul_(2.0**e)
                layer.mlp.experts.down_proj[e].mul_(2.0**e)
    return model


def experts_module(seed: int = 0) -> Qwen3MoeExperts:
    torch.manual_seed(seed)
    m = Qwen3MoeExperts(tiny_config())
    with torch.no_grad():
        for e in range(E):
            m.gate_up_proj[e].copy_((2.0**e) * torch.randn(2 * INTER, H))
            m.down_proj[e].copy_((2.0**e) * torch.randn(H, INTER))
    return m


def routing(tokens: int = 24, seed: int = 1, never: tuple[int, ...] = ()):
    """(hidden, top_k_index, top_k_weights); every expert not in ``never`` gets tokens."""
    g = torch.Generator().manual_seed(seed)
    experts = [e for e in range(E) if e not in never]
    idx = torch.stack([torch.tensor([experts[(t + j) % len(experts)] for j in range(K)]) for t in range(tokens)])
    w = torch.softmax(torch.randn(tokens, K, generator=g), dim=-1)
    return torch.randn(tokens, H, generator=g), idx, w


class SeparateLinearExperts(nn.Module):
    """The same experts as separate nn.Linear modules (``experts.{e}.gate_up`` / ``.down``), routed
    exactly as transformers' eager loop routes fused experts."""

    def __init__(self, fused: nn.Module) -> None:
        super().__init__()
        self.act_fn = fused.act_fn
        self.experts = nn.ModuleList()
        for e in range(fused.num_experts):
            pair = nn.Module()
            pair.gate_up = nn.Linear(H, 2 * INTER, bias=False)
            pair.down = nn.Linear(INTER, H, bias=False)
            pair.gate_up.weight.data.copy_(fused.gate_up_proj.data[e])
            pair.down.weight.data.copy_(fused.down_proj.data[e])
            self.experts.append(pair)

    def forward(self, hidden, top_k_index, top_k_weights):
        out = torch.zeros_like(hidden)
        mask = F.one_hot(top_k_index, num_classes=len(self.experts) + 1).permute(2, 1, 0)
        for e, pair in enumerate(self.experts):
            top_k_pos, token_idx = torch.where(mask[e])
            if len(token_idx) == 0:
                continue
            gate, up = pair.gate_up(hidden[token_idx]).chunk(2, dim=-1)
            h = pair.down(self.act_fn(gate) * up) * top_k_weights[token_idx, top_k_pos, None]
            out.index_add_(0, token_idx, h)
        return out


def loop(batches):
    def forward_loop(model):
        for b in batches:
            model(*b) if isinstance(b, tuple) else model(b)

    return forward_loop


# ------------------------------------------------------------------------------ the module


def test_experts_module_gets_grouped_weight_quantizers():
    model = ql.quantize(tiny_model(), FP8_IN_INT8_W, loop([torch.randint(0, 64, (2, 8))]))
    experts = model.model.layers[0].mlp.experts
    assert type(experts).__name__ == "QuantQwen3MoeExperts" and experts.is_expert
    for proj, shape in (("gate_up_proj", (2 * INTER, 1)), ("down_proj", (H, 1))):
        q = getattr(experts, f"{proj}_weight_quantizer")
        assert isinstance(q, GroupedQuantizer) and len(q) == E
        for e in range(E):  # member e: expert e's own slice, per output channel like nn.Linear
            assert q[e].amax.shape == shape
            assert torch.equal(q[e].amax, getattr(experts, proj).detach()[e].abs().amax(dim=1, keepdim=True))
        assert getattr(experts, f"{proj}_input_quantizer").amax is not None
    assert "model.layers.0.mlp.experts.down_proj_weight_quantizer.3" in ql.quant_summary(model)


def test_disabled_quantizers_reproduce_transformers_eager_forward():
    fused = experts_module()
    hidden, idx, w = routing()
    with torch.no_grad():
        expected = fused(hidden, idx, w)  # transformers' own (eager) implementation
        converted = ql.quantize(fused, {"quant_cfg": {"default": {"enable": False}}, "algorithm": None})
        assert isinstance(converted, ql.QuantModule)
        assert torch.equal(converted(hidden, idx, w), expected)


@pytest.mark.parametrize("config", sorted(CONFIGS))
def test_fused_experts_match_separate_linears(config):
    cfg = CONFIGS[config]
    batches = [routing(seed=s) for s in (1, 2, 3)]
    fused = ql.quantize(experts_module(), cfg, loop(batches))
    ref = ql.quantize(SeparateLinearExperts(experts_module()), cfg, loop(batches))
    for proj, lin in (("gate_up_proj", "gate_up"), ("down_proj", "down")):
        members = getattr(fused, f"{proj}_weight_quantizer")
        for e in range(E):
            assert torch.equal(members[e].amax, getattr(ref.experts[e], lin).weight_quantizer.amax), (proj, e)
        for e in range(1, E):  # expert e is scaled by 2**e: never another expert's amax
            assert not torch.equal(members[e].amax, members[0].amax)
        # One input quantizer per projection, shared by the experts: the max over every expert's
        # tokens, which is what the expert-group sync (docs/design.md §5) gives the separate linears.
        inq = getattr(fused, f"{proj}_input_quantizer")
        ref_in = [getattr(ref.experts[e], lin).input_quantizer for e in range(E)]
        if inq.is_enabled and inq.needs_calibration:
            shared = torch.stack([q.amax for q in ref_in]).amax(dim=0)
            assert torch.equal(inq.amax, shared)
            for q in ref_in:
                q.amax = shared
    hidden, idx, w = routing(seed=7)
    with torch.no_grad():
        assert torch.equal(fused(hidden, idx, w), ref(hidden, idx, w))


def test_unrouted_expert_keeps_its_own_weight_amax_and_is_reported(caplog):
    fused = ql.quantize(experts_module(), FP8_IN_INT8_W, loop([routing(seed=s, never=(2,)) for s in (1, 2)]))
    assert fused.tokens_per_expert.tolist()[2] == 0 and sum(fused.tokens_per_expert.tolist()) == 2 * 24 * K
    q = fused.gate_up_proj_weight_quantizer[2]
    assert torch.equal(q.amax, fused.gate_up_proj.detach()[2].abs().amax(dim=1, keepdim=True))
    with caplog.at_level(logging.WARNING, logger="quantlib"):
        report = hf.tokens_per_expert_report(fused)
    assert report == {"": fused.tokens_per_expert.tolist()}
    assert "expert(s) [2]" in caplog.text
    ql.calibrate(fused, forward_loop=loop([routing(seed=3)]))  # recalibration counts afresh
    assert fused.tokens_per_expert.tolist() == [12, 12, 12, 12]


def test_weight_only_calibration_counts_tokens_too():
    cfg = {"quant_cfg": {"*weight_quantizer": {"num_bits": 8, "axis": 0}, "default": {"enable": False}}, "algorithm": "max"}
    fused = ql.quantize(experts_module(), cfg, loop([routing(seed=1)]))
    assert fused.tokens_per_expert.tolist() == [12, 12, 12, 12]
    with torch.no_grad():
        fused(*routing(seed=2))  # inference does not count
    ql.calibrate(fused, forward_loop=loop([routing(seed=3, tokens=8)]))
    assert fused.tokens_per_expert.tolist() == [4, 4, 4, 4]


def test_qat_gradients_reach_the_fused_parameters():
    fused = ql.quantize(experts_module(), FP8_IN_INT8_W, loop([routing()]))
    with torch.no_grad():
        fused(*routing())  # fills the view and weight caches
    hidden, idx, w = routing(seed=5)
    fused(hidden, idx, w).square().sum().backward()
    assert fused.gate_up_proj.grad is not None and fused.gate_up_proj.grad[1:].abs().sum() > 0
    assert fused.down_proj.grad is not None


def test_weight_cache_sees_an_updated_expert_slice():
    fused = ql.quantize(experts_module(), FP8_IN_INT8_W, loop([routing()]))
    hidden, idx, w = routing(seed=5)
    with torch.no_grad():
        before = fused(hidden, idx, w)
        fused.down_proj[3].mul_(0.5)  # in place: bumps the parameter's version
        fused.calibrate_weights()
        after = fused(hidden, idx, w)
    assert not torch.equal(before, after)


# ------------------------------------------------------------------------------ another layout


class TransposedBiasedExperts(nn.Module):
    """GPT-OSS-like layout: slices stored (in, out), with biases."""

    def __init__(self) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(3)
        self.num_experts, self.is_transposed, self.has_bias, self.has_gate = E, True, True, True
        self.gate_up_proj = nn.Parameter(torch.stack([(2.0**e) * torch.randn(H, 2 * INTER, generator=g) for e in range(E)]))
        self.gate_up_proj_bias = nn.Parameter(torch.randn(E, 2 * INTER, generator=g))
        self.down_proj = nn.Parameter(torch.stack([(2.0**e) * torch.randn(INTER, H, generator=g) for e in range(E)]))
        self.down_proj_bias = nn.Parameter(torch.randn(E, H, generator=g))
        self.act_fn = nn.SiLU()

    def forward(self, hidden, top_k_index, top_k_weights):  # what the quantized class replaces
        raise NotImplementedError


def test_registered_transposed_layout_matches_separate_linears():
    hf.register_fused_experts(TransposedBiasedExperts)
    try:
        fused = ql.quantize(TransposedBiasedExperts(), FP8_IN_INT8_W, None)
        for e in range(E):  # per output channel of the (out, in) view of each slice
            assert torch.equal(fused.down_proj_weight_quantizer[e].amax, fused.down_proj.detach()[e].abs().amax(dim=0).reshape(H, 1))
        hidden, idx, w = routing()
        with torch.no_grad():
            out = fused(hidden, idx, w)
            expected = torch.zeros_like(hidden)
            x_all = fused.gate_up_proj_input_quantizer(hidden)
            mask = F.one_hot(idx, num_classes=E + 1).permute(2, 1, 0)
            for e in range(E):
                pos, tok = torch.where(mask[e])
                x = x_all[tok]
                h = F.linear(x, fused.gate_up_proj_weight_quantizer[e](fused.gate_up_proj[e].T), fused.gate_up_proj_bias[e])
                gate, up = h.chunk(2, dim=-1)
                h = fused.down_proj_input_quantizer(F.silu(gate) * up)
                h = F.linear(h, fused.down_proj_weight_quantizer[e](fused.down_proj[e].T), fused.down_proj_bias[e])
                expected.index_add_(0, tok, h * w[tok, pos, None])
        assert torch.equal(out, expected)
    finally:
        QuantModuleRegistry.unregister(TransposedBiasedExperts)


# ------------------------------------------------------------------------------ checkpoints


def _amaxes(model) -> dict[str, torch.Tensor]:
    return {n: q.amax for n, q in ql.model_quant.iter_leaf_quantizers(model) if q.amax is not None}


def test_save_restore_round_trip_gives_identical_per_expert_amax(tmp_path):
    ids = [torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(s)) for s in range(2)]
    model = ql.quantize(tiny_model(), ql.FP8_DEFAULT_CFG, loop(ids))
    ql.save(model, tmp_path / "q.pt")
    fresh = ql.restore(tiny_model(), tmp_path / "q.pt")
    saved, restored = _amaxes(model), _amaxes(fresh)
    assert saved.keys() == restored.keys() and all(torch.equal(saved[k], restored[k]) for k in saved)
    members = [restored[f"model.layers.1.mlp.experts.down_proj_weight_quantizer.{e}"] for e in range(E)]
    assert len({m.item() for m in members}) == E  # every member its own amax (the anchor kept only one)
    with torch.no_grad():
        assert torch.equal(fresh(ids[0]).logits, model(ids[0]).logits)
    again = ql.restore(tiny_model(), tmp_path / "q.pt", recalibrate_experts=True)
    assert all(torch.equal(_amaxes(again)[k], saved[k]) for k in saved)


def test_state_dict_carries_every_member(tmp_path):
    model = ql.quantize(tiny_model(), FP8_IN_INT8_W, loop([torch.randint(0, 64, (2, 8))]))
    sd = model.state_dict()
    assert all(f"model.layers.0.mlp.experts.gate_up_proj_weight_quantizer.{e}._amax" in sd for e in range(E))
    fresh = ql.convert(tiny_model())
    ql.set_quantizer_by_cfg(fresh, FP8_IN_INT8_W)
    fresh.load_state_dict(sd)
    assert all(torch.equal(_amaxes(fresh)[k], v) for k, v in _amaxes(model).items())


def test_restore_into_experts_of_another_shape_raises_and_leaves_the_model(tmp_path):
    model = ql.quantize(tiny_model(), FP8_IN_INT8_W, loop([torch.randint(0, 64, (2, 8))]))
    ql.save(model, tmp_path / "q.pt")
    other = tiny_model(moe_intermediate_size=24)
    with pytest.raises(ql.CheckpointError,
                       match=r"gate_up_proj_weight_quantizer\.0: amax of shape \(32, 1\) does not fit weight \(48, 32\)"):
        ql.restore(other, tmp_path / "q.pt")
    assert not any(isinstance(m, ql.QuantModule) for m in other.modules())
    fewer = tiny_model(num_experts=2, num_experts_per_tok=1)
    with pytest.raises(ql.CheckpointError, match="4 weight quantizer member"):
        ql.restore(fewer, tmp_path / "q.pt")
