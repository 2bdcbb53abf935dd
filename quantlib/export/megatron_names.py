"""Hugging Face names of a Megatron-Core ``GPTModel``'s tensors: the family mapping that the Megatron file
export (:mod:`.megatron`) and the in-memory sync (:mod:`.megatron_sync`) share.

Llama / Qwen2 / Qwen3 / Qwen2-MoE / Qwen3-MoE names: ``linear_qkv`` (q, k and v rows interleaved per query
group) becomes ``self_attn.{q,k,v}_proj``, a gated ``linear_fc1`` ``{gate,up}_proj``, the router
``mlp.gate``, the output layer ``lm_head``, MoE shared experts ``mlp.shared_expert`` and their gate
``mlp.shared_expert_gate`` (Qwen2-MoE's names; ``shared_expert=`` picks another family's, e.g.
DeepSeek's ``shared_experts``). Biases follow their weights.
"""

from __future__ import annotations

from typing import Any, Optional

import torch

from ..formats import FormatSpec
from .layouts import ModelLayout
from .types import ExportError

#: HF names of a decoder layer's unquantized tensors, by Megatron key (after ``decoder.layers.{i}.``)
LAYER_NAMES = {
    "self_attention.linear_qkv.layer_norm_weight": "input_layernorm.weight",
    "self_attention.linear_qkv.layer_norm_bias": "input_layernorm.bias",
    "input_layernorm.weight": "input_layernorm.weight",
    "input_layernorm.bias": "input_layernorm.bias",
    "self_attention.q_layernorm.weight": "self_attn.q_norm.weight",
    "self_attention.k_layernorm.weight": "self_attn.k_norm.weight",
    "mlp.linear_fc1.layer_norm_weight": "post_attention_layernorm.weight",
    "mlp.linear_fc1.layer_norm_bias": "post_attention_layernorm.bias",
    "pre_mlp_layernorm.weight": "post_attention_layernorm.weight",
    "pre_mlp_layernorm.bias": "post_attention_layernorm.bias",
    "mlp.router.weight": "mlp.gate.weight",
    "mlp.shared_experts.gate_weight": "mlp.shared_expert_gate.weight",
}
TOP_NAMES = {
    "embedding.word_embeddings.weight": "model.embed_tokens.weight",
    "decoder.final_layernorm.weight": "model.norm.weight",
    "decoder.final_layernorm.bias": "model.norm.bias",
    "output_layer.weight": "lm_head.weight",
}
#: linears: Megatron module (after ``decoder.layers.{i}.``; the output layer at the top) -> HF module
#: ({e}: the global expert); fused ones are split by :func:`split_rows`
LINEARS = {
    "self_attention.linear_qkv": "self_attn",
    "self_attention.linear_proj": "self_attn.o_proj",
    "mlp.linear_fc1": "mlp",
    "mlp.linear_fc2": "mlp.down_proj",
    "mlp.experts.experts.linear_fc1": "mlp.experts.{e}",
    "mlp.experts.experts.linear_fc2": "mlp.experts.{e}.down_proj",
    "mlp.shared_experts.linear_fc1": "mlp.shared_expert",
    "mlp.shared_experts.linear_fc2": "mlp.shared_expert.down_proj",
    "output_layer": "lm_head",
}
#: Megatron linears whose weight rows tensor parallelism splits (the others: their columns), the output layer
#: included; the embedding splits its rows (the vocabulary) too
COLUMN = ("linear_qkv", "linear_fc1", "output_layer")
#: what consumers fuse: q/k/v and gate/up (they come from one Megatron quantizer, so share its amax)
MEGATRON_GPT = ModelLayout(
    "megatron_gpt",
    siblings=(("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj")),
    shards={"q_proj": "q", "k_proj": "k", "v_proj": "v", "gate_proj": 0, "up_proj": 1},
)


def hf_linear(module: str, e: Optional[int], shared_expert: str = "shared_expert") -> str:
    """The HF module (before the q/k/v or gate/up split) of Megatron linear ``module``."""
    return LINEARS[module].format(e=e).replace("shared_expert", shared_expert, 1)


def hf_layer_name(key: str, shared_expert: str = "shared_expert") -> str:
    """The HF name of an unquantized decoder-layer tensor (``key`` after ``decoder.layers.{i}.``)."""
    return LAYER_NAMES.get(key, key).replace("shared_expert", shared_expert, 1)


def qkv_rows(config: Any, groups: Optional[int] = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Row indices of q, k and v in Megatron's ``linear_qkv`` (per query group: its q heads, then k, then v);
    ``groups``: the query groups of the weight (a tensor-parallel shard holds groups / TP)."""
    heads = config.num_attention_heads
    all_groups = config.num_query_groups or heads
    hn = config.kv_channels or config.hidden_size // heads
    per = heads // all_groups
    q, k, v = [], [], []
    for g in range(all_groups if groups is None else groups):
        base = g * (per + 2) * hn
        q.append(torch.arange(base, base + per * hn))
        k.append(torch.arange(base + per * hn, base + (per + 1) * hn))
        v.append(torch.arange(base + (per + 1) * hn, base + (per + 2) * hn))
    return torch.cat(q), torch.cat(k), torch.cat(v)


def split_rows(module: str, rows: int, config: Any, groups: Optional[int] = None) -> list[tuple[str, torch.Tensor, Any]]:
    """(HF leaf, row indices, vLLM shard id) of each HF module a Megatron linear's ``rows`` rows hold;
    leaf "" where the linear is one HF module."""
    everything = torch.arange(rows)
    if module == "self_attention.linear_qkv":
        q, k, v = qkv_rows(config, groups)
        return [("q_proj", q, "q"), ("k_proj", k, "k"), ("v_proj", v, "v")]
    if module.endswith("linear_fc1"):
        expert = module.startswith("mlp.experts.")
        if getattr(config, "gated_linear_unit", False):
            half = rows // 2
            return [("gate_proj", everything[:half], "w1" if expert else 0), ("up_proj", everything[half:], "w3" if expert else 1)]
        return [("up_proj", everything, "w3" if expert else None)]
    return [("", everything, "w2" if module.startswith("mlp.experts.") else None)]


def _whole_row_blocks(idx: torch.Tensor, bm: int, rows: int, where: str) -> torch.Tensor:
    """The row blocks (of ``bm`` rows) that rows ``idx`` fill exactly: each run of consecutive rows starts on a block
    edge and ends on one (or at the weight's last row), as q of several GQA groups does; else ExportError."""
    breaks = torch.nonzero(idx[1:] - idx[:-1] != 1).flatten() + 1
    blocks = []
    for run in torch.tensor_split(idx, breaks):
        start, end = int(run[0]), int(run[-1]) + 1
        if start % bm or (end % bm and end != rows):
            raise ExportError(
                f"{where}: rows of q / k / v (or gate / up) interleave within {bm}-row blocks of the fused Megatron weight; "
                "2-D blocks cannot be split"
            )
        blocks.append(torch.arange(start // bm, -(-end // bm)))
    return torch.cat(blocks)


def select_rows(amax: Optional[torch.Tensor], spec: FormatSpec, rows: int, idx: torch.Tensor, where: str) -> Optional[torch.Tensor]:
    """The amax of rows ``idx`` of a weight of ``rows`` rows (one value, per row, or per 2-D block)."""
    if amax is None or amax.numel() == 1:
        return amax
    if spec.block is not None and len(spec.block) == 2:
        return amax[_whole_row_blocks(idx, spec.block[0], rows, where)]
    if amax.dim() >= 1 and amax.shape[0] == rows:
        return amax[idx]
    return amax
