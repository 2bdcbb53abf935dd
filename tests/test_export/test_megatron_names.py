"""Cutting a fused Megatron weight's amax into its q / k / v (gate / up) parts (quantlib.export.megatron_names)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from quantlib.export import ExportError
from quantlib.export.megatron_names import qkv_rows, select_rows
from quantlib.formats import FormatSpec, Kind


def _block(bm: int) -> FormatSpec:
    return FormatSpec(Kind.FP8_BLOCK, element=(4, 3), block=(bm, bm))


def test_block_amax_of_gqa_query_groups_whose_blocks_are_whole():
    """Two query groups of head_dim 128: q is rows 0-255 and 512-767 of linear_qkv, whole 128-row blocks, so its
    block amax are row blocks 0, 1, 4, 5 (before: refused because q's rows are not one run)."""
    config = SimpleNamespace(num_attention_heads=4, num_query_groups=2, kv_channels=128, hidden_size=256)
    q, k, v = qkv_rows(config)
    amax = torch.arange(8 * 2, dtype=torch.float32).view(8, 2)  # [row blocks, column blocks] of a 1024 x 256 weight
    assert torch.equal(select_rows(amax, _block(128), 1024, q, "w"), amax[[0, 1, 4, 5]])
    assert torch.equal(select_rows(amax, _block(128), 1024, k, "w"), amax[[2, 6]])
    assert torch.equal(select_rows(amax, _block(128), 1024, v, "w"), amax[[3, 7]])


def test_block_amax_refused_where_a_block_holds_two_parts():
    """head_dim 64: k and v of a group share one 128-row block (its one scale cannot serve two tensors); a last
    partial block that a part ends the weight in is whole."""
    config = SimpleNamespace(num_attention_heads=4, num_query_groups=2, kv_channels=64, hidden_size=256)
    q, k, _ = qkv_rows(config)
    amax = torch.ones(4, 2)
    assert torch.equal(select_rows(amax, _block(128), 512, q, "w"), amax[[0, 2]])
    with pytest.raises(ExportError, match="w: rows of q / k / v .* interleave within 128-row blocks"):
        select_rows(amax, _block(128), 512, k, "w")
    tail = torch.arange(128, 192)  # the up half of a 192-row gate / up weight: its own (partial) last block
    assert torch.equal(select_rows(torch.ones(2, 1), _block(128), 192, tail, "w"), torch.ones(1, 1))
