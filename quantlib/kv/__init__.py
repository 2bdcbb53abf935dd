"""KV-cache quantization: ModelOpt's KV presets and their merge into a model config (:mod:`.presets`), and
the q/k/v/p bmm quantizers every quantized attention module carries (:mod:`.attention`). The framework
hooks that insert them live with their framework (:mod:`quantlib.plugins.hf_attention`,
:mod:`quantlib.plugins.megatron_attention`); the export side lives in the export layer above
(:mod:`quantlib.export.kv_plan`, :mod:`quantlib.export.writers.kv_scales`), which imports this package."""

from .presets import FP8_AFFINE_KV_CFG, FP8_KV_CFG, KV_PRESETS, NVFP4_KV_CFG, merge_kv_config

__all__ = ["FP8_AFFINE_KV_CFG", "FP8_KV_CFG", "KV_PRESETS", "NVFP4_KV_CFG", "merge_kv_config"]
