"""Typed description of a number format: what every backend needs to know to quantize a tensor."""

from __future__ import annotations

import enum
from dataclasses import dataclass

from .fp6 import FP6_FORMATS
from .mxint8 import MXINT8_EMAX


class Kind(str, enum.Enum):
    """The family of a format; each family has one module in ``quantlib.formats``."""

    INT = "int"  # per tensor / channel / static or dynamic block, scale = Q / amax
    FP8 = "fp8"  # per tensor / channel, scale = Q / amax (amax <= 2^-24 -> 1)
    FP8_BLOCK = "fp8_block"  # 1xB or BxB blocks, dequant scale d = max(amax, eps) / Q
    MX = "mx"  # OCP microscaling: E8M0 shared exponent over 32 elements (MXINT8: element None, num_bits 8)
    NVFP4 = "nvfp4"  # E2M1 elements, E4M3 block scale over 16 (or 32) elements, fp32 global scale


class Rounding(str, enum.Enum):
    """How the E8M0 shared exponent of an MX block is chosen from the block amax ``a``.

    RCEIL: ``e = ceil(log2(a / Q))`` computed exactly from the fp32 bits of ``a / Q`` (TE / cuBLAS);
        no element saturates.
    FLOOR: ``e = floor(log2(a)) - emax`` (OCP MX spec); the largest elements may saturate at ``Q``.
    Both clamp ``e`` to [-127, 127]; ``a == 0`` (or subnormal) gives byte 0, NaN/Inf give byte 0xFF.
    """

    RCEIL = "rceil"
    FLOOR = "floor"


#: Largest magnitude and E8M0 ``emax`` of each element format, keyed by (exponent, mantissa) bits.
FLOAT_FORMATS: dict[tuple[int, int], tuple[float, int]] = {
    (4, 3): (448.0, 8),
    (5, 2): (57344.0, 15),
    (2, 1): (6.0, 2),
    **FP6_FORMATS,  # MX elements only (config.py allows them with E8M0 block scales alone)
}

#: Amax at or below this quantizes a whole group to zero (INT) or gives scale 1 (FP8, NVFP4).
TINY_AMAX = 2.0**-24


#: Smallest FP8-blockwise ``eps``: ``eps / 57344`` is still a normal fp32 number (2^-126 < 2^-110 / 2^16).
MIN_EPS = 2.0**-110


@dataclass(frozen=True)
class FormatSpec:
    """Everything the numerics need; built from a QuantizerAttributeConfig by ``config.py``.

    ``block`` is None (per tensor / per channel through the amax shape), ``(B,)`` for blocks of B along
    the last dim, or ``(BM, BK)`` for 2-D blocks over the last two dims. ``dynamic`` block formats
    compute their block amax from the tensor on every call; NVFP4 with ``dynamic`` False takes a stored
    block amax as well as its global amax (static blocks).
    """

    kind: Kind
    num_bits: int = 8  # INT bits; for floats the element bits are in ``element``
    element: tuple[int, int] | None = None  # (E, M) of float elements
    unsigned: bool = False
    narrow_range: bool = True  # config.py always passes the attribute config's value (default False, ModelOpt's)
    block: tuple[int, ...] | None = None
    dynamic: bool = False
    eps: float = 1e-10
    pow2: bool = False
    rounding: Rounding = Rounding.RCEIL

    @property
    def qmax(self) -> float:
        """Largest representable magnitude ``Q``."""
        if self.kind == Kind.INT or self.element is None:
            return float(2**self.num_bits - 1) if self.unsigned else float(2 ** (self.num_bits - 1) - 1)
        assert self.element is not None
        return FLOAT_FORMATS[self.element][0]

    @property
    def emax(self) -> int:
        if self.kind == Kind.MX and self.element is None:
            return MXINT8_EMAX
        assert self.element is not None
        return FLOAT_FORMATS[self.element][1]

    # The amax layout rules: every module that stores, syncs, checks, searches or exports an amax asks these.

    @property
    def two_level(self) -> bool:
        """NVFP4: an fp32 global amax (stored, per tensor) scales the E4M3 block scales, which come from each
        block's own amax (computed from the tensor, or stored too with :attr:`static_blocks`)."""
        return self.kind == Kind.NVFP4

    @property
    def static_blocks(self) -> bool:
        """NVFP4 with static blocks (ModelOpt's ``"type": "static"``): a stored block amax beside the global amax."""
        return self.kind == Kind.NVFP4 and not self.dynamic

    @property
    def calibrated_amax(self) -> bool:
        """Whether the format scales by a stored (calibrated) amax: all but MX and dynamic blocks / per-token
        amax; NVFP4's global amax is calibrated even where its blocks are dynamic."""
        return self.kind != Kind.MX and (not self.dynamic or self.kind == Kind.NVFP4)

    @property
    def per_block_amax(self) -> bool:
        """Whether the stored amax holds one value per block (NVFP4's stored amax is its global one)."""
        return self.block is not None and self.kind != Kind.NVFP4

    def per_tensor_amax(self, axis: tuple[int, ...] | int | None) -> bool:
        """Whether the stored amax is one value: no blocks and no ``axis`` (a per-channel amax keeps ``axis``),
        or NVFP4, whose stored amax is its global amax."""
        return self.kind == Kind.NVFP4 or (self.block is None and axis is None)

    @property
    def scale_from_amax(self) -> bool:
        """Whether export derives the stored scale from the amax it is given (FP8, static FP8 blocks); MX and
        NVFP4 scales come from the blocks of the weight, INT's from the reference formulas."""
        return self.kind == Kind.FP8 or (self.kind == Kind.FP8_BLOCK and not self.dynamic)


def describe(spec: FormatSpec | None) -> str:
    """A short readable form of a spec for error messages."""
    if spec is None:
        return "disabled"
    parts = [spec.kind.value, f"num_bits={spec.num_bits}" if spec.element is None else f"element={spec.element}"]
    if spec.block is not None:
        parts.append(f"block={spec.block}")
    if spec.dynamic:
        parts.append("dynamic")
    if spec.pow2:
        parts.append("pow2")
    return " ".join(parts)


def is_nvfp4(spec: FormatSpec) -> bool:
    """NVFP4 in blocks of 16."""
    return spec.kind == Kind.NVFP4 and spec.block == (16,)
