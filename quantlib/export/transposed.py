"""Linears whose checkpoint stores the weight (in, out) (GPT-2's ``Conv1D``), as their consumers read them.

vLLM's GPT-2 loader (``GPT2Model._transpose_conv1d``, vLLM 0.32) transposes every tensor named ``<m>.weight`` of
``c_attn`` / ``c_proj`` / ``c_fc`` and loads every other tensor of them (scales, ``weight_packed``, zero points,
``weight_shape``) as it loads a linear's. An export therefore writes such a module's tensors as for an (out, in)
linear, its ``weight`` (codes, or ModelOpt's packed bytes) transposed: vLLM's transpose gives the linear's back.
No other vLLM model transposes checkpoint weights, so a quantized ``Conv1D`` of another family is refused.
"""

from __future__ import annotations

from typing import Optional

import torch

#: transformers ``config.model_type`` -> leaf names of the modules whose checkpoint ``weight`` is (in, out)
TRANSPOSED: dict[str, frozenset] = {"gpt2": frozenset({"c_attn", "c_proj", "c_fc"})}


def stored_transposed(model_type: Optional[str], name: str) -> bool:
    """Whether checkpoints of ``model_type`` store module ``name``'s ``weight`` (in, out)."""
    return name.rpartition(".")[2] in TRANSPOSED.get(model_type or "", ())


def swap_weight(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``tensors`` with a 2-D ``weight`` transposed (contiguous), the rest as they are: a linear's packed tensors as
    the checkpoint stores them for an (in, out) module, and back (what the consumer's loader does)."""
    w = tensors.get("weight")
    return tensors if w is None or w.dim() != 2 else {**tensors, "weight": w.t().contiguous()}


__all__ = ["TRANSPOSED", "stored_transposed", "swap_weight"]
