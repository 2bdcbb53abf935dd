"""Every family x every weight format: the export read back by the format's own consumer (transformers
``from_pretrained`` for the HF formats; compressed-tensors' decompressors and ModelOpt's qtensors for theirs, their
dense weights then loaded by transformers; for dense families also transformers' own compressed-tensors path) holds
``weight_quantizer(weight)`` for every linear and every expert (bit for bit; compressed-tensors NVFP4 after bf16; INT
within 1 ulp), under the names of the family's own ``save_pretrained``, with the fake-quantized model's logits
(weight-only recipes, bit-exact formats); fused siblings carry one per-tensor / global scale. What a format cannot
carry for a family is refused by name, and the rest of the model then exports. Each (family, recipe) is calibrated
once. Needs transformers, accelerate, compressed-tensors and nvidia-modelopt (test extras)."""

from __future__ import annotations

import copy
import json
import re
import warnings
from typing import Optional

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("accelerate")
pytest.importorskip("compressed_tensors")
with warnings.catch_warnings():
    warnings.simplefilter("ignore")  # "transformers X is not tested with this modelopt"
    pytest.importorskip("modelopt.torch.quantization.qtensor")

import quantlib as ql  # noqa: E402
from quantlib.export import ExportError, export_checkpoint, share_sibling_amax  # noqa: E402
from tests.test_export._consumers import (  # noqa: E402
    RULES,
    SHARED_SCALE,
    consumer_model,
    consumer_weight,
    dense_keys,
    exported_modules,
    fake_weights,
    mismatches,
    quantized_names,
    save_pretrained_shapes,
)
from tests.test_export._export_models import weight_only  # noqa: E402
from tests.test_export._families import (  # noqa: E402
    FAMILIES,
    FAMILY_GROUPS as _GROUPS,
    GROUPS,
    MORE_FAMILIES,
    MORE_GROUPS,
    build,
    built_here,
    gpt2,
    is_moe,
    tokens,
)

_FP8_POW2 = weight_only(ql.FP8_2D_BLOCKWISE_WEIGHT_ONLY_CFG)
_FP8_POW2["quant_cfg"]["*weight_quantizer"] = {**_FP8_POW2["quant_cfg"]["*weight_quantizer"], "pow2_scale": True}
_W4A8_MAX = {**ql.W4A8_AWQ_BETA_CFG, "algorithm": "max"}  # AWQ's own export is tested in test_fold / test_modelopt_w4a8
#: mixed precision as vLLM / SGLang serve large MoE models: NVFP4 MLP and experts (the presets' routers and gates stay off), FP8
#: 128x128 attention
_MIXED = weight_only(ql.NVFP4_DEFAULT_CFG)
_MIXED["quant_cfg"]["*self_attn*weight_quantizer"] = {"num_bits": (4, 3), "block_sizes": {-1: 128, -2: 128}}
#: recipe -> (config, whether it quantizes activations); weight-only recipes keep the presets' rules (routers, gates off)
RECIPES = {
    "fp8_block": (weight_only(ql.FP8_2D_BLOCKWISE_WEIGHT_ONLY_CFG), False),
    "fp8_block_pow2": (_FP8_POW2, False),
    "mxfp8": (weight_only(ql.MXFP8_DEFAULT_CFG), False),
    "mxfp4": (weight_only(ql.MXFP4_DEFAULT_CFG), False),
    "nvfp4": (weight_only(ql.NVFP4_DEFAULT_CFG), False),
    "int4": (ql.INT4_BLOCKWISE_WEIGHT_ONLY_CFG, False),
    "int8": (ql.INT8_WEIGHT_ONLY_CFG, False),
    "fp8": (ql.FP8_DEFAULT_CFG, True),
    "w4a8": (_W4A8_MAX, True),
    "mixed": (_MIXED, False),
}
#: format -> the recipe it carries
FORMATS = {
    "hf_fp8_block": "fp8_block", "hf_fp8_block_ue8m0": "fp8_block_pow2", "hf_mxfp8": "mxfp8", "ct_fp8_block": "fp8_block",
    "ct_mxfp8": "mxfp8", "ct_mxfp4": "mxfp4", "ct_nvfp4": "nvfp4", "ct_int_pack": "int4", "ct_int8": "int8", "modelopt_fp8": "fp8",
    "modelopt_fp8_pb": "fp8_block", "modelopt_nvfp4": "nvfp4", "modelopt_mxfp8": "mxfp8", "modelopt_int4_awq": "int4",
    "modelopt_w4a8_awq": "w4a8", "ct_mixed": "mixed", "modelopt_mixed": "mixed",
}  # fmt: skip
#: row -> (family, tied lm_head)
ROWS = {**{f: (f, False) for f in sorted(FAMILIES) + sorted(MORE_GROUPS)}, "llama_tied": ("llama", True),
        "gemma_tied": ("gemma", True), "llama_lm_head": ("llama", False)}
FAMILY_GROUPS = {**_GROUPS, **MORE_GROUPS}
#: rows whose (untied) lm_head is quantized too (the presets leave it unquantized; a tied one is refused: test_families)
QUANTIZED_HEAD = {"llama_lm_head"}
_MOE = {f for f in {**FAMILIES, **MORE_FAMILIES} if is_moe(f)}
_EXPERTS = "*mlp.experts*"  # routed experts only (DeepSeek's mlp.shared_experts are linears)


def refusal(family: str, fmt: str) -> Optional[tuple[str, str]]:
    """(what the export's error says, the quantizers to switch off for the rest to export) where ``fmt`` cannot carry
    ``family``'s quantized weights by design (README's export section), else None."""
    if family == "gpt_oss":  # interleaved 3-D experts: only openai_mxfp4 carries them quantized
        return (r"model\.layers\.0\.mlp\.experts\.gate_up_proj_weight_quantizer: transformers' gpt_oss checkpoint keeps "
                r"model\.layers\.0\.mlp\.experts\.gate_up_proj as one 3-D tensor", _EXPERTS)  # fmt: skip
    if family in _MOE and fmt == "modelopt_fp8_pb":  # vLLM's ModelOpt FP8 MoE loader takes per-tensor expert scales
        return (r"model\.layers\.0\.mlp\.experts\.gate_up_proj_weight_quantizer\[0\]: expert 0: format modelopt_fp8_pb cannot carry "
                r"MoE experts", _EXPERTS)  # fmt: skip
    return None


@pytest.fixture(scope="module")
def calibrated():
    cache: dict = {}

    def get(row: str, recipe: str):
        if (row, recipe) not in cache:
            family, tie = ROWS[row]
            if (family, tie) not in cache:
                cache[family, tie] = build(family, tie=tie)
            model = copy.deepcopy(cache[family, tie])
            cfg, acts = RECIPES[recipe]
            if row in QUANTIZED_HEAD:
                cfg = {**cfg, "quant_cfg": {k: v for k, v in cfg["quant_cfg"].items() if k != "*lm_head*"}}
            ids = tokens(5)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # weight-only: max calibration reads the weights, no forward pass needed
                ql.quantize(model, cfg, (lambda m: m(ids)) if acts else None)
            share_sibling_amax(model)  # q/k/v, gate/up, q_a/kv_a, in_proj_qkv/z: one per-tensor / global amax
            assert model.lm_head.weight_quantizer.is_enabled == (row in QUANTIZED_HEAD)
            cache[row, recipe] = model, *_expected(model, acts)
        return cache[row, recipe]

    return get


@torch.no_grad()
def _expected(model, acts: bool) -> tuple[dict[str, torch.Tensor], Optional[torch.Tensor]]:
    """(``weight_quantizer(weight)`` of every quantized linear and expert, the logits a consumer that dequantizes the
    weights must give: the fake-quantized model's, for a weight-only recipe)."""
    return fake_weights(model), None if acts else model(tokens()).logits


@pytest.fixture(scope="module")
def references(tmp_path_factory):
    cache: dict = {}

    def get(row: str) -> dict[str, torch.Size]:
        if row not in cache:
            family, tie = ROWS[row]
            cache[row] = save_pretrained_shapes(build(family, tie=tie), tmp_path_factory.mktemp(f"ref-{row}"))
        return cache[row]

    return get


def _sibling_groups(family: str, quantized: set[str]) -> list[list[str]]:
    """Checkpoint names of the fused groups of ``family`` whose members are all quantized: q/k/v, gate/up, MLA's
    q_a / kv_a, shared experts', the Gated DeltaNet's, and each routed expert's gate / up (w1 / w3)."""
    groups = [[parent.format(leaf) for leaf in leaves] for parent, leaves in (GROUPS[g] for g in FAMILY_GROUPS[family])]
    for name in quantized:
        m = re.fullmatch(r"(.*\.experts\.\d+)\.(gate_proj|w1)", name)
        if m:
            groups.append([name, f"{m.group(1)}.{'up_proj' if m.group(2) == 'gate_proj' else 'w3'}"])
    return [g for g in groups if set(g) <= quantized]


@pytest.mark.parametrize("fmt", sorted(FORMATS))
@pytest.mark.parametrize("row", sorted(ROWS))
def test_consumer_reads_the_fake_quantized_weights(calibrated, references, tmp_path, row, fmt):
    family = ROWS[row][0]
    if not built_here(family):
        pytest.skip(f"this transformers has no {family} model")
    recipe = FORMATS[fmt]
    model, fakes, logits = calibrated(row, recipe)
    refused = refusal(family, fmt)
    if refused is not None:
        with pytest.raises(ExportError, match=refused[0]):
            export_checkpoint(model, tmp_path / "refused", fmt)
        model = copy.deepcopy(model)
        ql.disable_quantizer(model, refused[1])
        fakes, logits = _expected(model, RECIPES[recipe][1])
    export_checkpoint(model, tmp_path / "q", fmt)
    modules = exported_modules(tmp_path / "q")
    ref = references(row)
    assert dense_keys(modules) == set(ref)  # the names of the family's own save_pretrained, nothing more or less
    quantized = quantized_names(modules)
    loaded = consumer_model(tmp_path / "q", fmt, {m: ref[f"{m}.weight"] for m in quantized})
    pairs = {name: (fake, consumer_weight(loaded, name)) for name, fake in fakes.items()}
    assert len(pairs) >= 4 and len(quantized) >= len(pairs), (len(pairs), len(quantized))
    assert not mismatches(pairs, RULES.get(fmt, "exact"))
    if row in QUANTIZED_HEAD:
        assert "lm_head" in quantized and "lm_head" in pairs
    for key in (SHARED_SCALE.get(fmt), "input_scale", "input_global_scale"):  # one weight scale; and one activation scale
        for group in _sibling_groups(family, quantized):
            scales = [modules[m].get(key) for m in group]
            if key is not None and scales[0] is not None:  # (a mixed export: the groups of its schemes with such a scale)
                assert all(s is not None and torch.equal(s, scales[0]) for s in scales), (group, key, scales)
    if RULES.get(fmt, "exact") == "exact" and logits is not None:
        with torch.no_grad():
            assert torch.equal(loaded(tokens()).logits, logits)
    # transformers' own compressed-tensors path (its MoE path is broken upstream; with dequantize=True it takes one scheme for all dense
    # modules, and ct_mixed's two dense schemes load in its compressed mode instead: test_mixed_consumers)
    if fmt.startswith("ct_") and fmt != "ct_mixed" and family not in _MOE:
        from transformers import AutoModelForCausalLM, CompressedTensorsConfig

        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # "the quantization_config from the model will be used": as meant
            ct = AutoModelForCausalLM.from_pretrained(tmp_path / "q", dtype=torch.float32,
                                                      quantization_config=CompressedTensorsConfig(run_compressed=False, dequantize=True))
        assert not mismatches({name: (fake, consumer_weight(ct, name)) for name, fake in fakes.items()}, RULES.get(fmt, "exact"))
        if RULES.get(fmt, "exact") == "exact" and logits is not None:
            with torch.no_grad():
                assert torch.equal(ct(tokens()).logits, logits)


#: formats in which no consumer reads GPT-2's quantized Conv1D (README): refused by name, module and format
GPT2_REFUSED = {"hf_mxfp8", "modelopt_int4_awq", "modelopt_w4a8_awq"}
#: GPT-2's quantized linears (the presets leave lm_head unquantized)
GPT2_LINEARS = {f"transformer.h.0.{m}" for m in ("attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj")}


@pytest.fixture(scope="module")
def gpt2_calibrated():
    cache: dict = {}

    def get(recipe: str):
        if recipe not in cache:
            model = gpt2(tie=True)  # as GPT-2's checkpoints: lm_head is wte
            cfg, acts = RECIPES[recipe]
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                ql.quantize(model, cfg, (lambda m: m(tokens(5))) if acts else None)
            cache[recipe] = model, *_expected(model, acts)
        return cache[recipe]

    return get


@pytest.mark.parametrize("fmt", sorted(FORMATS))
def test_gpt2_conv1d_as_consumers_read_it(gpt2_calibrated, tmp_path, fmt):
    """GPT-2's Conv1D linears store their weight (in, out). vLLM's GPT-2 loader transposes ``<m>.weight`` and reads the rest
    as a linear's (tests/test_vllm/test_vllm_gpt2.py): the consumer's dequantizer, given the tensors so laid out, reads
    ``weight_quantizer(weight)``; a format no consumer reads GPT-2 in is refused naming the module and the format."""
    model, fakes, logits = gpt2_calibrated(FORMATS[fmt])
    if fmt in GPT2_REFUSED:
        with pytest.raises(ExportError, match=rf"transformer\.h\.0\.attn\.c_attn\.weight_quantizer: transformer\.h\.0\.attn\.c_attn stores "
                                              rf"its weight \(in, out\) \(GPT-2's Conv1D\), and format {fmt} reaches no consumer"):
            export_checkpoint(model, tmp_path / "refused", fmt)
        return
    export_checkpoint(model, tmp_path / "q", fmt)
    modules = exported_modules(tmp_path / "q")
    ref = save_pretrained_shapes(gpt2(tie=True), tmp_path / "ref")
    assert dense_keys(modules) == set(ref)  # GPT-2's own save_pretrained names
    assert quantized_names(modules) == GPT2_LINEARS
    # the tied head is listed unquantized (vLLM's ModelOpt loaders would quantize it, with scales nothing loads)
    qc = json.loads((tmp_path / "q" / "config.json").read_text())["quantization_config"]
    assert "lm_head" in (qc.get("ignore") or qc.get("ignored_layers") or qc.get("modules_to_not_convert")), qc
    for m in GPT2_LINEARS:  # codes under ``weight`` (in, out) as GPT-2 stores them; packed codes and scales (out, ...) as a linear's
        t, n_out = modules[m], ref[f"{m}.weight"][1]
        shapes = {k: v.shape for k, v in t.items()}
        assert t["weight"].shape[-1] == n_out if "weight" in t else t["weight_packed"].shape[0] == n_out, (m, shapes)
        assert all(v.dim() < 2 or v.shape[0] in (n_out, -(-n_out // 128)) for k, v in t.items() if k.startswith("weight_s")), m
    loaded = consumer_model(tmp_path / "q", fmt, {m: ref[f"{m}.weight"] for m in GPT2_LINEARS})
    assert not mismatches({name: (fake, consumer_weight(loaded, name)) for name, fake in fakes.items()}, RULES.get(fmt, "exact"))
    if fmt in SHARED_SCALE:  # c_attn is q/k/v fused on disk: one scale, which vLLM's QKVParallelLinear gives every shard
        assert modules["transformer.h.0.attn.c_attn"][SHARED_SCALE[fmt]].numel() == 1
    if RULES.get(fmt, "exact") == "exact" and logits is not None:
        with torch.no_grad():
            assert torch.equal(loaded(tokens()).logits, logits)


def test_gpt2_quantized_formats_fail_to_load_in_transformers(gpt2_calibrated, tmp_path):
    """transformers' quantizers convert nn.Linear only: a quantized GPT-2 fails to load, loudly (so it is no consumer of
    these exports; vLLM is). A transformers that loads one fails this test: then check what it reads."""
    from transformers import AutoModelForCausalLM, CompressedTensorsConfig

    for fmt, kwargs in (("hf_fp8_block", {}), ("ct_int8", {"quantization_config": CompressedTensorsConfig(run_compressed=False,
                                                                                                        dequantize=True)})):
        export_checkpoint(gpt2_calibrated(FORMATS[fmt])[0], tmp_path / fmt, fmt)
        with warnings.catch_warnings(), pytest.raises(RuntimeError, match="conversion of the weights"):
            warnings.simplefilter("ignore")
            AutoModelForCausalLM.from_pretrained(tmp_path / fmt, dtype=torch.float32, **kwargs)


def test_conv1d_outside_gpt2_is_refused(tmp_path):
    """Only vLLM's GPT-2 loader transposes checkpoint weights: a quantized Conv1D of another family is refused by name."""
    model = gpt2(tie=False)
    model.config.model_type = "openai-gpt"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ql.quantize(model, weight_only(ql.FP8_2D_BLOCKWISE_WEIGHT_ONLY_CFG), None)
    with pytest.raises(ExportError, match=r"transformer\.h\.0\.attn\.c_attn: a quantized QuantConv1D stores its weight \(in, out\), .* "
                                          r"config\.model_type 'openai-gpt'"):
        export_checkpoint(model, tmp_path / "q", "ct_fp8_block")


@pytest.mark.parametrize("fmt, mlp", [("ct_mixed", "int4"), ("ct_mixed", "nvfp4"), ("modelopt_mixed", "nvfp4"), ("modelopt_mixed", "int4")])
def test_gpt2_mixed_precision(tmp_path, fmt, mlp):
    """GPT-2 in several schemes at once (FP8 128x128 attention, INT4 or NVFP4 MLP): each Conv1D is packed by its member format
    and read back by that member's dequantizer (quantlib.pipeline.check); ModelOpt's INT4 member (W4A16_AWQ) is refused by name."""
    from quantlib.pipeline import check
    from tests.test_export.test_mixed import FP8_BLOCK, INT4, NVFP4, _cfg

    model = gpt2(tie=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ql.quantize(model, _cfg(mlp=INT4 if mlp == "int4" else NVFP4, attn=FP8_BLOCK), None)
    if fmt == "modelopt_mixed" and mlp == "int4":
        with pytest.raises(ExportError, match=r"transformer\.h\.0\.mlp\.c_fc stores its weight \(in, out\) \(GPT-2's Conv1D\), and format "
                                              r"modelopt_mixed reaches no consumer"):
            export_checkpoint(model, tmp_path / "q", fmt)
        return
    export_checkpoint(model, tmp_path / "q", fmt)
    shapes = {n: raw.shape for n, raw, _ in check.iter_weights(model, quantized=False)}
    loaded, consumer, why = check.reload_export(str(tmp_path / "q"), fmt, shapes, False)
    assert loaded is not None, why
    res = check.CheckResult(consumer, "bf16ulp1" if fmt == "ct_mixed" and mlp == "nvfp4" else "ulp1" if mlp == "int4" else "exact")
    for name, _raw, ref in check.iter_weights(model):
        check.check_weight(res, name, ref, loaded)
    assert res.passed and res.compared == 4, res
