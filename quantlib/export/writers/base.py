"""What every export format module provides: checks of the quantizers it can carry, ``pack`` and ``config``."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch

from ...formats import FormatSpec, Kind, QuantizedTensor
from ...formats.spec import describe, is_nvfp4
from ..types import ExportError, ExportFormat


@dataclass(frozen=True)
class Scheme:
    """One scheme of an export and the modules (checkpoint names) that carry it."""

    weight_spec: FormatSpec
    input_spec: Optional[FormatSpec]
    per_tensor: bool
    modules: tuple[str, ...]
    experts: tuple[str, ...] = ()  # those of ``modules`` that are MoE experts


@dataclass
class ConfigInfo:
    """What a format's ``config`` needs to know about the export as a whole."""

    weight_spec: FormatSpec
    input_spec: Optional[FormatSpec]  # None: activations not quantized
    weight_per_tensor: bool = False  # one amax per weight (no channels, no blocks)
    ignore: list[str] = field(default_factory=list)  # full names of modules left unquantized
    experts_off: list[str] = field(default_factory=list)  # those of ``ignore`` that are experts modules written whole (3-D)
    producer_version: str = ""
    kv_spec: Optional[FormatSpec] = None  # the KV-cache quantizers' spec; None: KV cache not quantized
    pre_quant_scale: bool = False  # some module carries a pre_quant_scale tensor (one that folds nowhere)
    schemes: tuple[Scheme, ...] = ()  # every scheme of the export, in module order (one unless the format is mixed)


class Packer:
    """Base of the format modules. ``weight_ok`` / ``input_ok`` say what the format carries."""

    fmt: ExportFormat
    #: why no consumer reads a quantized key saved of several modules (q / k / v as one query_key_value); None: vLLM does
    rows_within_why: Optional[str] = ("transformers 5.25 loads such a key's codes as the split weights and drops its scales as "
                                      "unexpected keys; no other consumer of this format was checked")
    #: True where the consumer fuses siblings (q/k/v, gate/up) under one per-tensor (global) scale
    siblings_share_global: bool = False
    #: where the consumer needs a static input scale: the message that says which input quantizer to enable
    input_required: Optional[str] = None
    #: why the consumer cannot load MoE experts in this format (None: it can)
    experts_why: Optional[str] = None
    #: True where the format has a per-linear ``pre_quant_scale`` tensor (ModelOpt's AWQ formats)
    carries_pre_quant_scale: bool = False
    #: True where one export may carry several schemes (:mod:`.mixed`)
    mixed: bool = False
    #: True where the format carries a quantized fused-experts module whole, as the checkpoint stores it (3-D)
    stores_fused_experts: bool = False
    #: True where ``pack`` of a 3-D (E, out, in) weight gives each expert's 2-D tensors stacked on dim 0, rows on dim 1 (the RL
    #: sync then casts a stacked projection in one call)
    packs_stacks: bool = False
    #: the item roles the format quantizes (None: any) and why it takes no others
    roles: Optional[frozenset] = None
    roles_why: str = ""
    #: the ``config.model_type`` values the format's consumers read it for (None: any)
    model_types: Optional[frozenset] = None
    #: why no consumer reads this format's weights of a module the checkpoint stores (in, out) (GPT-2's ``Conv1D``;
    #: None: vLLM's GPT-2 loader does, :mod:`quantlib.export.transposed`)
    transposed_why: Optional[str] = None

    def member_for(self, spec: FormatSpec) -> "Packer":
        """The single-scheme packer whose consumer reads weights of ``spec`` in this format: itself, or a mixed format's member."""
        return self

    def weight_ok(self, spec: FormatSpec, amax_shape: tuple[int, ...]) -> Optional[str]:
        """None if the format carries a weight quantizer of ``spec``; else why not."""
        raise NotImplementedError

    def input_ok(self, spec: FormatSpec) -> Optional[str]:
        """None if the format carries an (enabled) input quantizer of ``spec``; else why not."""
        return "this format has no activation quantization of that kind"

    def check(self, weight: FormatSpec, amax_shape: tuple[int, ...], inp: Optional[FormatSpec], weight_name: str, input_name: str) -> None:
        """Refuse what the format cannot carry, naming the quantizer (full name) and its value."""
        why = self.weight_ok(weight, amax_shape)
        if why is not None:
            raise ExportError(f"{weight_name} = {describe(weight)}: format {self.fmt.value} cannot carry it ({why})")
        if inp is None and self.input_required is not None:
            raise ExportError(f"{input_name} = disabled: format {self.fmt.value} needs {self.input_required}")
        if inp is not None:
            why = self.input_ok(inp)
            if why is not None:
                raise ExportError(f"{input_name} = {describe(inp)}: format {self.fmt.value} cannot carry it ({why}); disable the input "
                                  "quantizer or pick another format")

    def chain_ok(self, second: Optional[FormatSpec], amax_shape: tuple[int, ...]) -> Optional[str]:
        """None if the format carries a weight whose chained second quantizer is ``second`` (None: no chain,
        a single quantizer); else why not."""
        return None if second is None else "it has no second weight scale for a chain (INT4 then FP8: format modelopt_w4a8_awq)"

    def shares_global(self, spec: FormatSpec, inp: Optional[FormatSpec]) -> bool:
        """Whether the consumer fuses siblings of this scheme under one per-tensor (global) scale."""
        return self.siblings_share_global

    def transposed_ok(self, spec: FormatSpec) -> Optional[str]:
        """None if a consumer reads weights of ``spec`` of a module stored (in, out) in this format; else why not."""
        return self.transposed_why

    def key_ok(self, key: str, model_type: Optional[str], quantized: bool) -> Optional[str]:
        """None if the format's consumers load checkpoint key ``key`` (of a ``model_type`` model; ``quantized``: a quantized
        module's weight) as written; else why not."""
        return None

    def pre_quant_scale_ok(self, info: ConfigInfo) -> Optional[str]:
        """None if the format carries ``pre_quant_scale`` tensors in an export of ``info``; else why not."""
        return None if self.carries_pre_quant_scale else "it has no pre_quant_scale tensor"

    def pack(self, q: QuantizedTensor) -> dict[str, torch.Tensor]:
        """The checkpoint tensors of one quantized weight (local names)."""
        raise NotImplementedError

    def pack_experts(self, proj: str, q: QuantizedTensor) -> dict[str, torch.Tensor]:
        """The tensors of projection ``proj`` of every expert of a stored-fused experts module (``q``: 3-D)."""
        raise ExportError(f"format {self.fmt.value} does not carry fused-experts modules whole")

    def pack_chain(self, spec: FormatSpec, amax: Optional[torch.Tensor]) -> dict[str, torch.Tensor]:
        """The checkpoint tensors of a weight's chained second quantizer; only called where ``chain_ok`` accepted."""
        raise NotImplementedError

    def pack_input(self, spec: FormatSpec, amax: Optional[torch.Tensor]) -> dict[str, torch.Tensor]:
        """The checkpoint tensors of a module's static input quantizer (none by default)."""
        return {}

    def kv_ok(self, spec: FormatSpec, amax_shape: tuple[int, ...]) -> Optional[str]:
        """None if the format carries a KV-cache quantizer of ``spec``; else why not (here: no place at all)."""
        return "this format has no place for KV-cache scales"

    def pack_kv(self, spec: FormatSpec, k_amax: torch.Tensor, v_amax: torch.Tensor) -> dict[str, torch.Tensor]:
        """The attention module's KV scale tensors (local names); only called where ``kv_ok`` accepted."""
        raise NotImplementedError

    def config(self, info: ConfigInfo) -> dict:
        """The ``quantization_config`` of config.json."""
        raise NotImplementedError

    def extra_files(self, info: ConfigInfo) -> dict[str, dict]:
        return {}


def is_fp8_block_2d(spec: FormatSpec) -> bool:
    """FP8 E4M3 in 2-D blocks."""
    return spec.kind == Kind.FP8_BLOCK and spec.element == (4, 3) and spec.block is not None and len(spec.block) == 2


def is_mx(spec: FormatSpec, element: tuple[int, int]) -> bool:
    """MX of ``element`` (e.g. (4, 3) for MXFP8) in OCP blocks of 32."""
    return spec.kind == Kind.MX and spec.element == element and spec.block == (32,)


def fp8_block_weight_ok(spec: FormatSpec) -> Optional[str]:
    """Why a 2-D FP8-block format cannot carry this weight quantizer, or None where it can."""
    if not is_fp8_block_2d(spec):
        return "needs FP8 E4M3 weights in 2-D blocks, e.g. block_sizes {-1: 128, -2: 128}"
    return None


class MXFP8Packer(Packer):
    """MXFP8 weights (E4M3 elements, E8M0 scales per 32) and activations, as plain codes and scale bytes;
    a format names its scale tensor (``scale_key``) and says how it takes activations (``input_why``)."""

    scale_key: str = "weight_scale"
    packs_stacks = True
    input_why: str = "activations must be MXFP8 (dynamic, per 32)"

    def weight_ok(self, spec: FormatSpec, amax_shape: tuple[int, ...]) -> Optional[str]:
        return None if is_mx(spec, (4, 3)) else "needs MXFP8 weights (E4M3 elements, E8M0 scales per 32)"

    def input_ok(self, spec: FormatSpec) -> Optional[str]:
        return None if is_mx(spec, (4, 3)) else self.input_why

    def pack(self, q: QuantizedTensor) -> dict[str, torch.Tensor]:
        return {"weight": q.codes, self.scale_key: q.scale}


class NVFP4Packer(Packer):
    """NVFP4 weights (E2M1, E4M3 scales per 16) and activations; siblings share the global scale. A format
    packs its own tensors (names, form of the global scale) and says how it takes activations (``input_why``)."""

    siblings_share_global = True
    input_why: str

    def weight_ok(self, spec: FormatSpec, amax_shape: tuple[int, ...]) -> Optional[str]:
        return None if is_nvfp4(spec) else "needs NVFP4 weights (E2M1, E4M3 scales per 16)"

    def input_ok(self, spec: FormatSpec) -> Optional[str]:
        return None if is_nvfp4(spec) else self.input_why
