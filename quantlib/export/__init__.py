"""Export of quantized models in the formats inference engines and ``transformers`` load (DESIGN §9).

``iter_packed`` streams each module's packed tensors; ``export_checkpoint`` writes a checkpoint
directory atomically; ``serialize_weight`` packs one tensor (RL weight sync). Packing uses the
quantizers' own amax and quantlib's kernels, so the consumer's weights are those the model was
evaluated with. Megatron-Core models: :func:`quantlib.export.megatron.export_megatron_checkpoint`.
"""

from .checkpoint import export_checkpoint
from .fold import share_pre_quant_scale
from .iterate import iter_packed
from .layouts import GENERIC, LAYOUTS, LLAMA, QWEN3, QWEN3_MOE, ModelLayout, layout_for
from .siblings import share_sibling_amax
from .types import ExportError, ExportFormat, ExportManifest, PackedWeight
from .weight_sync import chunk_by_bytes, serialize_weight

__all__ = [
    "GENERIC",
    "LAYOUTS",
    "LLAMA",
    "QWEN3",
    "QWEN3_MOE",
    "ExportError",
    "ExportFormat",
    "ExportManifest",
    "ModelLayout",
    "PackedWeight",
    "chunk_by_bytes",
    "export_checkpoint",
    "iter_packed",
    "layout_for",
    "serialize_weight",
    "share_pre_quant_scale",
    "share_sibling_amax",
]
