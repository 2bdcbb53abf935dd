"""calibrate() without a parallel_state syncs over the default group when torch.distributed runs."""

from __future__ import annotations

import torch
from torch import nn

import quantlib as ql
from tests.ranks import run_on_ranks


def _quantize_without_state(rank: int, world: int, explicit_local: bool) -> float:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 16))
    data = torch.full((4, 16), float(rank + 1))  # rank r sees amax r + 1
    state = ql.ParallelState() if explicit_local else None
    ql.quantize(model, ql.FP8_DEFAULT_CFG, lambda m: m(data), parallel_state=state)
    assert ql.distributed.discover_parallel_state().data_size == world
    return model[0].input_quantizer.amax.item()


def test_default_group_is_discovered_as_data_parallel():
    assert run_on_ranks(_quantize_without_state, 2, False) == [2.0, 2.0]


def test_explicit_local_state_opts_out():
    assert run_on_ranks(_quantize_without_state, 2, True) == [1.0, 2.0]
