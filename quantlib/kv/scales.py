"""KV-cache scales as the export formats that have a place for them store them (the writers of
:mod:`quantlib.export.writers` take these places as mixins); the attention module's
``k_bmm_quantizer`` / ``v_bmm_quantizer`` become per-tensor dequant multipliers next to its weights.

- compressed-tensors: ``kv_cache_scheme`` (FP8 E4M3, strategy tensor, static) and ``<attn>.k_scale`` /
  ``<attn>.v_scale`` fp32 ``[1]``, the names llm-compressor writes and vLLM's KV loader reads;
- ModelOpt: ``kv_cache_quant_algo`` ``"FP8"`` or ``"NVFP4"`` and ``<attn>.k_proj.k_scale`` /
  ``<attn>.v_proj.v_scale`` fp32 scalars (ModelOpt's ``postprocess_state_dict`` names, remapped by vLLM).

The FP8 scale is quantlib's own ``1 / s`` (``reciprocal(448 / amax)``), the multiplier its fake quant
applies, not ``amax / 448`` (an ulp apart for about a quarter of amaxes, docs/numerics.md, "Export"). ModelOpt clamps
its FP8 KV scales to at least 1.0; quantlib writes the calibrated value, so the checkpoint dequantizes as
the evaluated model did. The NVFP4 scale is quantlib's global scale ``s2 = amax / 2688``.
"""

from __future__ import annotations

import enum
from typing import Optional, Protocol

import torch

from ..formats import FormatSpec, Kind
from ..formats.fp8 import fp8_scale
from ..formats.nvfp4 import nvfp4_global_scale
from ..formats.spec import is_nvfp4


class KVPlace(Protocol):
    """What the KV-cache export plan asks of an export writer (:class:`quantlib.export.writers.Packer`)."""

    fmt: enum.Enum  # its ExportFormat, named in messages

    def kv_ok(self, spec: FormatSpec, amax_shape: tuple[int, ...]) -> Optional[str]: ...


def is_fp8_per_tensor(spec: FormatSpec) -> bool:
    """Whether ``spec`` is FP8 E4M3 with one static amax (what FP8_KV_CFG gives)."""
    return spec.kind == Kind.FP8 and spec.element == (4, 3) and not spec.dynamic and spec.block is None


def fp8_kv_scale(amax: torch.Tensor) -> torch.Tensor:
    """fp32 dequant multiplier of a per-tensor FP8 E4M3 KV quantizer: quantlib's ``1 / s``."""
    return torch.reciprocal(fp8_scale(amax.detach().float().reshape(()), (4, 3)))


class CTKVCache:
    """compressed-tensors' KV-cache place: FP8 per tensor only (vLLM's compressed-tensors KV method)."""

    def kv_ok(self, spec: FormatSpec, amax_shape: tuple[int, ...]) -> Optional[str]:
        """None if the format carries a KV quantizer of ``spec``; else why not."""
        if not is_fp8_per_tensor(spec) or any(s != 1 for s in amax_shape):
            return "compressed-tensors' kv_cache_scheme as vLLM loads it is FP8 E4M3 with one static scale per tensor (FP8_KV_CFG)"
        return None

    def pack_kv(self, spec: FormatSpec, k_amax: torch.Tensor, v_amax: torch.Tensor) -> dict[str, torch.Tensor]:
        """The attention module's KV scale tensors (local names)."""
        return {"k_scale": fp8_kv_scale(k_amax).reshape(1), "v_scale": fp8_kv_scale(v_amax).reshape(1)}


def ct_kv_scheme(spec: Optional[FormatSpec]) -> Optional[dict]:
    """``kv_cache_scheme`` of a compressed-tensors config (compressed-tensors' ``QuantizationArgs``)."""
    if spec is None:
        return None
    return {"num_bits": 8, "type": "float", "symmetric": True, "strategy": "tensor", "dynamic": False}


class ModelOptKVCache:
    """ModelOpt's KV-cache place: FP8 per tensor or NVFP4 (``kv_cache_quant_algo``)."""

    def kv_ok(self, spec: FormatSpec, amax_shape: tuple[int, ...]) -> Optional[str]:
        """None if the format carries a KV quantizer of ``spec``; else why not."""
        if any(s != 1 for s in amax_shape) or not (is_fp8_per_tensor(spec) or is_nvfp4(spec)):
            return "ModelOpt's kv_cache_quant_algo is FP8 (E4M3, one static amax per tensor: FP8_KV_CFG) or NVFP4 (NVFP4_KV_CFG)"
        return None

    def pack_kv(self, spec: FormatSpec, k_amax: torch.Tensor, v_amax: torch.Tensor) -> dict[str, torch.Tensor]:
        """The attention module's KV scale tensors (local names, as ModelOpt's export names them)."""
        scale = fp8_kv_scale if is_fp8_per_tensor(spec) else (lambda a: nvfp4_global_scale(a.detach()))
        return {"k_proj.k_scale": scale(k_amax).reshape(()), "v_proj.v_scale": scale(v_amax).reshape(())}


def modelopt_kv_algo(spec: Optional[FormatSpec]) -> Optional[str]:
    """``kv_cache_quant_algo`` of ``hf_quant_config.json`` (None: KV cache not quantized)."""
    if spec is None:
        return None
    return "NVFP4" if is_nvfp4(spec) else "FP8"


def modelopt_kv_scheme(kv_algo: Optional[str]) -> Optional[dict | str]:
    """``kv_cache_scheme`` of the config.json form of ModelOpt's config for its ``kv_cache_quant_algo``: FP8 as
    QuantizationArgs-like fields, other algorithms by name (None: KV cache not quantized)."""
    return {"dynamic": False, "num_bits": 8, "type": "float"} if kv_algo == "FP8" else kv_algo
