"""quantlib: post-training quantization and QAT of PyTorch models, ModelOpt-compatible configs."""

from .checkpoint import CheckpointError, quantizer_state, restore, restore_state, save
from .config import (
    FP8_2D_BLOCKWISE_WEIGHT_ONLY_CFG,
    FP8_BLOCKWISE_CFG,
    FP8_DEFAULT_CFG,
    FP8_PER_CHANNEL_PER_TOKEN_CFG,
    INT4_BLOCKWISE_WEIGHT_ONLY_CFG,
    INT8_DEFAULT_CFG,
    INT8_WEIGHT_ONLY_CFG,
    MXFP4_DEFAULT_CFG,
    MXFP8_DEFAULT_CFG,
    NVFP4_DEFAULT_CFG,
    PRESETS,
    W4A8_AWQ_BETA_CFG,
    ConfigError,
    QuantizeConfig,
    QuantizerAttributeConfig,
)
from .distributed import AmaxSyncError, ParallelState, sync_amax
from .kv_cache import FP8_AFFINE_KV_CFG, FP8_KV_CFG, NVFP4_KV_CFG, merge_kv_config
from .model_quant import calibrate, clear_weight_cache, convert, disable_quantizer, enable_quantizer, print_quant_summary, quant_summary, quantize, set_quantizer_by_cfg
from .nn import CalibrationError, GroupedQuantizer, QuantModule, QuantModuleRegistry, SequentialQuantizer, TensorQuantizer

__version__ = "0.1.0"

__all__ = [
    "FP8_2D_BLOCKWISE_WEIGHT_ONLY_CFG",
    "FP8_AFFINE_KV_CFG",
    "FP8_BLOCKWISE_CFG",
    "FP8_DEFAULT_CFG",
    "FP8_KV_CFG",
    "FP8_PER_CHANNEL_PER_TOKEN_CFG",
    "INT4_BLOCKWISE_WEIGHT_ONLY_CFG",
    "INT8_DEFAULT_CFG",
    "INT8_WEIGHT_ONLY_CFG",
    "MXFP4_DEFAULT_CFG",
    "MXFP8_DEFAULT_CFG",
    "NVFP4_DEFAULT_CFG",
    "NVFP4_KV_CFG",
    "PRESETS",
    "W4A8_AWQ_BETA_CFG",
    "AmaxSyncError",
    "CalibrationError",
    "CheckpointError",
    "ConfigError",
    "GroupedQuantizer",
    "QuantModule",
    "ParallelState",
    "QuantModuleRegistry",
    "QuantizeConfig",
    "QuantizerAttributeConfig",
    "SequentialQuantizer",
    "TensorQuantizer",
    "calibrate",
    "clear_weight_cache",
    "convert",
    "disable_quantizer",
    "enable_quantizer",
    "merge_kv_config",
    "print_quant_summary",
    "quant_summary",
    "quantize",
    "quantizer_state",
    "restore",
    "restore_state",
    "save",
    "set_quantizer_by_cfg",
    "sync_amax",
]
