"""Max calibration: the running maximum of the amax a quantizer would use, per tensor / channel / block."""

from __future__ import annotations

from typing import Optional

import torch

from ..formats import FormatSpec, Kind, blocked_shape
from ..kernels import block_amax


def reduce_axes(kept: Optional[tuple[int, ...]], ndim: int) -> Optional[tuple[int, ...]]:
    """Axes reduced for an amax that keeps ``kept`` (None: all)."""
    if kept is None:
        return None
    norm = set()
    for a in kept:
        if not -ndim <= a < ndim:
            raise ValueError(f"axis {a} is out of range for a {ndim}-D tensor")
        norm.add(a % ndim)
    return tuple(d for d in range(ndim) if d not in norm)


def static_amax(x: torch.Tensor, spec: FormatSpec, axis: Optional[tuple[int, ...]], backend: str = "auto") -> torch.Tensor:
    """fp32 amax of ``x`` in the shape the quantizer stores: scalar, keepdim per channel, or per block
    (for NVFP4: the global amax)."""
    x = x.detach()
    # the inf-norm is max |x| in one pass without a temporary (NaN propagates, as with amax)
    if spec.kind == Kind.NVFP4 or (spec.block is None and axis is None):
        return torch.linalg.vector_norm(x, float("inf")).float()
    if spec.block is not None:
        return block_amax(x, spec.block, backend=backend)
    reduced = reduce_axes(axis, x.dim())
    if not reduced:  # every axis kept: one amax per element (dim=() would reduce them all)
        return x.abs().float()
    return torch.linalg.vector_norm(x, float("inf"), dim=reduced, keepdim=True).float()


def static_amax_shape(spec: FormatSpec, axis: Optional[tuple[int, ...]], shape: tuple[int, ...]) -> tuple[int, ...]:
    """Shape :func:`static_amax` returns for an input of ``shape``."""
    if spec.kind == Kind.NVFP4 or (spec.block is None and axis is None):
        return ()
    if spec.block is not None:
        return blocked_shape(shape, spec.block)
    reduced = reduce_axes(axis, len(shape))
    return tuple(1 if d in reduced else s for d, s in enumerate(shape))


class MaxCalibrator:
    """Keeps the elementwise max of the amax of every tensor it sees (NaN and Inf propagate, so the
    quantizer can refuse them when calibration ends)."""

    def __init__(self) -> None:
        self._amax: Optional[torch.Tensor] = None
        self.num_batches = 0

    def collect(self, amax: torch.Tensor) -> None:
        if self._amax is not None and self._amax.shape != amax.shape:
            raise ValueError(f"calibration saw amax of shape {tuple(amax.shape)} after {tuple(self._amax.shape)}: inputs of a static per-channel/block quantizer must keep their shape")
        self._amax = amax if self._amax is None else torch.maximum(self._amax, amax)
        self.num_batches += 1

    def compute_amax(self) -> Optional[torch.Tensor]:
        return self._amax

    def reset(self) -> None:
        self._amax = None
        self.num_batches = 0
