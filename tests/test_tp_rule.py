"""The tensor-parallel layout rule (``quantlib.distributed.tp_shard_dim``) that the amax sync and the
Megatron checkpoints share, case by case; the multi-process tests check its effect."""

from __future__ import annotations

import pytest

import quantlib as ql
from quantlib.distributed import LayoutError, tp_shard_dim


def _leaf(**attrs):
    """The (spec, axis) that tp_shard_dim reads of a quantizer with these attributes."""
    q = ql.TensorQuantizer(ql.QuantizerAttributeConfig(**attrs))
    return q.spec, q.axis


@pytest.mark.parametrize(
    "attrs,ndim,split,extent,tp,expected",
    [
        pytest.param({"num_bits": (4, 3)}, 0, 0, 32, 2, None, id="per-tensor-replicated"),
        pytest.param({"num_bits": 8, "axis": 0}, 2, 0, 32, 2, 0, id="column-weight-channels-sharded"),
        pytest.param({"num_bits": 8, "axis": 0}, 2, 1, 16, 2, None, id="row-weight-channels-replicated"),
        pytest.param({"num_bits": 8, "axis": -1}, 3, -1, 16, 2, 2, id="row-input-channels-sharded"),
        pytest.param({"num_bits": 4, "block_sizes": {-1: 128}}, 2, 0, 32, 2, 0, id="column-weight-blocks-sharded-rows"),
        pytest.param({"num_bits": 4, "block_sizes": {-1: 128}}, 2, 1, 16, 2, None, id="row-weight-one-block-per-row"),
        pytest.param({"num_bits": 4, "block_sizes": {-1: 128}}, 2, 1, 256, 2, 1, id="row-weight-whole-blocks-sharded"),
        pytest.param({"num_bits": 4, "block_sizes": {-1: 128}}, 2, 1, 200, 1, 1, id="tp1-always-its-own-global-form"),
        pytest.param(
            {"num_bits": (2, 1), "block_sizes": {-1: 16, "type": "dynamic", "scale_bits": (4, 3)}},
            0,
            1,
            16,
            2,
            None,
            id="nvfp4-global-amax",
        ),
    ],
)
def test_tp_shard_dim(attrs, ndim, split, extent, tp, expected):
    assert tp_shard_dim(*_leaf(**attrs), ndim, split, extent, tp, "q") == expected


def test_blocks_straddling_tp_shards_have_no_global_form():
    with pytest.raises(LayoutError, match="straddle"):
        tp_shard_dim(*_leaf(num_bits=4, block_sizes={-1: 128}), 2, 1, 200, 2, "decoder.linear_proj.weight_quantizer")


def test_blocks_along_a_split_axis_of_unknown_size_raise():
    """Extent 0: no weight to read the local size from; below TP=2 there is nothing to decide."""
    leaf = _leaf(num_bits=4, block_sizes={-1: 128})
    with pytest.raises(LayoutError, match="unknown"):
        tp_shard_dim(*leaf, 2, -1, 0, 2, "self_attention.core.k_quantizer")
    assert tp_shard_dim(*leaf, 2, -1, 0, 1, "self_attention.core.k_quantizer") == 1
