"""KV-cache quantizers in Megatron-Core's local core attention (``DotProductAttention``).

``DotProductAttention.forward(query, key, value, attention_mask, ...)`` receives the states in
Megatron's [sequence, batch, heads, head dim] layout, after RoPE and the inference cache; the quantized
class passes them through ``q_bmm_quantizer``, ``k_bmm_quantizer`` and ``v_bmm_quantizer`` (ModelOpt's
names, disabled until a config enables them) and then runs Megatron's own forward unchanged. An enabled
``p_bmm_quantizer`` quantizes the attention probabilities [batch, heads, sq, sk]: the output of Megatron's
``scale_mask_softmax`` submodule, before its attention dropout and the P @ V bmm
(:func:`quantlib.plugins.attention_probs.quantize_output`).

Tensor parallelism splits the heads (dim 2 of q/k/v, dim 1 of P): :meth:`QuantDotProductAttention.tp_split` says so, so the
amax sync MAX-reduces over TP every amax that does not keep the heads axis (per tensor, the NVFP4
global amax, per head-dim channel) and leaves per-head amax to their rank (:func:`quantlib.distributed.tp_shard_dim`).
Megatron dist checkpoints carry these amax and their config like those of the parallel linears (the
class shares the linears' ``sharded_state_dict`` and ``_quantizer_extra_state``, so
:func:`quantlib.plugins.megatron.restore_quantizer_config` restores them at any TP).
Transformer Engine's ``TEDotProductAttention`` runs a fused kernel quantlib cannot reach: a KV rule on
a model built with it is refused by :func:`quantlib.kv.presets.check_kv_reach`, naming the module.
"""

from __future__ import annotations

from typing import Iterator, Optional

import torch
from megatron.core.transformer.dot_product_attention import DotProductAttention

from ..kv.attention import AttentionQuantizers
from ..nn.quant_module import QuantModuleRegistry
from .attention_probs import quantize_output
from .megatron import _MegatronQuantMixin

#: the axis of [s, b, heads, head dim] that tensor parallelism splits
HEADS_AXIS = 2
#: the same axis of the attention probabilities [b, heads, sq, sk]
PROBS_HEADS_AXIS = 1


@QuantModuleRegistry.register(DotProductAttention, "megatron.DotProductAttention")
class QuantDotProductAttention(_MegatronQuantMixin, AttentionQuantizers):
    """Megatron-Core's ``DotProductAttention`` with q/k/v bmm quantizers on its inputs and a p bmm
    quantizer on its softmax output."""

    parallel_role = "column"  # heads are split over tensor-parallel ranks (see tp_split)

    def weight_groups(self) -> Iterator[tuple[str, list[torch.Tensor]]]:
        # no weights; written here because the Megatron mixin's weight_groups comes first in the MRO
        return AttentionQuantizers.weight_groups(self)

    def tp_split(self, qname: str) -> tuple[Optional[int], int]:
        """The heads axis, with this rank's number of query heads (q, p) or key/value groups (k, v)."""
        if qname == "p_bmm_quantizer":
            return PROBS_HEADS_AXIS, int(self.num_attention_heads_per_partition)
        heads = self.num_attention_heads_per_partition if qname == "q_bmm_quantizer" else self.num_query_groups_per_partition
        return HEADS_AXIS, int(heads)

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, *args, **kwargs):
        qkv = (self.q_bmm_quantizer(query), self.k_bmm_quantizer(key), self.v_bmm_quantizer(value))
        if not self.p_bmm_quantizer.is_enabled:
            return super().forward(*qkv, *args, **kwargs)
        with quantize_output(self.scale_mask_softmax, self.p_bmm_quantizer, self.p_bmm_quantizer._qname):
            return super().forward(*qkv, *args, **kwargs)


__all__ = ["HEADS_AXIS", "PROBS_HEADS_AXIS", "QuantDotProductAttention"]
