"""Fused MoE experts of transformers' real model classes (tiny configs, no downloads): GPT-OSS (transposed,
biased, clamped interleaved SwiGLU), Llama-4 (its own (E, in, out) layout and bmm forward), DeepSeek-V2,
Phi-MoE and Qwen3-MoE. With a weight preset every expert weight is quantized, and the quantized model's
output equals transformers' own forward on weights fake-quantized by hand; with every quantizer off it
equals the unconverted model's.
"""

from __future__ import annotations

import copy
import logging

import pytest
import torch
from torch import nn

T = pytest.importorskip("transformers", reason="needs transformers (pip install quantlib[transformers])")

import quantlib as ql  # noqa: E402
from quantlib.nn import GroupedQuantizer, QuantModule, TensorQuantizer  # noqa: E402
from quantlib.plugins import huggingface as hf  # noqa: E402

_COMMON = dict(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
               max_position_embeddings=64)

#: family -> (config class, model class, config fields); every family has fused experts in each MoE layer
FAMILIES = {
    "qwen3_moe": (T.Qwen3MoeConfig, T.Qwen3MoeForCausalLM, dict(_COMMON, intermediate_size=48, moe_intermediate_size=16, num_experts=4,
                                                                num_experts_per_tok=2)),
    "gpt_oss": (T.GptOssConfig, T.GptOssForCausalLM, dict(_COMMON, intermediate_size=16, num_local_experts=4, num_experts_per_tok=2,
                                                          layer_types=["full_attention"] * 2, sliding_window=8)),
    "llama4": (T.Llama4TextConfig, T.Llama4ForCausalLM, dict(_COMMON, intermediate_size=16, intermediate_size_mlp=48, num_local_experts=4,
                                                             num_experts_per_tok=1, interleave_moe_layer_step=1, no_rope_layers=[1, 1],
                                                             attention_chunk_size=64)),
    "deepseek_v2": (
        T.DeepseekV2Config,
        T.DeepseekV2ForCausalLM,
        dict(_COMMON, num_key_value_heads=4, intermediate_size=48, moe_intermediate_size=16, n_routed_experts=4, num_experts_per_tok=2,
             n_shared_experts=1, first_k_dense_replace=0,
             kv_lora_rank=16, q_lora_rank=None, qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=8, n_group=1, topk_group=1,
             rope_parameters={"rope_type": "default", "rope_theta": 10000.0}),
    ),  # fmt: skip
    "phimoe": (T.PhimoeConfig, T.PhimoeForCausalLM, dict(_COMMON, intermediate_size=16, num_local_experts=4, num_experts_per_tok=2)),
}


def tiny_model(family: str, seed: int = 0) -> nn.Module:
    """A 2-layer model of ``family`` with random weights; expert e's weights scaled by 2**e, so an expert
    quantized with another's amax shows."""
    cfg_cls, model_cls, fields = FAMILIES[family]
    torch.manual_seed(seed)
    model = model_cls(cfg_cls(**fields, experts_implementation="eager")).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("gate_up_proj", "down_proj")) and p.dim() == 3:
                p.normal_(0.0, 0.05)
                p.mul_((2.0 ** torch.arange(p.shape[0], dtype=p.dtype)).view(-1, 1, 1))
            elif p.dim() >= 2 and p.abs().max() == 0:
                p.normal_(0.0, 0.05)  # some classes start at zeros (Llama-4's gate_up_proj)
    return model


def input_ids(seed: int = 0, batch: int = 2, seq: int = 8) -> torch.Tensor:
    return torch.randint(0, 64, (batch, seq), generator=torch.Generator().manual_seed(seed))


def expert_modules(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """Modules holding 3-D expert parameters (converted or not)."""
    return [(n, m) for n, m in model.named_modules() if any(p.dim() == 3 for p in m.parameters(recurse=False))]


#: families whose gate runs a transcendental op over a fresh contiguous tensor (GPT-OSS: the clamped
#: interleaved halves, then sigmoid): ATen's CPU kernel computes the last (numel mod 2 vector widths)
#: elements with the scalar function (libm) and the rest with the vector one (Sleef), which may differ in
#: the last ulp, so where an element falls depends on how many rows its expert got with it. The loop runs
#: it per expert, the grouped path once: equal on CUDA, equal to a few ulps on the CPU.
CPU_TAIL_ULPS = {"gpt_oss"}


def assert_loop_bits(got: torch.Tensor, want: torch.Tensor, family: str) -> None:
    """``got`` equals the per-expert loop's ``want`` bit for bit, or to a few fp32 ulps for a
    :data:`CPU_TAIL_ULPS` family on the CPU (an error of the quantization would be ~1e-3 relative)."""
    if family in CPU_TAIL_ULPS and got.device.type == "cpu":
        torch.testing.assert_close(got, want, rtol=4e-7, atol=4e-7)
    else:
        assert torch.equal(got, want), (got - want).abs().max()


def hand_reference(quantized: nn.Module, original: nn.Module) -> nn.Module:
    """A copy of the unconverted ``original`` where every weight (slice) that ``quantized`` quantizes is
    replaced by a fresh TensorQuantizer of the same attributes applied to it (its own amax, as max
    calibration of a weight gives), written through the original's own layout."""
    ref = copy.deepcopy(original)
    modules = dict(ref.named_modules())
    with torch.no_grad():
        for name, qm in quantized.named_modules():
            if not isinstance(qm, QuantModule):
                continue
            for qname, tensors in type(qm).weight_groups(modules[name]):  # views into the reference's parameters
                q = getattr(qm, qname)
                members = list(q) if isinstance(q, GroupedQuantizer) else [q]
                for member, view in zip(members, tensors):
                    if member.is_enabled:
                        view.copy_(TensorQuantizer(member.attrs)(view.clone()))
    return ref


WEIGHT_PRESETS = {
    "int8-weight-only": ql.INT8_WEIGHT_ONLY_CFG,
    "int4-block-weight-only": ql.INT4_BLOCKWISE_WEIGHT_ONLY_CFG,
    "nvfp4-weight-only": {"quant_cfg": {**ql.NVFP4_DEFAULT_CFG["quant_cfg"], "*input_quantizer": {"enable": False}}, "algorithm": "max"},
}


@pytest.fixture(autouse=True)
def _plugin_sees_the_modeling_modules():
    hf.refresh()  # the plugin may have loaded before these modeling modules were imported


@pytest.mark.parametrize("preset", list(WEIGHT_PRESETS))
@pytest.mark.parametrize("family", list(FAMILIES))
def test_weight_preset_quantizes_every_expert_weight_as_by_hand(family, preset):
    original = tiny_model(family)
    model = ql.quantize(copy.deepcopy(original), WEIGHT_PRESETS[preset])
    experts = expert_modules(model)
    assert experts, family
    for name, m in experts:
        assert isinstance(m, QuantModule), f"{name}: {type(m).__name__} was not converted"
        for qname, tensors in m.weight_groups():
            members = list(getattr(m, qname))
            assert len(members) == len(tensors) == m.num_experts
            assert all(q.is_enabled for q in members), f"{name}.{qname}"
    assert model.quant_coverage.silent == {}, model.quant_coverage.silent
    ids = input_ids()
    with torch.no_grad():
        out = model(ids).logits
        expected = hand_reference(model, original)(ids).logits
    assert_loop_bits(out, expected, family)
    with torch.no_grad():
        assert not torch.equal(out, original(ids).logits)  # the weights did change


@pytest.mark.parametrize("family", list(FAMILIES))
def test_every_quantizer_off_reproduces_transformers_forward(family):
    original = tiny_model(family)
    model = ql.quantize(copy.deepcopy(original), {"quant_cfg": {"default": {"enable": False}}, "algorithm": None})
    assert all(isinstance(m, QuantModule) for _, m in expert_modules(model))
    ids = input_ids(seed=3)
    with torch.no_grad():
        assert torch.equal(model(ids).logits, original(ids).logits)


@pytest.mark.parametrize("family", ["gpt_oss", "llama4", "phimoe"])
def test_fp8_with_calibration_quantizes_expert_inputs(family):
    model = tiny_model(family)
    ql.quantize(model, ql.FP8_DEFAULT_CFG, lambda m: m(input_ids(seed=5)))
    for name, m in expert_modules(model):
        for qname in m.quantizer_names:
            if qname.endswith("input_quantizer"):
                q = getattr(m, qname)
                assert q.is_enabled and q.amax is not None and torch.isfinite(q.amax).all(), f"{name}.{qname}"
    with torch.no_grad():
        assert torch.isfinite(model(input_ids(seed=6)).logits).all()


def test_experts_whose_parameters_do_not_fit_their_flags_are_refused():
    model = tiny_model("deepseek_v2")
    experts = [m for _, m in expert_modules(model)][0]
    experts.has_bias = True  # declares biases it does not hold
    with pytest.raises(ValueError, match=r"DeepseekV2Experts: has_bias=True but gate_up_proj_bias is None"):
        ql.quantize(model, ql.INT8_WEIGHT_ONLY_CFG)


def test_ungated_experts_class_is_registered_with_up_proj():
    from transformers.models.nemotron_h import modeling_nemotron_h as nh

    hf.refresh()
    cfg = nh.NemotronHConfig(hidden_size=32, moe_intermediate_size=16, n_routed_experts=4, num_experts_per_tok=2, mlp_hidden_act="relu2")
    torch.manual_seed(0)
    experts = nh.NemotronHExperts(cfg)
    with torch.no_grad():
        for p in experts.parameters():
            p.normal_(0.0, 0.05)
    original = copy.deepcopy(experts)
    q = ql.quantize(experts, ql.INT8_WEIGHT_ONLY_CFG)
    assert q.quantizer_names[:2] == ("up_proj_input_quantizer", "up_proj_weight_quantizer")
    hidden = torch.randn(6, 32, generator=torch.Generator().manual_seed(1))
    idx = torch.tensor([[0, 1], [1, 2], [2, 3], [3, 0], [0, 2], [1, 3]])
    w = torch.full((6, 2), 0.5)
    with torch.no_grad():
        assert torch.equal(q(hidden, idx, w), hand_reference(q, original)(hidden, idx, w))


def test_unknown_fused_layout_is_reported_not_silent(caplog):
    from transformers.models.dbrx.modeling_dbrx import DbrxConfig, DbrxForCausalLM

    cfg = DbrxConfig(d_model=32, n_heads=4, n_layers=1, max_seq_len=64, vocab_size=64, ffn_config={"ffn_hidden_size": 16,
                                                                                                   "moe_num_experts": 4, "moe_top_k": 2},
                                                                                                   attn_config={"kv_n_heads": 2,
                                                                                                                "rope_theta": 10000.0})
    torch.manual_seed(0)
    model = DbrxForCausalLM(cfg).eval()
    with caplog.at_level(logging.WARNING, logger="quantlib"):
        ql.quantize(model, ql.INT8_WEIGHT_ONLY_CFG)
    cov = model.quant_coverage
    silent = [n for n in cov.silent if n.endswith("experts.mlp")]
    assert silent, cov.silent
    assert "stay unquantized" in caplog.text and silent[0] in caplog.text
    assert 0 < cov.silent_share < 1


def test_every_experts_class_transformers_declares_is_registered():
    """Every class of the installed transformers decorated with ``use_experts_implementation`` (73 in
    5.25) gets a quantized class once its modeling module is imported, with the projections its
    declared ``has_gate`` implies."""
    import importlib
    import pathlib
    import re

    from quantlib.nn import QuantModuleRegistry

    root = pathlib.Path(T.__file__).parent / "models"
    declared = []
    for f in sorted(root.glob("*/modeling_*.py")):
        for m in re.finditer(r"@use_experts_implementation(\([^)]*\))?\nclass (\w+)\(", f.read_text()):
            declared.append((f"transformers.models.{f.parent.name}.{f.stem}", m.group(2), "has_gate=False" not in (m.group(1) or "")))
    assert len(declared) >= 50
    hf.refresh()
    for module_name, class_name, gated in declared:
        cls = getattr(importlib.import_module(module_name), class_name)
        hf.refresh()
        assert QuantModuleRegistry.is_registered(cls), f"{module_name}.{class_name}"
        up = "gate_up_proj" if gated else "up_proj"
        assert QuantModuleRegistry.quantized_class(cls).projections == (up, "down_proj"), class_name


@pytest.mark.parametrize("family", ["gpt_oss", "llama4", "phimoe"])
def test_save_restore_into_a_fresh_model_gives_the_same_output(family, tmp_path):
    model = ql.quantize(tiny_model(family), ql.FP8_DEFAULT_CFG, lambda m: m(input_ids(seed=5)))
    ql.save(model, tmp_path / "q.pt")
    fresh = ql.restore(tiny_model(family), tmp_path / "q.pt")
    with torch.no_grad():
        assert torch.equal(fresh(input_ids(seed=6)).logits, model(input_ids(seed=6)).logits)


@pytest.mark.parametrize("family", ["gpt_oss", "llama4"])
def test_transposed_expert_slices_get_per_output_channel_amax(family):
    """GPT-OSS and Llama-4 store each slice (in, out): axis 0 of the config is the output channel."""
    model = ql.quantize(tiny_model(family), ql.INT8_WEIGHT_ONLY_CFG)
    for _, m in expert_modules(model):
        for proj in ("gate_up_proj", "down_proj"):
            stored = getattr(m, proj).detach()  # (E, in, out)
            for e in range(m.num_experts):
                amax = getattr(m, f"{proj}_weight_quantizer")[e].amax
                assert torch.equal(amax.flatten(), stored[e].abs().amax(dim=0)), f"{proj}[{e}]"
