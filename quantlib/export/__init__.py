"""Export of quantized models in the formats inference engines and ``transformers`` load (docs/design.md §8).

``iter_packed`` streams each module's packed tensors; ``export_checkpoint`` writes a checkpoint
directory atomically; ``serialize_weight`` packs one tensor and ``sync_pairs`` a whole model for RL
weight sync, with scales from the weights being sent (``scales="dynamic"``), in buckets of one dtype. Packing uses the
quantizers' own amax and quantlib's kernels, so the consumer's weights are those the model was
evaluated with. Megatron-Core models: :func:`quantlib.export.megatron_export.export_megatron_checkpoint` (files) and
:func:`quantlib.export.megatron_sync.megatron_sync_tensors` (in memory, each rank its own parts, no gather).
"""

from .buckets import Bucket, BucketEntry, bucket_by_dtype
from .export_checkpoint import export_checkpoint
from .fold import share_pre_quant_scale
from .iterate import iter_packed
from .layouts import GENERIC, LAYOUTS, LLAMA, QWEN3, QWEN3_MOE, TRANSFORMERS, ModelLayout, layout_for, register_layout, structural_layout
from .siblings import share_sibling_amax
from .sync_scales import Scales
from .types import ExportError, ExportFormat, ExportManifest, PackedWeight
from .vllm_names import ExpertNames, check_receiver
from .weight_sync import chunk_by_bytes, serialize_weight, sync_pairs

__all__ = [
    "GENERIC",
    "LAYOUTS",
    "LLAMA",
    "QWEN3",
    "QWEN3_MOE",
    "TRANSFORMERS",
    "Bucket",
    "BucketEntry",
    "ExpertNames",
    "ExportError",
    "ExportFormat",
    "ExportManifest",
    "ModelLayout",
    "PackedWeight",
    "Scales",
    "bucket_by_dtype",
    "check_receiver",
    "chunk_by_bytes",
    "export_checkpoint",
    "iter_packed",
    "layout_for",
    "register_layout",
    "serialize_weight",
    "share_pre_quant_scale",
    "share_sibling_amax",
    "structural_layout",
    "sync_pairs",
]
