"""One module per export format; :func:`packer` finds a format's packer (a closed registry)."""

from __future__ import annotations

from ..types import ExportError, ExportFormat
from .base import ConfigInfo, Packer
from .ct_fp8_block import CTFP8Block
from .ct_int8 import CTInt8
from .ct_int_pack import CTIntPack
from .ct_mixed import CTMixed
from .ct_mxfp4 import CTMXFP4
from .ct_mxfp8 import CTMXFP8
from .ct_nvfp4 import CTNVFP4
from .hf_fp8 import HFFP8Block, HFFP8BlockUE8M0
from .hf_mxfp8 import HFMXFP8
from .modelopt_fp8 import ModelOptFP8
from .modelopt_fp8_pb import ModelOptFP8PB
from .modelopt_int4_awq import ModelOptInt4AWQ
from .modelopt_mixed import ModelOptMixed
from .modelopt_mxfp8 import ModelOptMXFP8
from .modelopt_nvfp4 import ModelOptNVFP4
from .modelopt_w4a8_awq import ModelOptW4A8AWQ
from .openai_mxfp4 import OpenAIMXFP4

_PACKERS: dict[ExportFormat, Packer] = {p.fmt: p for p in (
    HFFP8Block(), HFFP8BlockUE8M0(), HFMXFP8(), CTFP8Block(), CTNVFP4(), CTMXFP4(), CTMXFP8(), CTIntPack(), CTInt8(), ModelOptFP8(),
    ModelOptFP8PB(), ModelOptNVFP4(), ModelOptMXFP8(), ModelOptInt4AWQ(), ModelOptW4A8AWQ(), CTMixed(), ModelOptMixed(), OpenAIMXFP4(),
)}  # fmt: skip
assert set(_PACKERS) == set(ExportFormat), "every ExportFormat has one packer"


def as_format(fmt: "ExportFormat | str") -> ExportFormat:
    """``fmt`` as an :class:`ExportFormat`; an unknown name raises :class:`ExportError` listing the known ones."""
    try:
        return ExportFormat(fmt)
    except ValueError:
        raise ExportError(f"unknown export format {fmt!r}; one of {[f.value for f in ExportFormat]}") from None


def packer(fmt: "ExportFormat | str") -> Packer:
    """The packer of ``fmt`` (an :class:`ExportFormat` or its value)."""
    return _PACKERS[as_format(fmt)]


__all__ = ["ConfigInfo", "Packer", "as_format", "packer"]
