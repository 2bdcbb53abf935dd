"""Tokens per expert, counted while a calibration runs (the report of which experts calibration reached).

Shared by the transformers fused experts and Transformer Engine's grouped linears: they differ in how
they tell that a calibration runs and in the form of their counts, not in when counting restarts."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ..nn.tensor_quantizer import TensorQuantizer


def count_tokens(module: nn.Module, counts: Any, input_quantizer: TensorQuantizer, calibrating: bool) -> None:
    """:func:`add_tokens` when ``calibrating``; remember ``calibrating`` in ``module._was_calibrating``
    (where counting restarts). Call it before ``input_quantizer`` sees the forward's input."""
    if calibrating:
        add_tokens(module, counts, input_quantizer)
    module._was_calibrating = calibrating


def add_tokens(module: nn.Module, counts: Any, input_quantizer: TensorQuantizer) -> None:
    """Add ``counts`` (one per expert: a list or tensor) to ``module.tokens_per_expert`` in a calibrating forward."""
    # counting restarts with each calibration: when the input quantizer has collected nothing
    # yet (calibrate resets it), or at the first calibrating forward after any other
    if input_quantizer.is_enabled and input_quantizer._if_calib:
        fresh = input_quantizer.num_calib_batches == 0
    else:
        fresh = not module._was_calibrating
    accumulate(module, counts, fresh)


def accumulate(module: nn.Module, counts: Any, fresh: bool) -> torch.Tensor:
    """Add ``counts`` (one per expert) to ``module.tokens_per_expert``, zeroed first when ``fresh`` (a
    new calibration); returns the counts as an int64 tensor."""
    added = torch.as_tensor(counts, dtype=torch.int64).reshape(-1).to(module.tokens_per_expert.device)
    if fresh:
        module.tokens_per_expert.zero_()
    module.tokens_per_expert += added
    return added
