"""Model layouts: checkpoint names, fused parameters to split, sibling groups and vLLM shard ids.

A layout names what consumers fuse: siblings (q/k/v, gate/up) that a loader concatenates into one GEMM
and that must therefore share a per-tensor (global) scale, their shard ids, and which weights tensor
parallelism splits by rows (column-parallel) or by columns (row-parallel). transformers 5's fused
experts (``experts.gate_up_proj`` [E, 2I, H], ``experts.down_proj`` [E, H, I]) are written per expert in
2-D, ``experts.{e}.gate_proj`` / ``up_proj`` / ``down_proj``: the names every consumer loads (a fused
3-D FP8 tensor loads silently wrong in transformers).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Union

from torch import nn

Shard = Optional[Union[str, int]]


@dataclass(frozen=True)
class ModelLayout:
    """How one model family's modules map to checkpoint names and consumer fusions."""

    name: str
    #: leaf names that a consumer fuses into one GEMM (within one parent module)
    siblings: tuple[tuple[str, ...], ...] = ()
    #: leaf name -> vLLM shard id of the fused parameter it loads into
    shards: dict[str, Union[str, int]] = field(default_factory=dict)
    #: leaf names whose weight rows tensor parallelism splits (column-parallel) / whose columns it splits
    column: frozenset = frozenset()
    row: frozenset = frozenset()
    #: fused-experts projection -> ((checkpoint leaf, vLLM expert shard id), ...), split in equal row parts
    expert_split: dict[str, tuple[tuple[str, str], ...]] = field(default_factory=dict)

    def checkpoint_name(self, module_name: str) -> str:
        """The checkpoint name of a module (transformers' names are the checkpoint's)."""
        return module_name

    def sibling_group(self, leaf: str) -> Optional[tuple[str, ...]]:
        for group in self.siblings:
            if leaf in group:
                return group
        return None

    def tp_axis(self, leaf: str) -> Optional[int]:
        """Weight axis that tensor parallelism splits for a module of this leaf name (None: replicated)."""
        if leaf in self.column:
            return 0
        if leaf in self.row:
            return 1
        return None


_EXPERT_SPLIT = {
    "gate_up_proj": (("gate_proj", "w1"), ("up_proj", "w3")),
    "up_proj": (("up_proj", "w3"),),
    "down_proj": (("down_proj", "w2"),),
}
_DECODER = dict(
    siblings=(("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj")),
    shards={"q_proj": "q", "k_proj": "k", "v_proj": "v", "gate_proj": 0, "up_proj": 1},
    column=frozenset({"q_proj", "k_proj", "v_proj", "gate_proj", "up_proj"}),
    row=frozenset({"o_proj", "down_proj"}),
    expert_split=_EXPERT_SPLIT,
)

#: transformers' Llama (LlamaForCausalLM)
LLAMA = ModelLayout("llama", **_DECODER)
#: transformers' Qwen3 (dense)
QWEN3 = ModelLayout("qwen3", **_DECODER)
#: transformers' Qwen3-MoE: the decoder's names plus per-expert experts.{e}.gate_proj / up_proj / down_proj
QWEN3_MOE = ModelLayout("qwen3_moe", **_DECODER)
#: any other model: module names as checkpoint names, no siblings, fused experts written per expert
GENERIC = ModelLayout("generic", expert_split=_EXPERT_SPLIT)

LAYOUTS: dict[str, ModelLayout] = {"llama": LLAMA, "qwen3": QWEN3, "qwen3_moe": QWEN3_MOE}


def layout_for(model: nn.Module) -> ModelLayout:
    """The layout of a transformers model by its ``config.model_type``; :data:`GENERIC` otherwise."""
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    return LAYOUTS.get(model_type, GENERIC)
