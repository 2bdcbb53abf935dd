"""KV-cache quantization in one package: ModelOpt's KV presets and their merge into a model config
(:mod:`.presets`), the q/k/v/p bmm quantizers every quantized attention module carries (:mod:`.attention`),
the KV-cache part of an export plan (:mod:`.export_plan`) and the KV scales each export format stores
(:mod:`.scales`); the export layer above imports the last two. The framework hooks that insert the
quantizers into an attention's forward live with their framework, loaded only when it is
(:mod:`quantlib.plugins.hf_attention`, :mod:`quantlib.plugins.megatron_attention`)."""

from .presets import FP8_AFFINE_KV_CFG, FP8_KV_CFG, KV_PRESETS, NVFP4_KV_CFG, merge_kv_config

__all__ = ["FP8_AFFINE_KV_CFG", "FP8_KV_CFG", "KV_PRESETS", "NVFP4_KV_CFG", "merge_kv_config"]
