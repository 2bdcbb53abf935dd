"""Model layouts: checkpoint names, fused parameters to split, sibling groups and vLLM shard ids.

A layout names what consumers fuse: siblings that a loader concatenates into one GEMM and that must
therefore share a per-tensor (global) scale, their shard ids, and which weights tensor parallelism
splits by rows (column-parallel) or by columns (row-parallel). The siblings are vLLM's packed modules:
``q_proj`` / ``k_proj`` / ``v_proj`` (``qkv_proj``), ``gate_proj`` / ``up_proj`` (``gate_up_proj``),
MLA's ``q_a_proj`` / ``kv_a_proj_with_mqa`` (``fused_qkv_a_proj``), ``w1`` / ``w3`` (``w13``) and BERT's
``query`` / ``key`` / ``value``: linears of one parent module with these leaf names that read the very same
input in a probe forward (:mod:`.structure`), for every transformers family; by the names alone where the
model cannot run (weights on ``meta``).

Checkpoint names are those transformers' own ``save_pretrained`` writes (:mod:`.hf_names` reads its
conversion mapping): transformers 5's fused experts (``experts.gate_up_proj`` [E, 2I, H]) go per expert
in 2-D under the family's names (``mlp.experts.{e}.gate_proj``, Mixtral's
``block_sparse_moe.experts.{e}.w1`` ...), with the rows transformers takes for each.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Union

from torch import nn

from .hf_names import transformers_names
from .modules import ModuleWalk
from .structure import Structure, model_structure, reconcile, shared_inputs
from .types import ExportError

Shard = Optional[Union[str, int]]
#: one checkpoint module of one expert's slice of a fused projection: (name, rows r0:r1 of the slice)
ExpertPart = tuple[str, int, int]


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
    #: (used where :attr:`experts` does not name the module)
    expert_split: dict[str, tuple[tuple[str, str], ...]] = field(default_factory=dict)
    #: module name -> checkpoint module name, where they differ (transformers' renamings)
    renames: dict[str, str] = field(default_factory=dict)
    #: tensor -> checkpoint key, where transformers saves a tensor under another name than its own (a router's
    #: ``e_score_correction_bias`` as ``expert_bias``); each is written as an unquantized item of its own
    tensors: dict[str, str] = field(default_factory=dict)
    #: checkpoint key -> (its source tensors, how it is made of them), for keys transformers' conversion builds on save
    #: (a concatenation, a transpose, padding): written from the sources by that conversion, unless one is quantized
    built: dict[str, tuple[tuple[str, ...], str]] = field(default_factory=dict)
    #: fused-experts module -> projection -> per expert ((checkpoint module, r0, r1), ...), or STORED_FUSED
    experts: dict[str, dict[str, object]] = field(default_factory=dict)
    #: leaf names that no consumer fuses with a neighbour; with the siblings' leaves, what the layout can
    #: name (None: any leaf, as in a layout a user writes for their model)
    standalone: Optional[frozenset] = None
    #: which linears read one input, as a probe forward found them (:mod:`.structure`); None: not probed (a model
    #: on ``meta``, a model that is no transformers model)
    structure: Optional[Structure] = None

    def checkpoint_name(self, module_name: str) -> str:
        """The checkpoint name of a module (its own name unless transformers renames it)."""
        return self.renames.get(module_name, module_name)

    def sibling_group(self, leaf: str) -> Optional[tuple[str, ...]]:
        """The sibling group of leaf name ``leaf``, or None."""
        for group in self.siblings:
            if leaf in group:
                return group
        return None

    def group_of(self, name: str, leaf: str) -> Optional[tuple[str, ...]]:
        """The fused group of module ``name`` (leaf ``leaf``): as the probe found it where it reached the module,
        else by leaf name (:meth:`sibling_group`)."""
        s = self.structure
        if s is not None and name in s.seen:
            return s.fused.get(name)
        return self.sibling_group(leaf)

    def tp_axis(self, leaf: str) -> Optional[int]:
        """Weight axis that tensor parallelism splits for a module of this leaf name (None: replicated)."""
        if leaf in self.column:
            return 0
        if leaf in self.row:
            return 1
        return None

    def expert_parts(self, module: str, proj: str, e: int, rows: int) -> list[tuple[str, str, str, int, int]]:
        """(checkpoint name, leaf, vLLM shard id, r0, r1) of each checkpoint module expert ``e``'s ``rows``-row
        slice of ``proj`` is written as."""
        shards = _EXPERT_SHARDS.get(proj)
        named = self.experts.get(module, {}).get(proj)
        if isinstance(named, list):
            parts = named[e]
            if shards is None or len(parts) != len(shards):
                raise ExportError(f"{module}.{proj}: the checkpoint splits it into {len(parts)} modules; quantlib knows vLLM's shards of "
                                  "gate_up_proj / up_proj / down_proj")
            return [(n, n.rpartition(".")[2], s, r0, r1) for (n, r0, r1), s in zip(parts, shards)]
        if proj not in self.expert_split:
            raise ExportError(f"{module}.{proj}: layout {self.name} does not say how to split this fused-experts projection")
        split = self.expert_split[proj]
        if rows % len(split):
            raise ExportError(f"{module}.{proj}: {rows} rows do not split into {len(split)} equal parts")
        step = rows // len(split)
        base = self.checkpoint_name(module)
        return [(f"{base}.{e}.{leaf}", leaf, s, i * step, (i + 1) * step) for i, (leaf, s) in enumerate(split)]


_EXPERT_SHARDS = {"gate_up_proj": ("w1", "w3"), "up_proj": ("w3",), "down_proj": ("w2",)}
_EXPERT_SPLIT = {
    "gate_up_proj": (("gate_proj", "w1"), ("up_proj", "w3")),
    "up_proj": (("up_proj", "w3"),),
    "down_proj": (("down_proj", "w2"),),
}
#: vLLM's packed modules (``packed_modules_mapping``): qkv_proj, gate_up_proj, MLA's fused_qkv_a_proj, w13, the Gated
#: DeltaNet's in_proj_qkvz / in_proj_ba (Qwen3.5), and BERT / RoBERTa's qkv_proj of query / key / value
FUSED_SIBLINGS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"), ("q_a_proj", "kv_a_proj_with_mqa"), ("w1", "w3"),
                  ("in_proj_qkv", "in_proj_z"), ("in_proj_b", "in_proj_a"), ("query", "key", "value"))
#: leaves of transformers' decoders that consumers load alone (output projections, routers, fused already)
STANDALONE = frozenset({
    "o_proj", "down_proj", "w2", "q_b_proj", "kv_b_proj", "q_proj", "gate", "router", "shared_expert_gate", "lm_head", "c_attn",
    "c_proj", "c_fc", "qkv_proj", "gate_up_proj", "dense", "out_proj", "fc1", "fc2", "query_key_value", "dense_h_to_4h", "dense_4h_to_h",
})  # fmt: skip
_DECODER = dict(
    siblings=FUSED_SIBLINGS,
    shards={"q_proj": "q", "k_proj": "k", "v_proj": "v", "gate_proj": 0, "up_proj": 1, "q_a_proj": 0, "kv_a_proj_with_mqa": 1, "w1": 0,
            "w3": 1, "in_proj_z": 3, "in_proj_b": 0, "in_proj_a": 1,  # vLLM loads in_proj_qkv as shards (0, 1, 2) of in_proj_qkvz
            "query": "q", "key": "k", "value": "v"},
    column=frozenset({"q_proj", "k_proj", "v_proj", "gate_proj", "up_proj", "q_b_proj", "kv_b_proj", "w1", "w3", "c_fc", "c_attn",
                      "in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "query", "key", "value"}),
    row=frozenset({"o_proj", "down_proj", "w2", "c_proj"}),
    expert_split=_EXPERT_SPLIT,
    standalone=STANDALONE,
)

#: any transformers decoder: vLLM's packed siblings, transformers' own checkpoint names (filled per model)
TRANSFORMERS = ModelLayout("transformers", **_DECODER)
#: transformers' Llama (LlamaForCausalLM)
LLAMA = dataclasses.replace(TRANSFORMERS, name="llama")
#: transformers' Qwen3 (dense)
QWEN3 = dataclasses.replace(TRANSFORMERS, name="qwen3")
#: transformers' Qwen3-MoE: the decoder's names plus per-expert experts.{e}.gate_proj / up_proj / down_proj
QWEN3_MOE = dataclasses.replace(TRANSFORMERS, name="qwen3_moe")
#: a model that is no transformers model: module names as checkpoint names, no siblings, fused experts
#: written per expert
GENERIC = ModelLayout("generic", expert_split=_EXPERT_SPLIT)

#: layouts by ``config.model_type`` that users registered (:func:`register_layout`)
LAYOUTS: dict[str, ModelLayout] = {}


def register_layout(model_type: str, layout: ModelLayout) -> None:
    """Use ``layout`` for transformers models of ``config.model_type == model_type`` (your own family: its
    sibling groups, shard ids and tensor-parallel axes); transformers' checkpoint names still apply."""
    if not isinstance(layout, ModelLayout):
        raise ExportError(f"register_layout({model_type!r}, ...): expected a ModelLayout, got {type(layout).__name__}")
    LAYOUTS[model_type] = layout


def layout_for(model: nn.Module, walk: Optional[ModuleWalk] = None) -> ModelLayout:
    """The layout of a model: for a transformers model (``config.model_type``) its registered layout or
    :data:`TRANSFORMERS`, with transformers' checkpoint names; :data:`GENERIC` otherwise. ``walk``: the
    model's :class:`ModuleWalk`, when the caller has one (an export shares it with its plan)."""
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    if model_type is None:
        return GENERIC
    walk = ModuleWalk(model) if walk is None else walk  # one traversal for the names and the probe
    return with_structure(model, with_checkpoint_names(model, LAYOUTS.get(model_type) or _transformers_layout(model_type), walk), walk)


@functools.lru_cache(maxsize=None)  # one per model_type, shared as a registered layout is: a replace per call cost 5-10 us
def _transformers_layout(model_type: str) -> ModelLayout:
    return dataclasses.replace(TRANSFORMERS, name=model_type)


def with_checkpoint_names(model: nn.Module, layout: ModelLayout, walk: Optional[ModuleWalk] = None) -> ModelLayout:
    """``layout`` with the checkpoint names of transformers model ``model`` added (its own take precedence);
    ``layout`` itself for a model that is no transformers model, or where it holds them all already (a
    layout of :func:`layout_for`). ``walk``: the model's :class:`ModuleWalk`, when the caller has one."""
    if getattr(getattr(model, "config", None), "model_type", None) is None:
        return layout
    renames, experts, tensors, built = transformers_names(model, walk)
    if (renames.keys() <= layout.renames.keys() and experts.keys() <= layout.experts.keys() and tensors.keys() <= layout.tensors.keys()
            and built.keys() <= layout.built.keys()):
        return layout  # the merge below would change nothing: its own names take precedence
    return dataclasses.replace(layout, renames={**renames, **layout.renames}, experts={**experts, **layout.experts},
                               tensors={**tensors, **layout.tensors}, built={**built, **layout.built})


def with_structure(model: nn.Module, layout: ModelLayout, walk: Optional[ModuleWalk] = None) -> ModelLayout:
    """``layout`` checked against the linears that read one input in a probe forward of transformers model
    ``model`` (:mod:`.structure`; cached per model); ``layout`` itself where it holds a structure already, for a
    model that is no transformers model, and for one with weights on ``meta``."""
    if layout.structure is not None or getattr(getattr(model, "config", None), "model_type", None) is None:
        return layout
    found = model_structure(model, walk, layout.name, layout.siblings, layout.standalone)
    return layout if found is None else dataclasses.replace(layout, structure=found)


def structural_layout(model: nn.Module, forward: Callable[[nn.Module], Any], layout: Optional[ModelLayout] = None) -> ModelLayout:
    """The layout of any model (your own module included) with its fused siblings found by ``forward(model)`` (one
    forward on a tiny input; quantizers off, the model left as it was): linears of one parent that read one input
    and whose leaf names are vLLM's packed modules (q/k/v, gate/up, ...) or ``layout``'s siblings. Pass it to
    the export as ``layout=``."""
    if layout is None:
        is_hf = getattr(getattr(model, "config", None), "model_type", None) is not None
        layout = layout_for(model) if is_hf else dataclasses.replace(TRANSFORMERS, name=type(model).__name__)
    groups = shared_inputs(model, None, forward)
    if groups is None:
        raise ExportError(f"{type(model).__name__}: weights on the meta device: the structure probe needs the model in memory")
    return dataclasses.replace(layout, structure=reconcile(groups, layout.name, layout.siblings, layout.standalone))
