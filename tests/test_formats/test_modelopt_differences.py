"""The differences from ModelOpt 0.47 that docs/numerics.md states, measured here on the CPU so that
the document's numbers are checked (ModelOpt's formulas written out in torch, as its sources have them)."""

from __future__ import annotations

import math
import os
import re

import torch

from quantlib.formats import FormatSpec, Kind
from quantlib.formats.e8m0 import e8m0_exponent
from quantlib.formats.fp8 import fp8_scale
from quantlib.formats.reference import dequantize, quantize

DOC = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "docs", "numerics.md")


def every_mantissa() -> torch.Tensor:
    """All 2^23 fp32 values in [1, 2): the share of amax values for which two formulas differ is the
    same in every binade (scaling by a power of two is exact), so this is the share over all amax."""
    return (torch.arange(0, 1 << 23, dtype=torch.int32) | 0x3F800000).view(torch.float32)


def doc_row(start: str) -> str:
    with open(DOC, encoding="utf-8") as f:
        rows = [line for line in f if line.startswith(f"| {start}")]
    assert len(rows) == 1, f"docs/numerics.md: expected one table row starting with {start!r}"
    return rows[0]


def test_fp8_per_tensor_scale_differs_from_modelopts_for_the_documented_share():
    a = every_mantissa()
    ours = fp8_scale(a, (4, 3))
    theirs = 448.0 / a  # ModelOpt's tensor_quant._fp8_eager: a Python number over a tensor
    assert torch.equal(theirs, torch.reciprocal(a) * 448.0)  # which torch evaluates as two roundings
    assert torch.equal(ours, torch.full_like(a, 448.0) / a)  # ours: the one IEEE quotient
    ulps = (ours.view(torch.int32) - theirs.view(torch.int32)).abs()
    assert int(ulps.max()) == 1
    scale_share = float((ours != theirs).float().mean())
    inverse_share = float((torch.reciprocal(ours) != torch.reciprocal(theirs)).float().mean())
    row = doc_row("FP8 per-tensor / per-channel scale")
    documented = [float(p) for p in re.findall(r"([0-9]+\.[0-9])%", row)]
    assert documented == [round(100 * scale_share, 1), round(100 * inverse_share, 1)], (documented, scale_share, inverse_share)


def test_fp8_outputs_differ_by_the_dequantization_factor():
    """An amax whose 1/s differs: every nonzero output differs by about an ulp, zeros agree."""
    a = every_mantissa()[:4096]
    ours, theirs = fp8_scale(a, (4, 3)), 448.0 / a
    i = int(torch.nonzero(torch.reciprocal(ours) != torch.reciprocal(theirs))[0])
    amax = a[i]
    x = torch.linspace(-float(amax), float(amax), 257)
    q_ours = quantize(x, FormatSpec(Kind.FP8, element=(4, 3)), amax)
    ours_out = dequantize(q_ours, torch.float32)
    codes = torch.clamp(x * theirs[i], -448.0, 448.0).to(torch.float8_e4m3fn)
    theirs_out = codes.float() * (1 / theirs[i])
    nonzero = ours_out != 0
    assert bool((ours_out != theirs_out)[nonzero].float().mean() > 0.9)
    assert torch.equal(ours_out[~nonzero], theirs_out[~nonzero])


def test_modelopt_export_e8m0_exponent_is_off_by_one_above_a_power_of_two():
    """ModelOpt's qtensor export takes ceil(torch.log2(amax / 448)); ours comes from the bits."""
    amax = torch.tensor(448.0 * (1 + 2.0**-23) * 2.0**10)
    ratio = amax / 448.0
    assert float(ratio) > 2.0**10  # just above 2^10: the exponent must be 11
    theirs = int(torch.ceil(torch.log2(ratio)))
    ours = int(e8m0_exponent(amax.reshape(1), 448.0, 8, "rceil")[0])
    assert (ours, theirs) == (11, 10)
    assert "(1 + 2^-23) * 2^10" in doc_row("E8M0 exponent")


def test_nvfp4_code_8_dequantizes_to_negative_zero():
    """ModelOpt's e2m1 value table maps code 8 to +0.0; ours keeps the sign bit."""
    x = torch.zeros(1, 16)
    x[0, 0], x[0, 1] = -0.01, 6.0
    q = quantize(x, FormatSpec(Kind.NVFP4, element=(2, 1), block=(16,), dynamic=True), torch.tensor(6.0))
    assert int(q.codes[0, 0]) & 0xF == 8
    out = dequantize(q, torch.float32)
    assert float(out[0, 0]) == 0.0 and math.copysign(1.0, float(out[0, 0])) == -1.0
    assert "-0.0" in doc_row("NVFP4 code 8")
