"""Fused siblings found from the structure: one probe forward records which linears read the very same input
(as ModelOpt's exporter groups them), reconciled with vLLM's packed modules (qkv_proj, gate_up_proj,
fused_qkv_a_proj, w13, BERT's query/key/value) and with layouts; the probe leaves the model and its quantizers
exactly as they were."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

pytest.importorskip("transformers")
from safetensors.torch import load_file  # noqa: E402

import quantlib as ql  # noqa: E402
from quantlib.export import ExportError, ModelLayout, export_checkpoint, layout_for, structural_layout  # noqa: E402
from quantlib.export.structure import shared_inputs  # noqa: E402
from quantlib.kv.presets import FP8_KV_CFG, merge_kv_config  # noqa: E402
from quantlib.nn.tensor_quantizer import TensorQuantizer  # noqa: E402
from tests.test_export._export_models import weight_only  # noqa: E402
from tests.test_export._families import FAMILIES, build, tokens  # noqa: E402
from tests.test_export.test_families import FAMILY_GROUPS, GROUPS  # noqa: E402


def _quantize(model: nn.Module, loop) -> nn.Module:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ql.quantize(model, ql.FP8_DEFAULT_CFG, loop)
    return model


def _fused(layout: ModelLayout) -> set[tuple[str, tuple[str, ...]]]:
    return {(n.rpartition(".")[0], g) for n, g in layout.structure.fused.items()}


def _state(model: nn.Module) -> dict:
    """Everything a probe could change: tensors, quantizer switches / generations / calibrators, training flags."""
    quantizers = {n: (q.generation, q._disabled, q._if_calib, q._if_quant, q.num_calib_batches, q._calibrator.compute_amax())
                  for n, q in model.named_modules() if isinstance(q, TensorQuantizer)}
    return {"tensors": {k: v.clone() for k, v in model.state_dict().items()}, "quantizers": quantizers,
            "training": [m.training for m in model.modules()], "use_cache": getattr(getattr(model, "config", None), "use_cache", None)}


def _same(a: dict, b: dict) -> None:
    assert a["tensors"].keys() == b["tensors"].keys()
    assert all(torch.equal(a["tensors"][k], b["tensors"][k]) for k in a["tensors"])
    assert a["quantizers"].keys() == b["quantizers"].keys()
    for k, (qa, qb) in ((k, (a["quantizers"][k], b["quantizers"][k])) for k in a["quantizers"]):
        assert qa[:5] == qb[:5], k
        assert (qa[5] is None) == (qb[5] is None) and (qa[5] is None or torch.equal(qa[5], qb[5])), k
    assert a["training"] == b["training"] and a["use_cache"] == b["use_cache"]


#: groups the probe finds beyond those whose scales the family tests check (their table names layer 0's quantized groups only)
UNCHECKED = {"qwen3_5_moe": {("model.layers.0.linear_attn", ("in_proj_b", "in_proj_a")),
                             ("model.layers.1.mlp.shared_expert", ("gate_proj", "up_proj"))}}


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_structural_groups_are_vllms_packed_groups(family):
    model = _quantize(build(family), lambda m: m(tokens(5)))
    before = _state(model)
    layout = layout_for(model)
    _same(before, _state(model))
    expected = {(GROUPS[g][0].format("x").rpartition(".")[0], GROUPS[g][1]) for g in FAMILY_GROUPS[family]} | UNCHECKED.get(family, set())
    assert _fused(layout) == expected
    assert layout.structure.unknown == ()
    # what the probe saw: every group of linears reading one input of two or more members holds those of vLLM's
    raw = [g for g in shared_inputs(model) if len(g) > 1]
    # (Qwen3.5's in_proj_qkv / z / b / a read one input: vLLM packs them as two pairs, the layout splits them)
    seen = {tuple(n.rpartition(".")[2] for n in g if n.rpartition(".")[0] == p) for p, _ in expected for g in raw} - {()}
    assert all(any(set(leaves) <= set(s) for s in seen) for _, leaves in expected)
    assert all(set(s) == set().union(*(leaves for _, leaves in expected if set(leaves) <= set(s))) for s in seen)


def test_probe_in_calibration_mode_and_training_changes_nothing():
    """Quantizers collecting statistics (calibration under way, KV-cache quantizers too), a model in train mode
    with its KV cache on: the probe collects nothing, quantizes nothing, and leaves every switch and flag as it was."""
    model = build("qwen2_moe")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ql.quantize(model, merge_kv_config(ql.FP8_DEFAULT_CFG, FP8_KV_CFG), lambda m: m(tokens(5)))
    model.train()
    model.config.use_cache = True
    for q in (m for m in model.modules() if isinstance(m, TensorQuantizer)):
        q.enable_calib()
    before = _state(model)
    groups = shared_inputs(model)
    assert ("model.layers.0.self_attn.q_proj", "model.layers.0.self_attn.k_proj", "model.layers.0.self_attn.v_proj") in groups
    _same(before, _state(model))


def test_probe_runs_once_per_model(tmp_path):
    model = _quantize(build("llama"), lambda m: m(tokens(5)))
    calls = []
    model.register_forward_pre_hook(lambda *a: calls.append(1))
    layout_for(model)
    layout_for(model)
    export_checkpoint(model, tmp_path / "q", "modelopt_fp8", unify_siblings=True)
    assert len(calls) == 1


def _bert():
    from transformers import BertConfig, BertModel

    torch.manual_seed(0)
    bert = BertModel(BertConfig(vocab_size=64, hidden_size=64, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64,
                                max_position_embeddings=16)).eval()
    ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(1))
    return _quantize(bert, lambda m: m(ids))


def test_bert_query_key_value_found_without_register_layout(tmp_path):
    """vLLM's BERT / RoBERTa fuse query / key / value into qkv_proj: found by the probe, one scale, no layout
    to register (before: refused as an unknown family)."""
    bert = _bert()
    layout = layout_for(bert)
    assert _fused(layout) == {("encoder.layer.0.attention.self", ("query", "key", "value"))}
    with pytest.raises(ExportError, match="siblings .*query.* need one global amax"):
        export_checkpoint(bert, tmp_path / "refused", "modelopt_fp8")
    export_checkpoint(bert, tmp_path / "q", "modelopt_fp8", unify_siblings=True)
    sd = load_file(tmp_path / "q" / "model.safetensors")
    scales = [sd[f"encoder.layer.0.attention.self.{leaf}.weight_scale"] for leaf in ("query", "key", "value")]
    assert all(torch.equal(s, scales[0]) for s in scales)
    assert not torch.equal(sd["encoder.layer.0.intermediate.dense.weight_scale"], scales[0])


class Attention(nn.Module):
    """q / k / v on one input (self-attention) or q on ``x`` and k / v on ``memory`` (cross-attention)."""

    def __init__(self, names=("q_proj", "k_proj", "v_proj"), cross: bool = False) -> None:
        super().__init__()
        self.names, self.cross = names, cross
        for i, n in enumerate(names):
            self.add_module(n, nn.Linear(32, 32, bias=False))
            with torch.no_grad():
                getattr(self, n).weight.mul_(1 + i)
        self.o_proj = nn.Linear(32, 32, bias=False)

    def forward(self, x: torch.Tensor, memory: torch.Tensor = None) -> torch.Tensor:
        q, k, v = (getattr(self, n) for n in self.names)
        kv = memory if self.cross else x
        return self.o_proj(q(x) * k(kv) + v(kv))


class Block(nn.Module):
    def __init__(self, **kw) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(32)
        self.attn = Attention(**kw)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm(x)
        return x + self.attn(h, memory=x * 2)


X = torch.randn(2, 4, 32, generator=torch.Generator().manual_seed(0))


def test_own_module_siblings_found_structurally(tmp_path):
    model = _quantize(Block(), lambda m: m(X))
    before = _state(model)
    layout = structural_layout(model, lambda m: m(X[:1, :2]))
    _same(before, _state(model))
    assert _fused(layout) == {("attn", ("q_proj", "k_proj", "v_proj"))}
    assert layout_for(model).structure is None  # no transformers model: no input to guess, nothing probed
    export_checkpoint(model, tmp_path / "q", "modelopt_fp8", layout=layout, unify_siblings=True)
    sd = load_file(tmp_path / "q" / "model.safetensors")
    assert torch.equal(sd["attn.q_proj.weight_scale"], sd["attn.v_proj.weight_scale"])
    assert torch.equal(sd["attn.k_proj.weight_scale"], sd["attn.v_proj.weight_scale"])
    assert not torch.equal(sd["attn.o_proj.weight_scale"], sd["attn.v_proj.weight_scale"])


def test_declared_group_the_structure_contradicts_is_refused(tmp_path):
    """Cross-attention: q reads the decoder's states, k / v the memory; a layout fusing q / k / v (vLLM's
    names, or a user's) is refused naming the group and what the probe found."""
    model = _quantize(Block(cross=True), lambda m: m(X))
    with pytest.raises(ExportError, match=r"declares \('q_proj', 'k_proj', 'v_proj'\) one fused GEMM.*\['attn.q_proj'\] and "
                                          r"\['attn.k_proj', 'attn.v_proj'\] reading different inputs"):
        structural_layout(model, lambda m: m(X[:1, :2]))
    layout = ModelLayout("mine", siblings=(("k_proj", "v_proj"),))
    found = structural_layout(model, lambda m: m(X[:1, :2]), layout)
    assert _fused(found) == {("attn", ("k_proj", "v_proj"))}
    export_checkpoint(model, tmp_path / "q", "modelopt_fp8", layout=found, unify_siblings=True)
    sd = load_file(tmp_path / "q" / "model.safetensors")
    assert torch.equal(sd["attn.k_proj.weight_scale"], sd["attn.v_proj.weight_scale"])
    assert not torch.equal(sd["attn.q_proj.weight_scale"], sd["attn.v_proj.weight_scale"])


def test_unknown_names_reading_one_input_are_refused_with_register_layout(tmp_path):
    model = _quantize(Block(names=("a", "b", "c")), lambda m: m(X))
    layout = structural_layout(model, lambda m: m(X[:1, :2]))
    assert layout.structure.unknown == (("attn.a", "attn.b", "attn.c"),)
    with pytest.raises(ExportError, match=r"cannot tell whether consumers fuse \['attn.a', 'attn.b', 'attn.c'\] \(they read one input in "
                                          r"the probe forward.*register_layout"):
        export_checkpoint(model, tmp_path / "q", "modelopt_fp8", layout=layout)
    ql.disable_quantizer(model, "*attn.b*")
    ql.disable_quantizer(model, "*attn.c*")
    export_checkpoint(model, tmp_path / "one", "modelopt_fp8", layout=layout)  # one quantized: nothing to share


def test_t5_is_refused_by_name_then_a_registered_layout_is_checked(tmp_path, monkeypatch):
    """T5: self-attention q / k / v and gated wi_0 / wi_1 read one input under names vLLM has no packing for;
    its cross-attention's q reads another input than k / v."""
    from transformers import T5Config, T5ForConditionalGeneration

    from quantlib.export import LAYOUTS, register_layout

    torch.manual_seed(0)
    t5 = T5ForConditionalGeneration(T5Config(vocab_size=64, d_model=32, d_kv=16, d_ff=64, num_layers=1, num_heads=2,
                                             feed_forward_proj="gated-gelu")).eval()
    ids = torch.randint(0, 64, (1, 6), generator=torch.Generator().manual_seed(1))
    _quantize(t5, lambda m: m(input_ids=ids, decoder_input_ids=ids))
    ql.disable_quantizer(t5, "*lm_head*")
    with pytest.raises(ExportError, match=r"cannot tell whether consumers fuse \['encoder.block.0.layer.0.SelfAttention.q', "
                                          r"'encoder.block.0.layer.0.SelfAttention.k', 'encoder.block.0.layer.0.SelfAttention.v'\]"
                                          r".*register_layout"):
        export_checkpoint(t5, tmp_path / "refused", "modelopt_fp8", unify_siblings=True)
    monkeypatch.setitem(LAYOUTS, "t5", LAYOUTS.get("t5"))  # restored after the test
    register_layout("t5", ModelLayout("t5", siblings=(("q", "k", "v"), ("wi_0", "wi_1"))))
    with pytest.raises(ExportError, match=r"layout t5 declares \('q', 'k', 'v'\).*\['decoder.block.0.layer.1.EncDecAttention.q'\] and "
                                          r"\['decoder.block.0.layer.1.EncDecAttention.k', 'decoder.block.0.layer.1.EncDecAttention.v'\]"):
        export_checkpoint(t5, tmp_path / "contradicted", "modelopt_fp8", unify_siblings=True)


def test_meta_model_is_not_probed():
    """Offloaded layer-by-layer calibration leaves layers on meta: no forward, the names-only layout."""
    with torch.device("meta"):
        model = build("llama")
    assert shared_inputs(model) is None
    assert layout_for(model).structure is None
    assert layout_for(model).group_of("model.layers.0.self_attn.q_proj", "q_proj") == ("q_proj", "k_proj", "v_proj")
    with pytest.raises(ExportError, match="meta device: the structure probe needs the model in memory"):
        structural_layout(model, lambda m: m(tokens()))


def test_a_failing_probe_is_refused_by_name():
    model = _quantize(Block(), lambda m: m(X))
    before = _state(model)
    with pytest.raises(ExportError, match=r"Block: the structure probe .* failed: RuntimeError.*structural_layout"):
        structural_layout(model, lambda m: m(torch.zeros(1, 2, 7)))
    _same(before, _state(model))


def test_gpt2_conv1d_has_no_siblings():
    """GPT-2's Conv1D c_attn is q/k/v fused already: each linear reads its own input, nothing to share."""
    from tests.test_export._families import gpt2

    model = _quantize(gpt2(tie=False), lambda m: m(tokens(5)))
    layout = layout_for(model)
    assert "transformer.h.0.attn.c_attn" in layout.structure.seen
    assert layout.structure.fused == {} and layout.structure.unknown == ()


class Experts(nn.Module):
    """Per-expert linears; the probe's tokens all go to expert 0, so expert 1 is never reached."""

    def __init__(self) -> None:
        super().__init__()
        self.experts = nn.ModuleList(nn.ModuleDict({n: nn.Linear(32, 16, bias=False) for n in ("gate_proj", "up_proj")}) for _ in range(2))
        for i, p in enumerate(self.parameters()):
            with torch.no_grad():
                p.mul_(1 + i)
        self.route_to = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        e = self.experts[self.route_to]
        return e["gate_proj"](x) * e["up_proj"](x)


def test_experts_the_probe_does_not_reach_keep_their_names():
    from quantlib.export import share_sibling_amax

    model = Experts()
    _quantize(model, lambda m: [setattr(m, "route_to", e) or m(X) for e in (0, 1)])
    model.route_to = 0
    layout = structural_layout(model, lambda m: m(X[:1, :2]))
    assert layout.structure.seen == {"experts.0.gate_proj", "experts.0.up_proj"}
    assert layout.group_of("experts.1.up_proj", "up_proj") == ("gate_proj", "up_proj")  # by vLLM's names
    assert set(share_sibling_amax(model, layout)) == {("experts.0.gate_proj", "experts.0.up_proj"),
                                                      ("experts.1.gate_proj", "experts.1.up_proj")}


@pytest.mark.parametrize("how", ["linear", "slice", "cast"])
def test_a_weight_computed_with_outside_its_linear_is_refused_whatever_the_class(tmp_path, how):
    """The probe watches every linear's weight: an MLP (no class any table names) that multiplies by down_proj's weight
    itself, slices it or casts it runs down_proj unquantized, so its quantizer is refused by name, nothing written; off,
    the model exports. Tied heads (the embedding's forward reads the same tensor) are no such read (test_families' tie)."""
    model = build("llama", seed=2)
    mlp = model.model.layers[0].mlp
    ops = {"linear": lambda h, w: nn.functional.linear(h, w),
           "slice": lambda h, w: h[..., :16] @ w[:, :16].t() + h[..., 16:] @ w[:, 16:].t(),
           "cast": lambda h, w: (h.float() @ w.float().t()).to(h.dtype)}

    def forward(x):
        return ops[how](mlp.act_fn(mlp.gate_proj(x)) * mlp.up_proj(x), mlp.down_proj.weight)

    mlp.forward = forward
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ql.quantize(model, weight_only(ql.MXFP8_DEFAULT_CFG), lambda m: m(tokens()))  # dynamic: nothing to calibrate says so
    with pytest.raises(ExportError, match=r"model.layers.0.mlp.down_proj.weight_quantizer is enabled, but model.layers.0.mlp computes "
                                          r"with model.layers.0.mlp.down_proj.weight outside model.layers.0.mlp.down_proj's forward"):
        export_checkpoint(model, tmp_path / "q", "hf_mxfp8")
    assert not (tmp_path / "q").exists()
    ql.disable_quantizer(model, "*mlp.down_proj*")
    export_checkpoint(model, tmp_path / "q", "hf_mxfp8")
