"""Containers of quantizers: SequentialQuantizer (a chain over one tensor) and GroupedQuantizer (one
member per GEMM of a grouped linear, e.g. per MoE expert), sharing one base."""

from __future__ import annotations

from typing import Iterable, Iterator, Optional, Sequence, Union

import torch
from torch import nn

from ..config import QuantizerAttributeConfig
from .tensor_quantizer import TensorQuantizer

Quantizer = Union[TensorQuantizer, "SequentialQuantizer", "GroupedQuantizer"]


class QuantizerContainer:
    """Mixin for an ``nn.Module`` container of quantizers: lifecycle calls go to every member; ``amax`` reads
    the first member; ``is_enabled`` is true where any member is enabled (a container whose first member is off
    may still change the tensor: what a check of "is this quantized?" must see)."""

    def _broadcast(self, method: str, *args) -> None:
        for m in self.members():
            getattr(m, method)(*args)

    def enable(self) -> None:
        self._broadcast("enable")

    def disable(self) -> None:
        self._broadcast("disable")

    def enable_quant(self) -> None:
        self._broadcast("enable_quant")

    def disable_quant(self) -> None:
        self._broadcast("disable_quant")

    def enable_calib(self) -> None:
        self._broadcast("enable_calib")

    def disable_calib(self) -> None:
        self._broadcast("disable_calib")

    def reset_amax(self) -> None:
        self._broadcast("reset_amax")

    def load_calib_amax(self) -> None:
        self._broadcast("load_calib_amax")

    def members(self) -> Iterator[nn.Module]:
        return iter(self)  # type: ignore[call-overload]

    def leaves(self) -> Iterator[TensorQuantizer]:
        """Every TensorQuantizer inside, depth first."""
        for m in self.members():
            if isinstance(m, QuantizerContainer):
                yield from m.leaves()
            else:
                yield m

    @property
    def is_enabled(self) -> bool:
        return any(m.is_enabled for m in self.members())

    @property
    def amax(self) -> Optional[torch.Tensor]:
        return next(iter(self.members())).amax

    @amax.setter
    def amax(self, value: Optional[torch.Tensor]) -> None:
        for m in self.members():
            m.amax = value

    @property
    def needs_calibration(self) -> bool:
        return any(q.needs_calibration for q in self.leaves())


class SequentialQuantizer(QuantizerContainer, nn.Sequential):
    """Chains its members over one tensor (e.g. W4A8: INT4 blocks, then FP8). Member i is calibrated on
    the output of members < i."""

    def __init__(self, *quantizers: TensorQuantizer) -> None:
        if not quantizers or not all(isinstance(q, TensorQuantizer) for q in quantizers):
            raise TypeError("SequentialQuantizer takes one or more TensorQuantizers")
        super().__init__(*quantizers)

    @classmethod
    def from_configs(cls, attrs: Sequence[Union[QuantizerAttributeConfig, dict]]) -> "SequentialQuantizer":
        return cls(*(TensorQuantizer(a) for a in attrs))

    def set_from_attribute_config(self, attrs: Union[Sequence, dict, QuantizerAttributeConfig]) -> None:
        """A list sets member i from item i (lengths must match); one config or ``{"enable": b}`` goes to all."""
        if isinstance(attrs, (list, tuple)):
            if len(attrs) != len(self):
                raise ValueError(f"SequentialQuantizer of {len(self)} members given {len(attrs)} configs")
            for m, a in zip(self, attrs):
                m.set_from_attribute_config(a)
        else:
            for m in self:
                m.set_from_attribute_config(attrs)

    @torch.no_grad()
    def calibrate(self, x: torch.Tensor) -> None:
        """Calibrate member by member on one tensor (a weight)."""
        # no graph: a weight that requires grad would otherwise take the autograd path of the op
        for m in self:
            m.calibrate(x)
            x = m(x) if m.is_enabled else x

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = x
        for m in self:
            if m.is_enabled and m._if_calib:
                m.collect(y)
                y = m.running_amax_quant(y)  # the next member calibrates on this member's output
            else:
                y = m(y)
        # with quantization switched off (calibration runs on the unquantized model), pass x through
        return x if all(not m._if_quant for m in self if m.is_enabled) else y


class GroupedQuantizer(QuantizerContainer, nn.ModuleList):
    """One independent member per tensor of a group: ``self[i]`` quantizes tensor i (expert i's weight).

    There is no chained forward; calibration, restore and reset act on each member with its own tensor.
    """

    def __init__(self, *quantizers: Union[nn.Module, Iterable[nn.Module]]) -> None:
        """``GroupedQuantizer(q0, q1, ...)`` as ModelOpt writes it, or ``GroupedQuantizer([q0, q1, ...])``."""
        if len(quantizers) == 1 and not isinstance(quantizers[0], nn.Module) and isinstance(quantizers[0], Iterable):
            quantizers = tuple(quantizers[0])  # the list form
        if not quantizers:
            raise ValueError("GroupedQuantizer needs at least one member")
        for q in quantizers:
            if not isinstance(q, (TensorQuantizer, SequentialQuantizer)):
                raise TypeError(f"GroupedQuantizer members are TensorQuantizer or SequentialQuantizer, got {type(q).__name__}")
        super().__init__(quantizers)

    @classmethod
    def from_config(cls, attrs: Union[QuantizerAttributeConfig, dict, Sequence], num: int) -> "GroupedQuantizer":
        return cls([build_quantizer(attrs) for _ in range(num)])

    def set_from_attribute_config(self, attrs) -> None:
        for m in self:
            m.set_from_attribute_config(attrs)

    def calibrate(self, tensors: Sequence[torch.Tensor]) -> None:
        """Member i calibrates on ``tensors[i]`` alone."""
        if len(tensors) != len(self):
            raise ValueError(f"GroupedQuantizer of {len(self)} members given {len(tensors)} tensors")
        for m, t in zip(self, tensors):
            m.calibrate(t)

    def forward(self, *args, **kwargs):
        raise TypeError("GroupedQuantizer has no forward: quantize tensor i with quantizer[i]")


def build_quantizer(attrs: Union[QuantizerAttributeConfig, dict, Sequence]) -> Union[TensorQuantizer, SequentialQuantizer]:
    """A TensorQuantizer for one config, a SequentialQuantizer for a list of them."""
    if isinstance(attrs, (list, tuple)):
        return SequentialQuantizer.from_configs(attrs)
    return TensorQuantizer(attrs)


def fits(quantizer: nn.Module, attrs) -> bool:
    """Whether ``quantizer``'s structure can take ``attrs`` without being rebuilt."""
    if isinstance(attrs, (list, tuple)):
        return isinstance(quantizer, SequentialQuantizer) and len(quantizer) == len(attrs)
    return isinstance(quantizer, TensorQuantizer)
