"""Mixed precision: one export whose modules carry several schemes of one consumer family (NVFP4 experts
and FP8 attention, W4A16 MLP and FP8 attention). Each weight quantizer goes to the first member format
that carries it; the config lists every scheme with the modules it covers."""

from __future__ import annotations

from dataclasses import replace
from typing import Optional

import torch

from ...formats import FormatSpec, QuantizedTensor
from ...formats.spec import describe
from ..types import ExportError
from .base import ConfigInfo, Packer, Scheme


class MixedPacker(Packer):
    """Dispatches to its ``members`` (single-scheme packers of one family) by spec."""

    members: tuple[Packer, ...] = ()
    mixed = True

    def member(self, spec: FormatSpec, amax_shape: tuple[int, ...] = (), inp: Optional[FormatSpec] = None) -> Optional[Packer]:
        """The first member that carries a weight quantizer of ``spec`` (and input ``inp``), or None."""
        for m in self.members:
            if m.weight_ok(spec, amax_shape) is None and (inp is None
                                                          or m.input_ok(inp) is None) and (inp is not None or m.input_required is None):
                return m
        return None

    def weight_ok(self, spec: FormatSpec, amax_shape: tuple[int, ...]) -> Optional[str]:
        if self.member(spec, amax_shape) is not None:
            return None
        return "; ".join(f"{m.fmt.value}: {m.weight_ok(spec, amax_shape) or 'not with this input'}" for m in self.members)

    def check(self, weight: FormatSpec, amax_shape: tuple[int, ...], inp: Optional[FormatSpec], weight_name: str, input_name: str) -> None:
        m = self.member(weight, amax_shape, inp)
        if m is None:
            why = "; ".join(f"{p.fmt.value}: "
                            f"{p.weight_ok(weight, amax_shape) or (p.input_ok(inp) if inp is not None else p.input_required)}"
                            for p in self.members)
            raise ExportError(f"{weight_name} = {describe(weight)} / {input_name} = {describe(inp)}: no member of format {self.fmt.value} "
                              f"carries it ({why})")
        if self._packing(weight) is not m:  # pack() picks by spec alone: it must land on the same member
            raise ExportError(f"{weight_name} = {describe(weight)}: format {self.fmt.value} cannot tell which member packs it (amax of "
                              f"shape {amax_shape})")
        m.check(weight, amax_shape, inp, weight_name, input_name)

    def pack(self, q: QuantizedTensor) -> dict[str, torch.Tensor]:
        return self._of(q.spec).pack(q)

    def pack_input(self, spec: FormatSpec, amax: Optional[torch.Tensor]) -> dict[str, torch.Tensor]:
        m = next((p for p in self.members if p.input_ok(spec) is None), None)
        return {} if m is None else m.pack_input(spec, amax)

    def shares_global(self, spec: FormatSpec, inp: Optional[FormatSpec]) -> bool:
        m = self.member(spec, (), inp)
        return m is not None and m.shares_global(spec, inp)

    def member_for(self, spec: FormatSpec) -> Packer:
        return self._packing(spec) or self  # the member's consumer reads those weights, as in a single-scheme export

    def transposed_ok(self, spec: FormatSpec) -> Optional[str]:
        m = self._packing(spec)
        return None if m is None else m.transposed_ok(spec)

    def kv_ok(self, spec: FormatSpec, amax_shape: tuple[int, ...]) -> Optional[str]:
        return self.members[0].kv_ok(spec, amax_shape)

    def pack_kv(self, spec: FormatSpec, k_amax: torch.Tensor, v_amax: torch.Tensor) -> dict[str, torch.Tensor]:
        return self.members[0].pack_kv(spec, k_amax, v_amax)

    def pre_quant_scale_ok(self, info: ConfigInfo) -> Optional[str]:
        return "a mixed-precision export carries no pre_quant_scale tensor"

    def _packing(self, spec: FormatSpec) -> Optional[Packer]:
        """The member that packs weights of ``spec``: the first that carries them, whatever input it needs
        (pack sees the weight alone; :meth:`check` makes sure it is the member that carries the input too)."""
        return next((m for m in self.members if m.weight_ok(spec, ()) is None), None)

    def _of(self, spec: FormatSpec) -> Packer:
        m = self._packing(spec)
        if m is None:
            raise ExportError(f"format {self.fmt.value}: no member packs {describe(spec)}")
        return m

    def parts(self, info: ConfigInfo) -> list[tuple[Packer, Scheme, ConfigInfo]]:
        """(member, scheme, the member's single-scheme info) of every scheme of the export."""
        return [(self.member(s.weight_spec, (), s.input_spec), s, replace(info, weight_spec=s.weight_spec, input_spec=s.input_spec,
                                                                          weight_per_tensor=s.per_tensor)) for s in info.schemes]
