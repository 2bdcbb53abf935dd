"""Hugging Face fine-grained FP8 (``quant_method: "fp8"``, transformers ``finegrained_fp8``, vLLM ``fp8``).

``weight`` float8_e4m3fn [out, in]; ``weight_scale_inv`` fp32 [ceil(out/bm), ceil(in/bn)] = quantlib's
dequant scale ``d`` (``w = fp8 * d`` per block). The ``ue8m0`` variant (``scale_fmt: "ue8m0"``) needs a
``pow2_scale`` quantizer and stores its power-of-two scales in fp32, as DeepSeek-V3.1 ships them: vLLM's
generic fp8 loader ignores ``scale_fmt`` and would read E8M0 bytes as numbers (byte 120 as 120.0, not
2^-7), while transformers reads either form. Activations are
quantized dynamically by the consumer (``activation_scheme: "dynamic"``, all vLLM allows with blocks).
Unquantized modules go to ``ignored_layers``: vLLM's key, which transformers reads as its
``modules_to_not_convert``.
"""

from __future__ import annotations

import re
from typing import Optional

import torch

from ...formats import FormatSpec, Kind, QuantizedTensor
from ..types import ExportFormat
from .base import ConfigInfo, Packer, fp8_block_weight_ok

#: what transformers' fine-grained FP8 quantizer renames to ``weight_scale_inv`` on load, whatever the tensor (5.x: checkpoints
#: that ship block scales as ``<module>.scale`` or ``.qscale_weight``); Inkling-2's own ``.scale`` tensors are spared
_SCALE = re.compile(r"^(.+)\.scale(?!\w)")
_QSCALE = re.compile(r"\.qscale_weight(?!\w)")
#: its dequantization pairs a weight with its scale by the first "weight" that ends a name in the key: in a module named
#: ``*weight`` (Qwen4-exp's ``block_inject_weight``) that is the module's name, and the scale is left out
_INNER_WEIGHT = re.compile(r"weight(?!\w)")


def finegrained_key_ok(key: str, model_type: Optional[str], quantized: bool) -> Optional[str]:
    """Why transformers' fine-grained FP8 loader (``quant_method`` fp8 / mxfp8) would not load ``key`` as written
    (``quantized``: a quantized module's weight), or None."""
    if quantized and _INNER_WEIGHT.search(key.rpartition(".")[0]):
        return ("transformers' fine-grained FP8 loader pairs a weight with its weight_scale_inv by the first name ending in "
                "'weight' in the key, here the module's own, so it would load the FP8 codes without their scales")
    spared = model_type is not None and model_type.startswith("inkling2")
    if _QSCALE.search(key) is None and (spared or _SCALE.search(key) is None):
        return None
    return ("transformers' fine-grained FP8 loader renames every '<module>.scale' / '.qscale_weight' key to the module's "
            "weight_scale_inv on load, so this tensor would be missing from the loaded model")


class HFFP8Block(Packer):
    fmt = ExportFormat.HF_FP8_BLOCK
    ue8m0 = False
    packs_stacks = True

    def weight_ok(self, spec: FormatSpec, amax_shape: tuple[int, ...]) -> Optional[str]:
        why = fp8_block_weight_ok(spec)
        if why is None and self.ue8m0 and not spec.pow2:
            why = "ue8m0 scales need power-of-two block scales (pow2_scale=True)"
        return why

    def input_ok(self, spec: FormatSpec) -> Optional[str]:
        if spec.dynamic and spec.kind in (Kind.FP8, Kind.FP8_BLOCK) and spec.element == (4, 3):
            return None
        return "activations are quantized dynamically to FP8 E4M3 by the consumer"

    def pack(self, q: QuantizedTensor) -> dict[str, torch.Tensor]:
        return {"weight": q.codes, "weight_scale_inv": q.scale.float()}

    def key_ok(self, key: str, model_type: Optional[str], quantized: bool) -> Optional[str]:
        return finegrained_key_ok(key, model_type, quantized)

    def config(self, info: ConfigInfo) -> dict:
        cfg = {"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": list(info.weight_spec.block),
               "ignored_layers": list(info.ignore)}
        if self.ue8m0:
            cfg["scale_fmt"] = "ue8m0"
        return cfg


class HFFP8BlockUE8M0(HFFP8Block):
    fmt = ExportFormat.HF_FP8_BLOCK_UE8M0
    ue8m0 = True
