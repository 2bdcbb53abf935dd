"""Max calibration's collector: the running maximum of the amax a quantizer would use, per tensor / channel / block."""

from __future__ import annotations

from typing import Optional

import torch

from ..formats import FormatSpec, blocked_shape
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
    if spec.per_tensor_amax(axis):
        return abs_max(x)
    if spec.block is not None:
        return block_amax(x, spec.block, backend=backend)
    reduced = reduce_axes(axis, x.dim())
    if not reduced:  # every axis kept: one amax per element (dim=() would reduce them all)
        return x.abs().float()
    return abs_max(x, reduced)


def abs_max(x: torch.Tensor, dims: Optional[tuple[int, ...]] = None) -> torch.Tensor:
    """fp32 max |x| over ``dims`` (None: all; kept as size 1), exactly, with NaN propagating.

    max |x| is max(max x, -min x), made +0.0 where both are zeros. One pass (``aminmax``) over the whole
    tensor; per channel two reduction passes on the CPU, where they are still an order of magnitude faster
    than the inf-norm (benchmarks/RESULTS.md, the CPU calibration runs), and the one-pass inf-norm on
    accelerators, where bandwidth is what counts."""
    if x.numel() == 0 or (dims is not None and x.device.type != "cpu"):
        return torch.linalg.vector_norm(x, float("inf"), dim=dims, keepdim=dims is not None).float()
    if dims is None:
        lo, hi = torch.aminmax(x)
    else:
        lo, hi = x.amin(dim=dims, keepdim=True), x.amax(dim=dims, keepdim=True)
    return torch.maximum(hi, lo.neg()).abs().float()


def static_amax_shape(spec: FormatSpec, axis: Optional[tuple[int, ...]], shape: tuple[int, ...]) -> tuple[int, ...]:
    """Shape :func:`static_amax` returns for an input of ``shape``."""
    if spec.per_tensor_amax(axis):
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
        self._maybe_empty = False

    def collect(self, amax: torch.Tensor, maybe_empty: bool = False) -> None:
        """Add one batch's amax. ``maybe_empty``: the batch may have held no values, marked by an amax of
        -inf (which no |x| gives): for a collector fed on the device, e.g. per expert from rows sorted
        by expert, which cannot skip an expert without reading its count back to the host."""
        if self._amax is not None and self._amax.shape != amax.shape:
            raise ValueError(f"calibration saw amax of shape {tuple(amax.shape)} after {tuple(self._amax.shape)}: inputs of a static "
                             "per-channel/block quantizer must keep their shape")
        self._amax = amax if self._amax is None else torch.maximum(self._amax, amax)
        self.num_batches += 1
        self._maybe_empty = self._maybe_empty or maybe_empty

    def compute_amax(self) -> Optional[torch.Tensor]:
        """The max so far; None before any value (a maybe-empty collector's -inf: read back here, once)."""
        if self._maybe_empty and self._amax is not None and bool(torch.isneginf(self._amax).all()):
            return None
        return self._amax

    def reset(self) -> None:
        self._amax = None
        self._maybe_empty = False
        self.num_batches = 0
