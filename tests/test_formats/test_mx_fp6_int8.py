"""MXFP6 (E3M2 / E2M3 elements) and MXINT8: hand-computed blocks, and ModelOpt 0.47's MX fake quant.

ModelOpt's MX fake quant (``fused_amax_convert`` of its ``tensor_quant_mx.cu``) runs only on CUDA. On
the CPU the test below runs its algorithm element by element in Python: the E8M0 exponent by its
"NV" rule from the bits of ``amax / Q``, the element by its ties-to-even table walk over the value and
bound tables it ships in ``tensor_quant_mx.h`` (read from the installed package, not copied), INT8 by
``rint`` and a clamp to +-127.
"""

from __future__ import annotations

import os
import re
import struct

import numpy as np
import pytest
import torch
from hypothesis import given, settings, strategies as st

from quantlib.formats.fp6 import fp6_decode, fp6_encode, fp6_round, fp6_values
from quantlib.formats.mx import mx_dequantize, mx_fake_quant, mx_quantize
from quantlib.formats.spec import Rounding

from ._helpers import INF, NAN, assert_same, t32

RCEIL, FLOOR = Rounding.RCEIL, Rounding.FLOOR
ELEMS = ("e3m2", "e2m3", "int8")
Q = {"e3m2": 28.0, "e2m3": 7.5, "int8": 127.0}


def byte(values) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.uint8)


def block(head, n=32) -> list[float]:
    return list(head) + [0.0] * (n - len(head))


# --------------------------------------------------------------------------- ModelOpt's tables


def modelopt_table(name: str) -> list[float]:
    """A ``CONSTANT float <name>[n] = {...}`` table of ModelOpt's installed tensor_quant_mx.h."""
    import modelopt

    path = os.path.join(os.path.dirname(modelopt.__file__), "torch", "kernels", "quantization", "gemm", "tensor_quant_mx.h")
    with open(path, encoding="utf-8") as f:
        text = f.read()
    body = re.search(rf"{name}\[\d+\]\s*=\s*\{{([^}}]*)\}}", text)
    assert body, f"{name} not found in {path}"
    return [float(v) for v in body.group(1).replace("\n", " ").split(",") if v.strip()]


@pytest.mark.parametrize("elem,element", [("e3m2", (3, 2)), ("e2m3", (2, 3))])
def test_fp6_grid_is_modelopts_table(elem, element):
    assert fp6_values(element).tolist() == modelopt_table(f"{elem}_table_values")


def _f32(v: float) -> np.float32:
    return np.float32(v)


def modelopt_exponent(amax: np.float32, q: float) -> int:
    """ModelOpt's compute_scale_e8m0_NV: the unscale exponent from the bits of the fp32 ``amax / Q``."""
    ratio = np.float32(amax / np.float32(q))
    (bits,) = struct.unpack("<I", struct.pack("<f", float(ratio)))
    field, sig = (bits >> 23) & 0xFF, bits & 0x7FFFFF
    up = sig > 0 and field != 0xFE and not (field == 0 and sig <= 0x400000)
    return field - 126 if up else field - 127


def modelopt_element(y: np.float32, elem: str) -> float:
    if elem == "int8":
        return float(min(max(np.rint(y), -127.0), 127.0))
    values, bounds = modelopt_table(f"{elem}_table_values"), modelopt_table(f"{elem}_table_bounds")
    for i, b in enumerate(bounds):
        if y < b:
            return values[i]
        if y == b:
            return values[i] if i % 2 == 0 else values[i + 1]
    return values[-1]


def modelopt_mx_fake_quant(x: torch.Tensor, elem: str) -> torch.Tensor:
    """ModelOpt 0.47's MX fake quant of finite fp32 ``x`` (rows of whole blocks of 32), in Python."""
    out = []
    for blk in x.reshape(-1, 32).tolist():
        b = [_f32(v) for v in blk]
        amax = max(abs(v) for v in b)
        e = 0 if amax == 0 else modelopt_exponent(amax, Q[elem])
        scale, unscale = _f32(2.0**-e), _f32(2.0**e)
        for v in b:
            y = np.float32(abs(v) * scale)
            with np.errstate(over="ignore"):  # a block near FLT_MAX may round up to Inf, there too
                r = np.float32(modelopt_element(y, elem) * unscale)
            out.append(float(-r if v < 0 else r))
    return torch.tensor(out, dtype=torch.float32).reshape(x.shape)


def spread_blocks(seed: int, rows: int = 24) -> torch.Tensor:
    """Blocks whose amax spans many binades, with exact grid ties and values near the amax."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, 64, generator=g) * torch.exp2(torch.randint(-30, 30, (rows, 1), generator=g).float())
    x[::3, 5] = x[::3, 0].abs().amax() * 0.999  # near-saturation elements
    return x


@pytest.mark.parametrize("elem", ELEMS)
@pytest.mark.parametrize("seed", [0, 1])
def test_rceil_fake_quant_equals_modelopts_algorithm(elem, seed):
    x = spread_blocks(seed)
    assert torch.equal(mx_fake_quant(x, elem, 32, RCEIL), modelopt_mx_fake_quant(x, elem))


@pytest.mark.parametrize("elem", ELEMS)
def test_extreme_exponents_equal_modelopts_algorithm(elem):
    # random fp32 bit patterns: block amax from fp32 subnormals to 3.4e38, exponents clamped at +-127
    g = torch.Generator().manual_seed(11)
    x = torch.randint(-(2**31), 2**31 - 1, (16, 64), generator=g, dtype=torch.int64).to(torch.int32).view(torch.float32)
    x = torch.where(torch.isfinite(x), x, torch.zeros(()))
    x[:4] *= 2.0**-100
    assert torch.equal(mx_fake_quant(x, elem, 32, RCEIL), modelopt_mx_fake_quant(x, elem))


@pytest.mark.parametrize("elem", ("e3m2", "e2m3"))
def test_every_tie_of_the_grid_rounds_as_modelopt(elem):
    # amax Q gives e = 0: the elements are the grid's own rounding, every bound (tie) and its neighbours
    bounds = torch.tensor(modelopt_table(f"{elem}_table_bounds"))
    near = torch.cat([bounds, torch.nextafter(bounds, torch.zeros(())), torch.nextafter(bounds, torch.full((), 99.0))])
    vals = torch.cat([near, -near])
    vals = torch.cat([vals, torch.zeros((-vals.numel()) % 31)]).view(-1, 31)
    x = torch.cat([torch.full((vals.shape[0], 1), Q[elem]), vals], dim=1)
    assert torch.equal(mx_fake_quant(x, elem, 32, RCEIL), modelopt_mx_fake_quant(x, elem))


@settings(max_examples=60, deadline=None)
@given(st.lists(st.floats(-1e6, 1e6, allow_nan=False, width=32), min_size=32, max_size=32), st.sampled_from(ELEMS))
def test_random_block_equals_modelopts_algorithm(values, elem):
    x = torch.tensor(values, dtype=torch.float32).reshape(1, 32)
    assert torch.equal(mx_fake_quant(x, elem, 32, RCEIL), modelopt_mx_fake_quant(x, elem))


# --------------------------------------------------------------------------- hand-computed blocks


@pytest.mark.parametrize("elem", ELEMS)
@pytest.mark.parametrize("rounding", [RCEIL, FLOOR])
def test_all_zero_block(elem, rounding):
    x = torch.zeros(2, 64)
    codes, b = mx_quantize(x, elem, 32, rounding)
    assert_same(b, byte([[0, 0], [0, 0]]))
    assert not codes.any() and codes.shape == x.shape
    assert codes.dtype == (torch.int8 if elem == "int8" else torch.uint8)
    assert_same(mx_fake_quant(x, elem, 32, rounding), torch.zeros(2, 64))


@pytest.mark.parametrize("elem", ELEMS)
@pytest.mark.parametrize("bad", [NAN, INF, -INF])
def test_nan_block(elem, bad):
    # block 0 holds NaN/Inf: byte 0xFF, NaN throughout (ModelOpt gives finite values there, see
    # docs/numerics.md); block 1 has amax Q: e = 0, exact
    q = Q[elem]
    x = t32(block([1.0, bad]) + block([q, -2.0, 0.5 if elem != "int8" else 3.0]))
    codes, b = mx_quantize(x, elem, 32, RCEIL)
    assert_same(b, byte([0xFF, 127]))
    assert not codes[:32].any()  # NaN elements get code 0; their byte carries the NaN
    expected = t32([NAN] * 32 + block([q, -2.0, 0.5 if elem != "int8" else 3.0]))
    for rounding in (RCEIL, FLOOR):
        assert_same(mx_fake_quant(x, elem, 32, rounding), expected)


@pytest.mark.parametrize(
    "elem,amax,rceil,floor",
    [
        # E3M2: rceil e = ceil(log2(31/28)) = 1, 15.5 -> 16 (spacing 2 in [8, 16)) -> 32;
        # floor e = floor(log2 31) - 4 = 0, 31 saturates at 28
        ("e3m2", 31.0, 32.0, 28.0),
        # E2M3: rceil e = 1, 3.95 -> 4 (spacing 0.25) -> 8; floor e = 2 - 2 = 0, 7.9 saturates at 7.5
        ("e2m3", 7.9, 8.0, 7.5),
        # INT8: rceil e = ceil(log2(255/127)) = 2, 63.75 -> 64 -> 256; floor e = 7 - 6 = 1, 127.5 -> 127 -> 254
        ("int8", 255.0, 256.0, 254.0),
    ],
)
def test_saturation_floor_vs_rceil(elem, amax, rceil, floor):
    x = t32(block([amax, -amax]))
    assert_same(mx_fake_quant(x, elem, 32, RCEIL), t32(block([rceil, -rceil])))
    assert_same(mx_fake_quant(x, elem, 32, FLOOR), t32(block([floor, -floor])))


def test_e3m2_subnormals_round_half_to_even():
    # amax 28 -> e = 0; subnormal step 2^-4: 0.03125 ties to 0 (even), 0.09375 ties to 0.125 (code 2),
    # 0.1 -> 0.125, 0.2 -> 0.1875, 0.2499 -> 0.25 (smallest normal), -0.02 -> -0.0 (code 0x20)
    x = t32(block([28.0, 0.03125, 0.09375, 0.1, 0.2, 0.2499, -0.02]))
    codes, b = mx_quantize(x, "e3m2", 32, RCEIL)
    assert_same(b, byte([127]))
    assert codes[:7].tolist() == [31, 0, 2, 2, 3, 4, 0x20]
    assert_same(mx_fake_quant(x, "e3m2", 32, RCEIL), t32(block([28.0, 0.0, 0.125, 0.125, 0.1875, 0.25, -0.0])))


def test_e2m3_subnormals_and_codes():
    # amax 7.5 -> e = 0; step 2^-3: 0.0625 ties to 0, 0.1875 ties to 0.25 (code 2), 0.3 -> 0.25,
    # 1.0 is the smallest normal (code 8), 3.0 = 1.5 * 2 (code 0b10100 = 20), -7.5 -> code 63
    x = t32(block([7.5, 0.0625, 0.1875, 0.3, 1.0, 3.0, -7.5]))
    codes, _ = mx_quantize(x, "e2m3", 32, RCEIL)
    assert codes[:7].tolist() == [31, 0, 2, 2, 8, 20, 63]
    assert_same(mx_fake_quant(x, "e2m3", 32, RCEIL), t32(block([7.5, 0.0, 0.25, 0.25, 1.0, 3.0, -7.5])))


def test_mxint8_codes_round_half_to_even():
    # amax 127 -> e = 0: codes are the elements rounded half to even; -0.4 -> code 0 and output +0
    x = t32(block([127.0, 1.5, 2.5, -0.5, -0.4, -126.5]))
    codes, b = mx_quantize(x, "int8", 32, RCEIL)
    assert_same(b, byte([127]))
    assert codes[:6].tolist() == [127, 2, 2, 0, 0, -126]
    out = mx_fake_quant(x, "int8", 32, RCEIL)
    assert_same(out, t32(block([127.0, 2.0, 2.0, 0.0, 0.0, -126.0])))
    assert not torch.signbit(out[4])


def test_mxint8_scale_is_the_ocp_q16_scale_over_64():
    # amax 1.0: rceil e = ceil(log2(1/127)) = -6, floor e = 0 - 6 = -6: the element k means k * 2^-6,
    # the OCP spec's Q1.6 element k / 64 under its scale 2^(floor(log2 amax)) = 1
    x = t32(block([1.0, 0.5, -0.015625, 0.3]))
    for rounding in (RCEIL, FLOOR):
        codes, b = mx_quantize(x, "int8", 32, rounding)
        assert_same(b, byte([121]))
        assert codes[:4].tolist() == [64, 32, -1, 19]  # 0.3 * 64 = 19.2 -> 19


@pytest.mark.parametrize("elem,element", [("e3m2", (3, 2)), ("e2m3", (2, 3))])
def test_fp6_decode_of_encode_is_round(elem, element):
    g = torch.Generator().manual_seed(3)
    y = (torch.rand(4096, generator=g) * 2 - 1) * Q[elem]
    assert_same(fp6_decode(fp6_encode(y, element), element), fp6_round(y, element))
    codes = torch.arange(64, dtype=torch.uint8)
    assert torch.equal(fp6_encode(fp6_decode(codes, element), element), codes)  # every code round-trips


@pytest.mark.parametrize("elem", ELEMS)
def test_dequantize_of_quantize_is_fake_quant_partial_block(elem):
    x = spread_blocks(4)[:, :45]  # a partial last block of 13
    codes, b = mx_quantize(x, elem, 32, RCEIL)
    assert_same(mx_dequantize(codes, b, elem, 32, 45), mx_fake_quant(x, elem, 32, RCEIL))
    assert_same(mx_fake_quant(x[:, :32], elem, 32, RCEIL), mx_fake_quant(x, elem, 32, RCEIL)[:, :32])


def test_unknown_element_is_refused():
    with pytest.raises(ValueError, match="MX element format"):
        mx_quantize(torch.zeros(32), "e5m2")
    with pytest.raises(ValueError, match="MX element format"):
        mx_quantize(torch.zeros(32), 4)
