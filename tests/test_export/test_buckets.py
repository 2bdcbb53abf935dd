"""The sender's contract: chunks and buckets of ONE dtype under a byte budget, with the metadata that
cuts a received buffer back into the named tensors, bit for bit."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

import quantlib as ql  # noqa: E402
from quantlib.export import Bucket, ExportError, bucket_by_dtype, chunk_by_bytes, sync_pairs  # noqa: E402
from tests.test_export._export_models import bit_equal, quantized, qwen3_moe, weight_only  # noqa: E402


def _pairs() -> list[tuple[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    return [
        ("a.weight", torch.randn(8, 16, generator=g).to(torch.float8_e4m3fn)),
        ("a.weight_scale_inv", torch.rand(1, 1, generator=g)),
        ("b.weight", torch.randn(8, 16, generator=g).to(torch.float8_e4m3fn)),
        ("b.weight_scale_inv", torch.rand(1, 1, generator=g)),
        ("c.weight", torch.randn(64, 16, generator=g).to(torch.float8_e4m3fn)),
        ("c.bias", torch.randn(64, generator=g).to(torch.bfloat16)),
    ]


def test_chunk_by_bytes_keeps_one_dtype_per_chunk():
    """A chunk mixed fp8 codes with fp32 scales: a CUDA-IPC sender shares one typed buffer per chunk."""
    chunks = list(chunk_by_bytes(_pairs(), 300))
    assert all(len({t.dtype for _, t in c}) == 1 for c in chunks)
    assert [[k for k, _ in c] for c in chunks] == [["a.weight", "b.weight"], ["c.weight"], ["a.weight_scale_inv", "b.weight_scale_inv"],
                                                   ["c.bias"]]
    assert all(sum(t.numel() * t.element_size() for _, t in c) <= 300 or len(c) == 1 for c in chunks)


def test_buckets_cut_back_into_the_tensors():
    pairs = _pairs()
    buckets = list(bucket_by_dtype(pairs, 300))
    assert [b.dtype for b in buckets] == [torch.float8_e4m3fn, torch.float8_e4m3fn, torch.float32, torch.bfloat16]
    seen = {}
    for b in buckets:
        assert b.buffer.dim() == 1 and b.nbytes == sum(e.numel for e in b.entries) * b.buffer.element_size()
        received = b.buffer.clone()  # what the receiver holds: the buffer alone, plus the entries
        for name, t in Bucket(received, b.entries).tensors():
            seen[name] = t
    assert sorted(seen) == sorted(k for k, _ in pairs)
    for k, t in pairs:
        assert bit_equal(seen[k], t), k
    offsets = [(e.offset, e.numel) for e in buckets[2].entries]
    assert offsets == [(0, 1), (1, 1)]


def test_bucket_budget_must_be_positive():
    with pytest.raises(ExportError, match="chunk_bytes must be positive, got 0"):
        list(bucket_by_dtype(_pairs(), 0))


def test_a_model_in_buckets():
    model = quantized(qwen3_moe(), weight_only(ql.NVFP4_DEFAULT_CFG))
    pairs = dict(sync_pairs(model, "ct_nvfp4"))
    got = {}
    for b in bucket_by_dtype(sync_pairs(model, "ct_nvfp4"), 1 << 16):
        assert b.nbytes <= 1 << 16 or len(b.entries) == 1
        got.update(b.tensors())
    assert got.keys() == pairs.keys()
    assert all(bit_equal(got[k], t) for k, t in pairs.items())
