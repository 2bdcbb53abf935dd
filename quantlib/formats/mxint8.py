"""INT8 elements of MXINT8: integer codes -127..127 under an E8M0 block scale (ModelOpt's numerics).

The element is read as an integer, ``x_hat = k * 2^e``, so ``Q = 127`` and the largest power of two is
``2^6`` (``emax = 6``): rceil gives ``e = ceil(log2(a / 127))``, floor ``e = floor(log2 a) - 6``. The
OCP spec reads the same byte as the fixed-point Q1.6 value ``k / 64`` under a scale ``2^(e + 6)``;
the products are equal. Codes round half to even and saturate at +-127 (-128 is never used).
"""

from __future__ import annotations

import torch

MXINT8_MAX = 127.0
MXINT8_EMAX = 6


def mxint8_round(y: torch.Tensor) -> torch.Tensor:
    """fp32 ``clamp(round_half_even(y), -127, 127)``; NaN kept."""
    return torch.clamp(torch.round(y.float()), -MXINT8_MAX, MXINT8_MAX)


def mxint8_encode(y: torch.Tensor) -> torch.Tensor:
    """int8 codes of fp32 ``y``; NaN gives code 0 (its block's scale is NaN)."""
    return torch.nan_to_num(mxint8_round(y), nan=0.0).to(torch.int8)
