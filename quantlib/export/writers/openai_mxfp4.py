"""OpenAI's GPT-OSS checkpoint (``quant_method: "mxfp4"``), as transformers' Mxfp4 quantizer and vLLM's
``gpt_oss_mxfp4`` loader read it: only the MoE experts are quantized, each projection whole, as
``<experts>.<proj>_blocks`` uint8 [E, out, in/32, 16] (two E2M1 codes per byte, low nibble = even element)
and ``<proj>_scales`` uint8 E8M0 [E, out, in/32]; out is the row of the stored (interleaved gate/up) slice,
so gate/up stay interleaved as the model computes them. Everything else stays in the model's dtype."""

from __future__ import annotations

from typing import Optional

import torch

from ...formats import FormatSpec, QuantizedTensor
from ..types import ExportFormat
from .base import ConfigInfo, Packer, is_mx

#: what OpenAI's gpt-oss checkpoints list as left unquantized (transformers converts only the experts)
NOT_CONVERTED = ["model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]


class OpenAIMXFP4(Packer):
    fmt = ExportFormat.OPENAI_MXFP4
    stores_fused_experts = True
    roles = frozenset({"experts"})
    roles_why = "OpenAI's MXFP4 checkpoint quantizes the GPT-OSS experts alone; transformers and vLLM load everything else unquantized"
    model_types = frozenset({"gpt_oss"})

    def weight_ok(self, spec: FormatSpec, amax_shape: tuple[int, ...]) -> Optional[str]:
        return (
            None
            if is_mx(spec, (2, 1))
            else "needs MXFP4 weights (E2M1 elements, E8M0 scales per 32), e.g. quantlib.MXFP4_MLP_WEIGHT_ONLY_CFG"
        )

    def pack_experts(self, proj: str, q: QuantizedTensor) -> dict[str, torch.Tensor]:
        # q: every expert of one projection, codes [E, out, in/2] and scale bytes [E, out, in/32]
        return {f"{proj}_blocks": q.codes.reshape(*q.scale.shape, -1), f"{proj}_scales": q.scale}

    def config(self, info: ConfigInfo) -> dict:
        return {"quant_method": "mxfp4", "modules_to_not_convert": list(NOT_CONVERTED)}
