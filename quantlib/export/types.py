"""The vocabulary of export: the closed set of formats, one packed weight, errors, the manifest."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Optional, Union

import torch

from ..errors import ExportError as ExportError  # the export layer's name for it (raised by quantlib.kv too)


class ExportFormat(str, enum.Enum):
    """Every on-disk / on-wire format quantlib writes (one module each in :mod:`quantlib.export.writers`)."""

    HF_FP8_BLOCK = "hf_fp8_block"  # transformers fine-grained FP8: fp32 weight_scale_inv per 2-D block
    HF_FP8_BLOCK_UE8M0 = "hf_fp8_block_ue8m0"  # same, power-of-two scales stored as E8M0 bytes
    HF_MXFP8 = "hf_mxfp8"  # transformers quant_method "mxfp8": E8M0 bytes per 1x32
    CT_FP8_BLOCK = "ct_fp8_block"  # compressed-tensors float-quantized, strategy block
    CT_NVFP4 = "ct_nvfp4"  # compressed-tensors nvfp4-pack-quantized
    CT_MXFP4 = "ct_mxfp4"  # compressed-tensors mxfp4-pack-quantized
    CT_MXFP8 = "ct_mxfp8"  # compressed-tensors mxfp8-quantized
    CT_INT_PACK = "ct_int_pack"  # compressed-tensors pack-quantized (INT4 W4A16, int32 words)
    CT_INT8 = "ct_int8"  # compressed-tensors int-quantized
    CT_MIXED = "ct_mixed"  # compressed-tensors, one config group per scheme (mixed precision)
    MODELOPT_FP8 = "modelopt_fp8"  # ModelOpt unified HF, quant_algo FP8 (per tensor)
    MODELOPT_FP8_PB = "modelopt_fp8_pb"  # ModelOpt FP8_PB_WO (128x128 blocks, 4-D scales)
    MODELOPT_NVFP4 = "modelopt_nvfp4"  # ModelOpt NVFP4 / W4A16_NVFP4
    MODELOPT_MXFP8 = "modelopt_mxfp8"  # ModelOpt MXFP8
    MODELOPT_INT4_AWQ = "modelopt_int4_awq"  # ModelOpt W4A16_AWQ: INT4 two rows per byte, pre_quant_scale
    MODELOPT_W4A8_AWQ = "modelopt_w4a8_awq"  # ModelOpt W4A8_AWQ: INT4 as W4A16_AWQ, FP8 weight_scale_2 and input_scale
    MODELOPT_MIXED = "modelopt_mixed"  # ModelOpt MIXED_PRECISION: quantized_layers names each layer's algorithm
    OPENAI_MXFP4 = "openai_mxfp4"  # OpenAI's GPT-OSS checkpoint: MXFP4 experts as <proj>_blocks / <proj>_scales


#: "linear" (a quantized dense weight), "expert" (one expert's quantized weight), "experts" (one projection of every
#: expert of a fused-experts module the checkpoint keeps 3-D), "unquantized" (passed through), "kv" (an attention
#: module's KV-cache scales)
Role = str


@dataclass(frozen=True)
class PackedWeight:
    """One checkpoint module's tensors, keyed by local name (``weight``, ``weight_scale_inv``, ``bias``...).

    ``shard`` is the id a fused loader (vLLM) takes: ``"q"``/``"k"``/``"v"``, ``0``/``1`` for a merged
    gate/up linear, ``"w1"``/``"w3"``/``"w2"`` for experts; None where nothing fuses. ``expert`` is the
    global expert id, or None.
    """

    name: str
    tensors: dict[str, torch.Tensor]
    role: Role
    expert: Optional[int] = None
    shard: Optional[Union[str, int]] = None

    def items(self) -> list[tuple[str, torch.Tensor]]:
        """``(full checkpoint key, tensor)`` pairs."""
        return [(f"{self.name}.{k}" if self.name else k, t) for k, t in self.tensors.items()]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors.values())


@dataclass
class ExportManifest:
    """What :func:`~quantlib.export.export_checkpoint` wrote."""

    out_dir: str
    format: ExportFormat
    files: list[str] = field(default_factory=list)
    num_bytes: int = 0
    quantized_modules: list[str] = field(default_factory=list)
    unquantized_modules: list[str] = field(default_factory=list)
    #: sibling group (checkpoint names) -> the amax they now share, for each group ``unify_siblings`` changed
    unified_siblings: dict[tuple[str, ...], float] = field(default_factory=dict)
