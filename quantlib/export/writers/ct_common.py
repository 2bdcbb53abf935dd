"""The ``quantization_config`` that compressed-tensors writes (``QuantizationConfig.model_dump()``) and the
activation arguments it can carry; shared by the ``ct_*`` format modules."""

from __future__ import annotations

import re
from typing import Any, Optional

import torch

from ...formats import FormatSpec, Kind
from ...formats.fp8 import fp8_scale
from ...formats.int import int_scale
from ...formats.spec import is_nvfp4
from ...kv.scales import ct_kv_scheme
from .base import ConfigInfo, is_mx


def fp8_args(strategy: str, dynamic: bool, **extra: Any) -> dict:
    """compressed-tensors' ``QuantizationArgs`` of symmetric FP8 E4M3 with ``strategy`` (plus ``extra`` keys)."""
    return {"num_bits": 8, "type": "float", "symmetric": True, "strategy": strategy, "dynamic": dynamic, **extra}


def input_args(spec: Optional[FormatSpec]) -> Optional[dict]:
    """CT ``input_activations`` of a quantlib input quantizer, or None where CT has no such scheme."""
    if spec is None:
        return None
    if spec.kind == Kind.FP8 and spec.element == (4, 3):
        return fp8_args("token", True) if spec.dynamic else fp8_args("tensor", False)
    if spec.kind == Kind.FP8_BLOCK and spec.element == (4, 3) and spec.dynamic and len(spec.block) == 1:
        return fp8_args("group", True, group_size=spec.block[0])
    if is_mx(spec, (4, 3)) or is_mx(spec, (2, 1)):
        return {"num_bits": 8 if spec.element == (4, 3) else 4, "type": "float", "symmetric": True, "strategy": "group", "group_size": 32,
                "dynamic": True, "scale_dtype": "torch.uint8", "zp_dtype": None}
    if is_nvfp4(spec):
        return {"num_bits": 4, "type": "float", "symmetric": True, "strategy": "tensor_group", "group_size": 16, "dynamic": "local",
                "observer": "static_minmax", "scale_dtype": "torch.float8_e4m3fn", "zp_dtype": None}
    if spec.kind == Kind.INT and spec.num_bits == 8 and not spec.unsigned and spec.block is None:
        if spec.dynamic:
            return {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "token", "dynamic": True}
        return {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "tensor", "dynamic": False}
    return None


def input_tensors(spec: FormatSpec, amax: Optional[torch.Tensor]) -> dict[str, torch.Tensor]:
    """Static input scales as CT stores them: ``input_scale`` (a multiplier) or NVFP4's ``input_global_scale`` (a divisor)."""
    if amax is None or not spec.calibrated_amax:
        return {}
    a = amax.float().reshape(1)
    if spec.two_level:
        return {"input_global_scale": torch.full_like(a, 6.0 * 448.0) / a}
    if spec.kind == Kind.FP8:
        return {"input_scale": torch.reciprocal(fp8_scale(a, spec.element))}
    if spec.kind == Kind.INT:
        return {"input_scale": torch.reciprocal(int_scale(a, spec.qmax))}
    return {}


def ct_config(fmt: str, weights: dict, info: ConfigInfo) -> dict:
    """Top-level compressed-tensors config with one group targeting every Linear."""
    group = {"targets": ["Linear"], "weights": weights, "input_activations": input_args(info.input_spec), "output_activations": None,
             "format": fmt}
    return {
        "quant_method": "compressed-tensors",
        "format": fmt,
        "quantization_status": "compressed",
        "config_groups": {"group_0": group},
        # vLLM tests an experts module's first expert, "<m>.0.gate_proj", whose checkpoint holds the experts whole
        "ignore": [*info.ignore, *(f"re:^{re.escape(m)}\\." for m in info.experts_off)],
        "kv_cache_scheme": ct_kv_scheme(info.kv_spec),
        "global_compression_ratio": None,
        "moe_sparsity_config": None,
    }
