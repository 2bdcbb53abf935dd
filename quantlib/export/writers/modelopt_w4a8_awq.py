"""ModelOpt ``W4A8_AWQ`` (``W4A8_AWQ_BETA_CFG``: a weight chain of INT4 blocks then FP8 per tensor, FP8 per-tensor
activations), as ModelOpt's exporter writes it: ``weight`` uint8 [out/2, in] and ``weight_scale`` fp32 [out, in/G] as
in W4A16_AWQ (:mod:`.modelopt_int4_awq`), ``weight_scale_2`` fp32 scalar (the FP8 member's ``1 / s``), ``input_scale``
fp32 scalar, ``pre_quant_scale`` [in] where the AWQ scale folds nowhere. The weight it stands for is ModelOpt's chain,
``fp8(code * weight_scale / weight_scale_2) * weight_scale_2``; the scales are quantlib's own ``1 / s`` (as in
:mod:`.modelopt_fp8`), so that products of them are the fake-quantized values."""

from __future__ import annotations

from typing import Optional

import torch

from ...formats import FormatSpec
from ..types import ExportFormat
from . import modelopt_common
from .base import ConfigInfo
from .modelopt_fp8 import fp8_tensor_scale, per_tensor_fp8
from .modelopt_int4_awq import ModelOptInt4AWQ


class ModelOptW4A8AWQ(ModelOptInt4AWQ):
    fmt = ExportFormat.MODELOPT_W4A8_AWQ
    siblings_share_global = True  # the FP8 member's amax (weight_scale_2): ModelOpt's exporter unifies it over q/k/v and gate/up
    input_required = "a calibrated FP8 E4M3 per-tensor input quantizer (W4A8_AWQ_BETA_CFG)"

    def input_ok(self, spec: FormatSpec) -> Optional[str]:
        return None if per_tensor_fp8(spec) else "W4A8_AWQ takes FP8 E4M3 activations per tensor with a static amax"

    def chain_ok(self, second: Optional[FormatSpec], amax_shape: tuple[int, ...]) -> Optional[str]:
        if second is None:
            return ("W4A8_AWQ needs a weight chain of INT4 blocks then FP8 per tensor (W4A8_AWQ_BETA_CFG); a single INT4 quantizer is "
                    "modelopt_int4_awq")
        if not per_tensor_fp8(second) or any(s != 1 for s in amax_shape):
            return "the chain's second member must be FP8 E4M3 with one amax per tensor (axis=None)"
        return None

    def pack_chain(self, spec: FormatSpec, amax: Optional[torch.Tensor]) -> dict[str, torch.Tensor]:
        return {"weight_scale_2": fp8_tensor_scale(spec, amax)}

    def pack_input(self, spec: FormatSpec, amax: Optional[torch.Tensor]) -> dict[str, torch.Tensor]:
        return {"input_scale": fp8_tensor_scale(spec, amax)}

    def extra_files(self, info: ConfigInfo) -> dict[str, dict]:
        quant = modelopt_common.hf_quant_config("W4A8_AWQ", info, group_size=info.weight_spec.block[0])
        quant["quantization"].update(has_zero_point=False, pre_quant_scale=True)  # as ModelOpt writes every W4A8_AWQ export
        return {"hf_quant_config.json": quant}
