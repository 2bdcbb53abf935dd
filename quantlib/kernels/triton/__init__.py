"""Triton kernels of every op (the "triton" backend): fused block amax + scale + cast, fused fake quant.

Importing this package registers the implementations (see :mod:`quantlib.kernels.backends`); it needs
the ``triton`` package and is imported only when the triton backend is resolved.
"""

from . import impl  # noqa: F401  (registers the "triton" implementations)
from .impl import block_amax, fake_quant, fp8_blockwise_cast, fp8_cast, mx_cast, nvfp4_cast

__all__ = ["block_amax", "fake_quant", "fp8_blockwise_cast", "fp8_cast", "mx_cast", "nvfp4_cast"]
