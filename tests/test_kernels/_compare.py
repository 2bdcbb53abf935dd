"""Bit-for-bit comparison of a backend's output with the reference's, shared by the kernel tests."""

from __future__ import annotations

import torch


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view({1: torch.uint8, 2: torch.int16, 4: torch.int32}[t.element_size()])


def assert_same(got, ref, what: str = "") -> None:
    """Same dtype, shape, NaN positions and bits elsewhere (any NaN equals any NaN); tuples element by
    element; ``got`` may live on another device."""
    if isinstance(ref, (tuple, list)):
        assert isinstance(got, (tuple, list)) and len(got) == len(ref), what
        for i, (g, r) in enumerate(zip(got, ref)):
            assert_same(g, r, f"{what}[{i}]")
        return
    got = got.cpu()
    assert got.dtype == ref.dtype and got.shape == ref.shape, (what, got.dtype, ref.dtype, tuple(got.shape), tuple(ref.shape))
    if not (got.dtype.is_floating_point):
        bad = got != ref
    else:
        gn, rn = torch.isnan(got.float()), torch.isnan(ref.float())
        assert torch.equal(gn, rn), f"{what}: NaN at {int((gn != rn).sum())} different places"
        bad = (_bits(got) != _bits(ref)) & ~gn
    if bad.any():
        idx = bad.nonzero()[:4].tolist()
        raise AssertionError(f"{what}: {int(bad.sum())} of {bad.numel()} differ, first at {idx}: got {got[bad][:4].tolist()}, want "
                             f"{ref[bad][:4].tolist()}")


assert_same_all = assert_same


def e2m1_probe() -> torch.Tensor:
    """fp32 rows of 32 for MXFP4 whose E8M0 scale is 1 (each row's amax is 6): every bf16 value of
    magnitude <= 6 (all E2M1 ties among them), both signs, and 2^14 random fp32 values in [-6, 6]."""
    bits = torch.arange(0, 0x40C1, dtype=torch.int32) << 16
    mags = bits.view(torch.float32)
    g = torch.Generator().manual_seed(5)
    vals = torch.cat([mags, -mags, (torch.rand(1 << 14, generator=g) * 12 - 6)])
    pad = (-vals.numel()) % 31
    vals = torch.cat([vals, torch.zeros(pad)]).view(-1, 31)
    return torch.cat([torch.full((vals.shape[0], 1), 6.0), vals], dim=1)
