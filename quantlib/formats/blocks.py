"""Block views of a tensor: zero padding of partial blocks and the per-block amax (docs/design.md §3)."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def check_block(x: torch.Tensor, block: tuple[int, ...]) -> None:
    """Raise a clear error for a block that cannot tile ``x``."""
    if len(block) not in (1, 2) or any(int(b) <= 0 for b in block):
        raise ValueError(f"block must be (B,) or (BM, BK) of positive sizes, got {block}")
    if x.dim() < len(block):
        raise ValueError(f"a {len(block)}-D block {block} needs an input of rank >= {len(block)}, got {tuple(x.shape)}")


def num_blocks(n: int, b: int) -> int:
    return -(-n // b)


def blocked_shape(shape: tuple[int, ...] | torch.Size, block: tuple[int, ...]) -> tuple[int, ...]:
    """Shape of the per-block tensor (scales, amax) of an input of ``shape``."""
    shape = tuple(shape)
    if len(block) == 1:
        return shape[:-1] + (num_blocks(shape[-1], block[0]),)
    return shape[:-2] + (num_blocks(shape[-2], block[0]), num_blocks(shape[-1], block[1]))


def to_blocks(x: torch.Tensor, block: tuple[int, ...]) -> torch.Tensor:
    """View ``x`` (padded with zeros) as ``[..., nb, B]`` or ``[..., mb, kb, BM*BK]``."""
    check_block(x, block)
    if len(block) == 1:
        (b,) = block
        pad = num_blocks(x.shape[-1], b) * b - x.shape[-1]
        if pad:
            x = F.pad(x, (0, pad))
        return x.reshape(*x.shape[:-1], -1, b)
    bm, bk = block
    m, k = x.shape[-2], x.shape[-1]
    pm, pk = num_blocks(m, bm) * bm - m, num_blocks(k, bk) * bk - k
    if pm or pk:
        x = F.pad(x, (0, pk, 0, pm))
    lead = x.shape[:-2]
    xb = x.reshape(*lead, x.shape[-2] // bm, bm, x.shape[-1] // bk, bk)
    return xb.transpose(-3, -2).reshape(*lead, x.shape[-2] // bm, x.shape[-1] // bk, bm * bk)


def from_blocks(xb: torch.Tensor, block: tuple[int, ...], shape: tuple[int, ...] | torch.Size) -> torch.Tensor:
    """Inverse of :func:`to_blocks`: drop the padding and give back ``shape``."""
    shape = tuple(shape)
    if len(block) == 1:
        flat = xb.reshape(*xb.shape[:-2], xb.shape[-2] * xb.shape[-1])
        return flat[..., : shape[-1]]
    bm, bk = block
    lead = xb.shape[:-3]
    mb, kb = xb.shape[-3], xb.shape[-2]
    full = xb.reshape(*lead, mb, kb, bm, bk).transpose(-3, -2).reshape(*lead, mb * bm, kb * bk)
    return full[..., : shape[-2], : shape[-1]]


def block_amax(x: torch.Tensor, block: tuple[int, ...]) -> torch.Tensor:
    """fp32 amax of every block, shape :func:`blocked_shape`; NaN in a block gives NaN."""
    return to_blocks(x.float(), block).abs().amax(dim=-1)
