"""Llama-4's q / k in 2-D block formats: vLLM's loader interleaves each head's rows for its rotary embedding (and a
``weight_scale`` with them), which 128x128 block scales cannot follow when a head spans blocks (silently wrong) or
where the format's block scale is named ``weight_scale`` (it fails at load): refused by name. Blocks holding whole
heads in hf_fp8_block (scale ``weight_scale_inv``, not permuted) and per-row scales export (vLLM's side:
tests/test_vllm/test_vllm_llama4_rotary.py)."""

from __future__ import annotations

import pytest

pytest.importorskip("transformers")

import quantlib as ql  # noqa: E402
from quantlib.export import ExportError, export_checkpoint  # noqa: E402
from tests.test_export._export_models import quantized, weight_only  # noqa: E402

FP8_BLOCK = weight_only(ql.FP8_2D_BLOCKWISE_WEIGHT_ONLY_CFG)


def llama4(head_dim: int):
    """A tiny Llama-4 text model (4 heads, 2 KV heads) with its experts left unquantized below."""
    import torch
    import transformers

    torch.manual_seed(0)
    cfg = transformers.Llama4TextConfig(vocab_size=256, hidden_size=256, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
                                        head_dim=head_dim, intermediate_size=128, intermediate_size_mlp=256, num_local_experts=2,
                                        num_experts_per_tok=1, max_position_embeddings=64, pad_token_id=None, eos_token_id=None)
    return transformers.Llama4ForCausalLM(cfg).eval()


def _quantized(head_dim: int, cfg: dict):
    model = quantized(llama4(head_dim), cfg)
    ql.disable_quantizer(model, "*experts*")
    return model


@pytest.mark.parametrize("fmt", ["hf_fp8_block", "ct_fp8_block", "modelopt_fp8_pb"])
def test_a_head_wider_than_a_block_is_refused(tmp_path, fmt):
    with pytest.raises(ExportError, match=r"self_attn.q_proj.weight_quantizer = fp8_block .*: vLLM's loader of config.model_type "
                                          r"'llama4_text' interleaves the rows of each head of q_proj/k_proj for its rotary embedding, and "
                                          r"a head of 256 rows spans 128-row blocks"):
        export_checkpoint(_quantized(256, FP8_BLOCK if fmt != "ct_fp8_block" else ql.FP8_BLOCKWISE_CFG), tmp_path / "c", fmt)
    assert not (tmp_path / "c").exists()


@pytest.mark.parametrize("fmt", ["ct_fp8_block", "modelopt_fp8_pb"])
def test_block_scales_vllm_would_permute_are_refused(tmp_path, fmt):
    with pytest.raises(ExportError, match=rf"and it permutes {fmt}'s block scale as if it had a row per weight row, and fails at load"):
        export_checkpoint(_quantized(64, FP8_BLOCK if fmt != "ct_fp8_block" else ql.FP8_BLOCKWISE_CFG), tmp_path / "c", fmt)


def test_whole_heads_per_block_and_per_row_scales_export(tmp_path):
    export_checkpoint(_quantized(64, FP8_BLOCK), tmp_path / "b", "hf_fp8_block")
    export_checkpoint(_quantized(256, weight_only(ql.MXFP8_DEFAULT_CFG)), tmp_path / "m", "ct_mxfp8")
    assert (tmp_path / "b" / "model.safetensors").exists() and (tmp_path / "m" / "model.safetensors").exists()
