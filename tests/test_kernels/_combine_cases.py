"""Routings and rows for the combine tests: the interpreted kernel test (test_triton_combine.py) and the
compiled one on a GPU (tests/test_plugins/test_expert_dispatch.py). Imports no triton."""

from __future__ import annotations

import torch

from quantlib.plugins.expert_dispatch import dispatch

#: (rows, routing weights, output) dtypes: the experts' dtype with the router's weights in it or in fp32
CASES = [(torch.float32, torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16, torch.bfloat16),
         (torch.bfloat16, torch.float32, torch.bfloat16), (torch.float16, torch.float16, torch.float16),
         (torch.float16, torch.float32, torch.float16), (torch.bfloat16, torch.float32, torch.float32),
         (torch.bfloat16, torch.bfloat16, torch.float32)]


def routed(tokens: int, k: int, experts: int, hidden: int, dtypes: tuple, sentinels: bool, seed: int, device: str = "cpu"):
    """(dispatch, rows) of a random routing; rows of scales 2^-30..2^30 (fp16: 2^-12..2^8; roundings at every add), some -0,
    sentinel rows NaN."""
    rows_dt, w_dt, _ = dtypes
    g = torch.Generator().manual_seed(seed)
    idx = torch.stack([torch.randperm(experts + sentinels, generator=g)[:k] for _ in range(tokens)])
    d = dispatch(idx.to(device), torch.rand(tokens, k, generator=g).to(device=device, dtype=w_dt), experts, sentinels)
    span = (-12, 8) if rows_dt == torch.float16 else (-30, 30)  # within fp16's range: no inf - inf
    rows = torch.randn(tokens * k, hidden, generator=g) * 2.0 ** torch.randint(*span, (tokens * k, 1), generator=g)
    rows[::5, ::3] = -0.0
    rows = rows.to(device=device, dtype=rows_dt)
    if sentinels:
        rows[~d.valid.squeeze(-1)] = float("nan")
    return d, rows


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    bits = {4: torch.int32, 2: torch.int16}[a.element_size()]
    return a.dtype == b.dtype and torch.equal(a.view(bits), b.view(bits))
