"""Hugging Face ``quant_method: "mxfp8"`` (transformers maps it onto the fine-grained FP8 quantizer).

``weight`` float8_e4m3fn [out, in]; ``weight_scale_inv`` uint8 E8M0 bytes [out, in/32] (``2^(b-127)``);
``weight_block_size: [1, 32]``, ``scale_fmt: "ue8m0"``: transformers views byte scales as E8M0 only then, and on
its quantized (GPU) path would otherwise multiply by the byte (120 for 2^-7); its CPU path dequantizes either way.
vLLM cannot read this format: its ``mxfp8`` is ModelOpt's MXFP8 loader, which names the scale ``weight_scale`` and
rejects ``weight_scale_inv``; the MXFP8 formats vLLM reads are ``ct_mxfp8`` (transformers too) and ``modelopt_mxfp8``.
"""

from __future__ import annotations

from typing import Optional

from ..types import ExportFormat
from .base import ConfigInfo, MXFP8Packer
from .hf_fp8 import finegrained_key_ok


class HFMXFP8(MXFP8Packer):
    fmt = ExportFormat.HF_MXFP8
    transposed_why = ("its one consumer, transformers, converts nn.Linear weights only and fails on GPT-2's Conv1D, and vLLM reads "
                      "MXFP8 as ct_mxfp8 / modelopt_mxfp8 only")
    scale_key = "weight_scale_inv"
    input_why = "activations are MXFP8, quantized dynamically by the consumer"

    def key_ok(self, key: str, model_type: Optional[str], quantized: bool) -> Optional[str]:
        return finegrained_key_ok(key, model_type, quantized)

    def config(self, info: ConfigInfo) -> dict:
        return {"quant_method": "mxfp8", "activation_scheme": "dynamic", "weight_block_size": [1, 32], "scale_fmt": "ue8m0",
                "ignored_layers": list(info.ignore)}
