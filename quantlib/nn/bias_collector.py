"""Bias calibration for affine quantization (ModelOpt's ``bias`` attribute, e.g. ``FP8_AFFINE_KV_CFG``).

A quantizer with a bias quantizes ``x - b`` and adds ``b`` back: ``x̂ = fq(x - b) + b``, all in fp32,
cast to the input dtype at the end. ``b`` is the mean of ``x`` over the configured axes (the int keys
of ``bias`` are the axes REDUCED: ``{-2: None, -4: None}`` on a [batch, heads, seq, head dim] key
gives one bias per head and channel, of shape (1, heads, 1, head dim)), kept with size-1 dims.

As in ModelOpt 0.47, the static bias is the running average of the per-batch means (each batch counts
once, whatever its size), ``b_n = (b_{n-1} * (n-1) + m_n) / n`` in fp32, and the amax is calibrated
batch by batch on ``x - b_n``, the running bias after that batch (not on ``x - b_final``): that is
what ModelOpt computes, so a ModelOpt recipe gives the same bias and amax here. Means are taken in fp32
(ModelOpt takes them in the input dtype: bf16/fp16 inputs can differ from it in the last bits).
"""

from __future__ import annotations

from typing import Optional

import torch


def reduced_dims(axes: tuple[int, ...], ndim: int) -> tuple[int, ...]:
    """``axes`` (negative or not) as sorted non-negative dims of an ``ndim``-D tensor; an axis out of
    range or named twice raises ValueError naming it."""
    dims = []
    for a in axes:
        if not -ndim <= a < ndim:
            raise ValueError(f"bias axis {a} is out of range for a {ndim}-D tensor")
        if a % ndim in dims:
            raise ValueError(f"bias axes {axes} name dim {a % ndim} twice for a {ndim}-D tensor")
        dims.append(a % ndim)
    return tuple(sorted(dims))


def mean_bias(x: torch.Tensor, axes: tuple[int, ...]) -> torch.Tensor:
    """fp32 mean of ``x`` over ``axes`` (kept as size-1 dims)."""
    return x.detach().float().mean(dim=reduced_dims(axes, x.dim()), keepdim=True)


class BiasCalibrator:
    """The running average of per-batch means over ``axes`` (see the module docstring)."""

    def __init__(self, axes: tuple[int, ...]) -> None:
        self.axes = tuple(axes)
        self._bias: Optional[torch.Tensor] = None
        self.num_batches = 0

    def collect(self, x: torch.Tensor) -> torch.Tensor:
        """Add the mean of ``x`` to the running average and return the running bias."""
        m = mean_bias(x, self.axes)
        if self._bias is None:
            self._bias = m
        else:
            if self._bias.shape != m.shape:
                raise ValueError(f"calibration saw a bias of shape {tuple(m.shape)} after {tuple(self._bias.shape)}: the kept axes of the "
                                 "inputs must keep their size")
            self._bias = (self._bias * self.num_batches + m) / (self.num_batches + 1)
        self.num_batches += 1
        return self._bias

    def compute_bias(self) -> Optional[torch.Tensor]:
        """The bias over every batch collected so far (None before the first)."""
        return self._bias

    def reset(self) -> None:
        self._bias = None
        self.num_batches = 0


__all__ = ["BiasCalibrator", "mean_bias", "reduced_dims"]
