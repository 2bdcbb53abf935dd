"""Export of tiny transformers models of many families: the checkpoint names are those of the family's
own ``save_pretrained``, transformers loads them with no missing or unexpected key and weights equal
to quantlib's fake-quantized ones (MXFP8), fused siblings carry one scale, and what no consumer can load
right is refused by name. Needs transformers and accelerate (test extras)."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("accelerate")
from safetensors.torch import load_file  # noqa: E402
from transformers import AutoModelForCausalLM  # noqa: E402

import quantlib as ql  # noqa: E402
from quantlib.export import ExportError, export_checkpoint  # noqa: E402
from tests.test_export import _families  # noqa: E402
from tests.test_export._consumers import fake_and_loaded  # noqa: E402
from tests.test_export._export_models import weight_only  # noqa: E402
from tests.test_export._families import FAMILIES, FAMILY_GROUPS, GROUPS, E, H, I, build, gpt2, tokens  # noqa: E402

MXFP8 = weight_only(ql.MXFP8_DEFAULT_CFG)
#: GPT-OSS's checkpoint keeps its experts fused and interleaved (3-D): no format carries them quantized
NO_EXPERTS = {"gpt_oss": "*experts*"}


def quantized(model, cfg, *, lm_head: bool = False, off: tuple[str, ...] = (), loop: bool = True):
    model = copy.deepcopy(model)
    ids = tokens(5)
    if lm_head:  # the presets leave lm_head unquantized: drop that rule
        cfg = {**cfg, "quant_cfg": {k: v for k, v in cfg["quant_cfg"].items() if k != "*lm_head*"}}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ql.quantize(model, cfg, (lambda m: m(ids)) if loop else None)
    if not lm_head:
        ql.disable_quantizer(model, "*lm_head*")
    for pattern in off:
        ql.disable_quantizer(model, pattern)
    return model


def _off(family: str) -> tuple[str, ...]:
    return (NO_EXPERTS[family],) if family in NO_EXPERTS else ()


@pytest.mark.parametrize("tie", [False, True])
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_names_are_save_pretrained_and_transformers_loads_them(tmp_path, family, tie):
    base = build(family, tie=tie)
    assert_loads_as_saved(base, quantized(base, MXFP8, off=_off(family)), tmp_path)


def assert_loads_as_saved(base, model, tmp_path, fmt: str = "hf_mxfp8", min_pairs: int = 4) -> None:
    """``model`` (``base`` quantized) exports MXFP8 (format ``fmt``) under the names of ``base.save_pretrained``, and
    transformers loads it with no key missing, unexpected or mismatched, every quantized weight (at least ``min_pairs``)
    equal to quantlib's fake quantization and the same logits."""
    base.save_pretrained(tmp_path / "ref")
    ref = set(load_file(tmp_path / "ref" / "model.safetensors"))
    export_checkpoint(model, tmp_path / "q", fmt)
    got = load_file(tmp_path / "q" / "model.safetensors")
    assert {k for k in got if not k.endswith(("weight_scale_inv", "weight_scale"))} == ref
    loaded, info = AutoModelForCausalLM.from_pretrained(tmp_path / "q", dtype=torch.float32, output_loading_info=True,
                                                        experts_implementation="eager")
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    pairs = fake_and_loaded(model, loaded)
    assert len(pairs) >= min_pairs
    for name, (fake, lw) in pairs.items():
        assert torch.equal(lw.float(), fake.float()), name
    with torch.no_grad():
        assert torch.equal(loaded(tokens()).logits, model(tokens()).logits)


@pytest.mark.parametrize("family", sorted(_families.MORE_FAMILIES))
def test_more_families_export_as_save_pretrained_names_them_and_load_to_the_same_logits(tmp_path, family):
    """Families the rest of the export tests do not walk: loaded as saved (:func:`assert_loads_as_saved`), or refused by
    name with nothing written."""
    if not _families.built_here(family):
        pytest.skip(f"this transformers has no {family} model")
    base = build(family)
    model = quantized(base, MXFP8)
    if family in _families.MORE_REFUSED:
        with pytest.raises(ExportError, match=_families.MORE_REFUSED[family]):
            export_checkpoint(model, tmp_path / "q", "hf_mxfp8")
        assert not (tmp_path / "q").exists()
        return
    assert_loads_as_saved(base, model, tmp_path)


@pytest.mark.parametrize("family, off, fmt", [
    ("param2moe", ("*self_attn*",), "hf_mxfp8"),  # q / k / v saved as one query_key_value, the router bias renamed
    ("sarvam_moe", ("*self_attn*",), "hf_mxfp8"),
    ("deepseek_v4", ("*self_attn*",), "hf_mxfp8"),  # hyper-connection bases renamed
    ("bailing_hybrid", ("*self_attn*",), "hf_mxfp8"),
    ("hy_v4", ("*indexer.weights_proj*", "*mlp.experts*"), "hf_mxfp8"),  # the head's hyper-connection renamed
    # 3-D experts unquantized: GraniteMoE's rearranged on save, Inkling-2's renamed (w2_weight) and its lm_head padded
    ("granitemoe", ("*experts*",), "hf_mxfp8"),
    ("granitemoeshared", ("*experts*",), "hf_mxfp8"),
    ("inkling2", ("*mlp.experts*", "*sconv*", "*conv1d*"), "hf_mxfp8"),
    ("inkling", ("*mlp.experts*", "*sconv*"), "hf_mxfp8"),
    ("zaya", ("*mlp.experts*", "*conv_qk*"), "hf_mxfp8"),
])  # fmt: skip
def test_tensors_saved_under_other_keys_load_as_saved(tmp_path, family, off, fmt):
    """Unquantized tensors that the family's save renames, concatenates, rearranges or pads are written as its save writes
    them (transformers' own conversion, on the real tensors), and the checkpoint loads as saved; what each family refuses
    quantized is off (MORE_REFUSED)."""
    if not _families.built_here(family):
        pytest.skip(f"this transformers has no {family}")
    base = build(family)
    assert_loads_as_saved(base, quantized(base, MXFP8, off=off), tmp_path, fmt, min_pairs=2)


def test_ergo_router_saved_transposed_loads_as_the_model_holds_it(tmp_path):
    """Ergo's save transposes its router weight (gate_kernel) and its shared experts' and names residual gates '.scale': in
    ct_mxfp8 the checkpoint has save_pretrained's keys and every unquantized tensor loads equal to the model's (transformers
    runs its compressed-tensors MXFP8 layers in bf16 beside fp32 experts on the CPU, so logits are not compared); hf_mxfp8
    is refused, its loader taking the .scale keys for block scales."""
    if not _families.built_here("ergo"):
        pytest.skip("this transformers has no ergo")
    base = build("ergo")
    model = quantized(base, MXFP8, off=("*shared_experts*", "*mlp.experts*"))
    base.save_pretrained(tmp_path / "ref")
    export_checkpoint(model, tmp_path / "q", "ct_mxfp8")
    got = load_file(tmp_path / "q" / "model.safetensors")
    assert {k for k in got if not k.endswith("weight_scale")} == set(load_file(tmp_path / "ref" / "model.safetensors"))
    loaded, info = AutoModelForCausalLM.from_pretrained(tmp_path / "q", dtype=torch.float32, output_loading_info=True,
                                                        experts_implementation="eager")
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    held = dict(loaded.named_parameters())
    plain = {k: p for k, p in base.named_parameters() if "self_attn.qkv_proj" not in k and "self_attn.o_proj" not in k}
    assert "model.layers.0.mlp.gate.linear.weight" in plain and len(plain) > 10
    for k, p in plain.items():
        assert torch.equal(held[k].float(), p.float()), k
    words = r"post_expert_norm.weight: written as layers.0.feed_forward.expert_output_norm.scale, but transformers. fine-grained"
    with pytest.raises(ExportError, match=words):
        export_checkpoint(model, tmp_path / "hf", "hf_mxfp8")
    assert not (tmp_path / "hf").exists()


@pytest.mark.parametrize("fmt, cfg", [("ct_nvfp4", ql.NVFP4_DEFAULT_CFG), ("modelopt_fp8", ql.FP8_DEFAULT_CFG)])
def test_linears_of_unknown_fusion_are_refused_where_siblings_share_a_scale(tmp_path, fmt, cfg):
    """Laguna's q / k / v / g_proj read one input under leaf names no layout knows: in MXFP8 (every scale a member's own)
    they export and load as saved (MORE_FAMILIES); where consumers fuse siblings under one global or per-tensor scale,
    quantlib cannot tell which to unify, so the export is refused by name, nothing written."""
    if not _families.built_here("laguna"):
        pytest.skip("this transformers has no Laguna")
    model = quantized(build("laguna"), cfg)
    words = r"cannot tell whether consumers fuse \['model.layers.0.self_attn.q_proj', .*'model.layers.0.self_attn.g_proj'\]"
    with pytest.raises(ExportError, match=words):
        export_checkpoint(model, tmp_path / "q", fmt)
    assert not (tmp_path / "q").exists()


def test_mixtral_experts_are_written_as_transformers_names_them(tmp_path):
    # transformers' Mixtral checkpoint holds block_sparse_moe.experts.{e}.w1 / w3 / w2 (and vLLM's loader reads those)
    from quantlib.export import TRANSFORMERS

    model = quantized(build("mixtral"), MXFP8)
    for out, layout in (("q", None), ("by_hand", TRANSFORMERS)):  # a layout passed by hand keeps transformers' names
        export_checkpoint(model, tmp_path / out, "hf_mxfp8", layout=layout)
        keys = set(load_file(tmp_path / out / "model.safetensors"))
        assert {f"model.layers.0.block_sparse_moe.experts.3.{w}.weight" for w in ("w1", "w2", "w3")} <= keys
        assert "model.layers.0.block_sparse_moe.gate.weight" in keys and not any("mlp.experts" in k for k in keys)


def test_mixtral_stacked_experts_carry_the_checkpoint_module_name():
    # vLLM's Mixtral holds its FusedMoE at block_sparse_moe.experts: weight sync names the stacked w13 / w2 there
    from quantlib.export import iter_packed

    experts = [pw for pw in iter_packed(quantized(build("mixtral"), MXFP8), "hf_mxfp8", experts="stacked") if pw.role == "expert"]
    assert {(pw.name, pw.shard) for pw in experts} == {("model.layers.0.block_sparse_moe.experts", "w1"),
                                                       ("model.layers.0.block_sparse_moe.experts", "w3"),
                                                     ("model.layers.0.block_sparse_moe.experts", "w2")}  # fmt: skip
    assert tuple(next(pw for pw in experts if pw.shard == "w1").tensors["w13_weight"].shape) == (E, I, H)




@pytest.mark.parametrize("fmt,cfg,key", [("modelopt_fp8", ql.FP8_DEFAULT_CFG, "weight_scale"), ("modelopt_nvfp4", ql.W4A16_NVFP4_CFG,
                                                                                                "weight_scale_2")])
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_fused_siblings_carry_one_scale(tmp_path, family, fmt, cfg, key):
    model = quantized(build(family), cfg, off=_off(family))
    groups = [GROUPS[g] for g in FAMILY_GROUPS[family]]
    for parent, leaves in groups:  # calibrated apart, the siblings' amaxes differ
        amaxes = {float(model.get_submodule(parent.format(leaf)).weight_quantizer.amax) for leaf in leaves}
        assert len(amaxes) == len(leaves), (parent, amaxes)
    with pytest.raises(ExportError, match="siblings .* need one global amax"):
        export_checkpoint(model, tmp_path / "refused", fmt)
    export_checkpoint(model, tmp_path / "q", fmt, unify_siblings=True)
    sd = load_file(tmp_path / "q" / "model.safetensors")
    for parent, leaves in groups:
        scales = [sd[f"{parent.format(leaf)}.{key}"] for leaf in leaves]
        assert all(torch.equal(s, scales[0]) for s in scales), (parent, scales)


@pytest.mark.parametrize("family,member", [("llama", "model.layers.0.self_attn.v_proj"), ("mixtral", "model.layers.0.self_attn.k_proj"),
                                           ("deepseek_v3", "model.layers.0.self_attn.kv_a_proj_with_mqa"),
                                           ("qwen2_moe", "model.layers.0.mlp.shared_expert.up_proj")])  # fmt: skip
def test_partly_quantized_fused_group_is_refused(tmp_path, family, member):
    model = quantized(build(family), MXFP8, off=(f"{member}.*",))
    with pytest.raises(ExportError,
                       match=rf"{member}: not quantized \(its weight quantizer is off, or it has none\) but its fused siblings"):
        export_checkpoint(model, tmp_path / "q", "hf_mxfp8")


@pytest.mark.parametrize("family", ["llama", "gemma"])
def test_quantized_tied_lm_head_is_refused(tmp_path, family):
    model = quantized(build(family, tie=True), MXFP8, lm_head=True)
    with pytest.raises(ExportError, match=r"lm_head.weight_quantizer is enabled but lm_head.weight is tied to model.embed_tokens.weight"):
        export_checkpoint(model, tmp_path / "q", "hf_mxfp8")


def test_gpt2_conv1d_and_its_tied_head(tmp_path):
    # GPT-2's Conv1D stores its weight (in, out): transformers' MXFP8 (hf_mxfp8) has no consumer that reads it (vLLM reads
    # ct_mxfp8 / modelopt_mxfp8, test_family_matrix.py::test_gpt2_conv1d_as_consumers_read_it), and that is said by name
    with pytest.raises(ExportError, match=r"transformer.h.0.attn.c_attn.weight_quantizer: transformer.h.0.attn.c_attn stores its weight "
                                          r"\(in, out\) \(GPT-2's Conv1D\), and format hf_mxfp8 reaches no consumer"):
        export_checkpoint(quantized(gpt2(), MXFP8), tmp_path / "q", "hf_mxfp8")
    with pytest.raises(ExportError, match=r"lm_head.weight_quantizer is enabled but lm_head.weight is tied to transformer.wte.weight"):
        export_checkpoint(quantized(gpt2(), MXFP8, lm_head=True, off=("*c_attn*", "*c_proj*", "*c_fc*")), tmp_path / "q2", "hf_mxfp8")


def test_gpt_oss_quantized_experts_are_refused(tmp_path):
    # transformers keeps GPT-OSS's gate_up_proj fused with gate / up interleaved: halves would be wrong rows
    with pytest.raises(ExportError, match=r"model.layers.0.mlp.experts.gate_up_proj_weight_quantizer: .* keeps "
                                          r"model.layers.0.mlp.experts.gate_up_proj as one 3-D"):
        export_checkpoint(quantized(build("gpt_oss"), MXFP8), tmp_path / "q", "hf_mxfp8")


def test_nvfp4_w4a4_without_forward_loop_is_refused(tmp_path):
    model = quantized(build("qwen2"), ql.NVFP4_DEFAULT_CFG, loop=False)
    with pytest.raises(ExportError, match=r"model.layers.0.self_attn.q_proj.input_quantizer: NVFP4 .* input without an amax"):
        export_checkpoint(model, tmp_path / "q", "modelopt_nvfp4")


def test_register_layout_names_a_family(tmp_path, monkeypatch):
    # (BERT's query / key / value are vLLM's qkv_proj: known without it; unknown names: tests/test_export/test_structure.py)
    from transformers import BertConfig, BertModel

    from quantlib.export import LAYOUTS, ModelLayout, register_layout

    torch.manual_seed(0)
    bert = BertModel(BertConfig(vocab_size=V_BERT, hidden_size=64, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64,
                                max_position_embeddings=16)).eval()
    ids = torch.randint(0, V_BERT, (2, 8), generator=torch.Generator().manual_seed(1))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ql.quantize(bert, ql.FP8_DEFAULT_CFG, lambda m: m(ids))
    monkeypatch.setitem(LAYOUTS, "bert", LAYOUTS.get("bert"))  # restored after the test
    register_layout("bert", ModelLayout("bert", siblings=(("query", "key", "value"),), shards={"query": "q", "key": "k", "value": "v"}))
    export_checkpoint(bert, tmp_path / "q", "modelopt_fp8", unify_siblings=True)
    sd = load_file(tmp_path / "q" / "model.safetensors")
    scales = [sd[f"encoder.layer.0.attention.self.{leaf}.weight_scale"] for leaf in ("query", "key", "value")]
    assert all(torch.equal(s, scales[0]) for s in scales)


V_BERT = 64


def test_share_sibling_amax_covers_mla_and_shared_experts(tmp_path):
    # DeepSeek-V3: MLA's q_a_proj / kv_a_proj_with_mqa (vLLM's fused_qkv_a_proj) and the shared experts' gate / up
    from quantlib.export import share_sibling_amax

    model = quantized(build("deepseek_v3"), ql.FP8_DEFAULT_CFG)
    changed = share_sibling_amax(model)
    assert set(changed) == {("model.layers.0.self_attn.q_a_proj", "model.layers.0.self_attn.kv_a_proj_with_mqa"),
                            ("model.layers.0.mlp.shared_experts.gate_proj", "model.layers.0.mlp.shared_experts.up_proj")}  # fmt: skip
    export_checkpoint(model, tmp_path / "q", "modelopt_fp8")  # no unify needed: the evaluated model is the exported one


def test_group_member_never_converted_is_refused(tmp_path):
    # v_proj left a plain nn.Linear (excluded from conversion) is as unquantized as a disabled one
    model = quantized(build("mistral"), MXFP8)
    attn = model.model.layers[0].self_attn
    plain = torch.nn.Linear(attn.v_proj.in_features, attn.v_proj.out_features, bias=False)
    plain.weight = attn.v_proj.weight
    attn.v_proj = plain
    with pytest.raises(ExportError, match=r"model.layers.0.self_attn.v_proj: not quantized .* but its fused siblings"):
        export_checkpoint(model, tmp_path / "q", "hf_mxfp8")


def test_gated_deltanet_b_a_and_every_layers_shared_expert_carry_one_scale(tmp_path):
    # the presets leave Qwen3.5's in_proj_b / in_proj_a unquantized, so no other test exports them: quantized, they are vLLM's
    # in_proj_ba (one GEMM, one scale), as layer 1's shared expert gate / up are its gate_up_proj
    cfg = {**ql.FP8_DEFAULT_CFG, "quant_cfg": {k: v for k, v in ql.FP8_DEFAULT_CFG["quant_cfg"].items() if "in_proj" not in k}}
    model = quantized(build("qwen3_5_moe"), cfg)
    groups = [("model.layers.0.linear_attn.{}", ("in_proj_b", "in_proj_a")),
              ("model.layers.1.mlp.shared_expert.{}", ("gate_proj", "up_proj"))]
    assert model.get_submodule("model.layers.0.linear_attn.in_proj_b").weight_quantizer.is_enabled
    with pytest.raises(ExportError, match=r"siblings .* need one global amax"):
        export_checkpoint(model, tmp_path / "refused", "modelopt_fp8")
    man = export_checkpoint(model, tmp_path / "q", "modelopt_fp8", unify_siblings=True)
    assert {tuple(p.format(leaf) for leaf in leaves) for p, leaves in groups} <= set(man.unified_siblings)  # they differed
    sd = load_file(tmp_path / "q" / "model.safetensors")
    for parent, leaves in groups:
        for key in ("weight_scale", "input_scale"):
            scales = [sd[f"{parent.format(leaf)}.{key}"] for leaf in leaves]
            assert all(torch.equal(s, scales[0]) for s in scales), (parent, key, scales)


def test_llama4_exports_with_its_experts_left_unquantized(tmp_path):
    """Llama-4's quantized experts are refused (MORE_REFUSED); with their quantizers off the rest exports quantized and
    loads as saved."""
    if not _families.built_here("llama4_text"):
        pytest.skip("this transformers has no Llama-4")
    base = build("llama4_text")
    assert_loads_as_saved(base, quantized(base, MXFP8, off=("*feed_forward.experts*",)), tmp_path)


@pytest.mark.parametrize("family", ["deepseek_v32", "glm_moe_dsa"])
def test_sparse_attention_indexer_exports_with_weights_proj_unquantized(tmp_path, family):
    """vLLM runs the DSA indexer's wk and weights_proj as one unquantized GEMM and dequantizes wk from E4M3 codes only:
    with weights_proj off the model exports (wk MXFP8 or FP8 128x128) and loads as saved; a wk in INT4 is refused by
    name, nothing written (MORE_REFUSED: weights_proj quantized)."""
    if not _families.built_here(family):
        pytest.skip(f"this transformers has no {family}")
    base = build(family)
    off = ("*indexer.weights_proj*",)
    assert_loads_as_saved(base, quantized(base, MXFP8, off=off), tmp_path)
    fp8 = quantized(base, weight_only(ql.FP8_2D_BLOCKWISE_WEIGHT_ONLY_CFG), off=off)
    export_checkpoint(fp8, tmp_path / "fp8", "hf_fp8_block")
    assert load_file(tmp_path / "fp8" / "model.safetensors")["model.layers.0.self_attn.indexer.wk.weight"].dtype == torch.float8_e4m3fn
    int4 = quantized(base, ql.INT4_BLOCKWISE_WEIGHT_ONLY_CFG, off=off)
    with pytest.raises(ExportError, match=r"indexer.wk.weight_quantizer is enabled \(int\), .* dequantized from E4M3 codes"):
        export_checkpoint(int4, tmp_path / "int4", "ct_int_pack")
    assert not (tmp_path / "int4").exists()


@pytest.mark.parametrize("family", ["mamba", "falcon_mamba", "jamba_mamba"])
def test_mamba_exports_with_dt_proj_unquantized(tmp_path, family):
    """Mamba-1's mixer reads dt_proj.weight directly, so the model computes it unquantized whatever its quantizer says: a
    quantized dt_proj is refused (MORE_REFUSED); off, the model exports and loads as saved, to the same logits."""
    if not _families.built_here(family):
        pytest.skip(f"this transformers has no {family}")
    base = build(family)
    off = ("*dt_proj*", "*mamba.conv1d*")  # Jamba's Mamba convolution is mamba.conv1d, which no preset rule names
    assert_loads_as_saved(base, quantized(base, MXFP8, off=off), tmp_path)


def test_bloom_with_sliced_tensor_parallel_exports_its_output_projections_unquantized(tmp_path):
    """BLOOM with pretraining_tp > 1 and slow_but_exact multiplies by slices of its output projections' weights (not through
    their forward): quantized, they are refused by name, nothing written; off, the model loads as saved."""
    base = build("bloom", pretraining_tp=2, slow_but_exact=True)
    with pytest.raises(ExportError, match=r"self_attention.dense.weight_quantizer is enabled, but BloomAttention reads dense.weight"):
        export_checkpoint(quantized(base, MXFP8), tmp_path / "q", "hf_mxfp8")
    assert not (tmp_path / "q").exists()
    assert_loads_as_saved(base, quantized(base, MXFP8, off=("*self_attention.dense*", "*dense_4h_to_h*")), tmp_path, min_pairs=2)


def test_longcat_router_read_in_fp32_is_refused_quantized(tmp_path):
    """LongCat-Flash's router multiplies by its classifier's weight cast to fp32 (not through the classifier's forward): with
    the presets' ``*router*`` rule dropped, its quantized classifier is refused by name, nothing written."""
    if not _families.built_here("longcat_flash"):
        pytest.skip("this transformers has no LongCat-Flash")
    cfg = {**MXFP8, "quant_cfg": {k: v for k, v in MXFP8["quant_cfg"].items() if k != "*router*"}}
    model = quantized(build("longcat_flash"), cfg)
    with pytest.raises(ExportError, match=r"mlp.router.classifier.weight_quantizer is enabled, but LongcatFlashTopkRouter reads"):
        export_checkpoint(model, tmp_path / "q", "hf_mxfp8")
    assert not (tmp_path / "q").exists()
