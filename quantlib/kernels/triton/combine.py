"""The combine of a top-k MoE layer in one pass: each token's k expert rows gathered, weighted and added in
order, with the roundings of the torch formula (:func:`quantlib.plugins.expert_dispatch.combine`):
``rows * weight`` in their promoted dtype, sentinel rows set to zero, the result cast to the output dtype,
then the k adds from zeros in the output dtype (a rounding after each add), in the token's given order.

Every rounding is an IEEE fp32 operation followed by a round to nearest even done on the bits (bf16) or by
the fp16 cast, so the interpreter (tests) and the GPU compute the same bits; launched with
``enable_fp_fusion=False`` (:func:`._launch.launch`): a fused multiply-add would skip the product's rounding.
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from ._launch import in_view, launch, next_pow2, out_view
from ._numerics import load_f32, store_out

#: how the kernel rounds a value to each dtype (0: fp32 as is)
_ROUND = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}


@triton.jit
def _round(v, DT: tl.constexpr):
    """fp32 ``v`` rounded to nearest even in dtype ``DT`` (0 fp32, 1 fp16, 2 bf16), as fp32."""
    if DT == 1:
        return v.to(tl.float16).to(tl.float32)
    elif DT == 2:
        b = v.to(tl.int32, bitcast=True)
        r = ((b + 0x7FFF + ((b >> 16) & 1)) & -65536).to(tl.float32, bitcast=True)
        return tl.where(v != v, v, r)
    else:
        return v


@triton.jit
def combine_kernel(rows_ptr, w_ptr, valid_ptr, idx_ptr, out_ptr, H, idx_st, idx_sj,
                   K: tl.constexpr, BLOCK_H: tl.constexpr, ROW_DT: tl.constexpr, W_DT: tl.constexpr, PROD_RND: tl.constexpr,
                   OUT_RND: tl.constexpr, OUT_DT: tl.constexpr, HAS_W: tl.constexpr, HAS_VALID: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    mask = cols < H
    acc = tl.zeros([BLOCK_H], dtype=tl.float32)
    for j in tl.static_range(K):
        r = tl.load(idx_ptr + t * idx_st + j * idx_sj).to(tl.int64)
        v = load_f32(rows_ptr, r * H + cols, mask, ROW_DT)
        if HAS_W:
            v = _round(v * load_f32(w_ptr, r + cols * 0, mask, W_DT), PROD_RND)
        if HAS_VALID:
            v = tl.where(tl.load(valid_ptr + r) != 0, v, 0.0)  # unset rows (NaN * 0 is NaN): zero
        acc = _round(acc + _round(v, OUT_RND), OUT_RND)
    store_out(out_ptr, t * H + cols, acc, mask, OUT_DT)


def supported(rows: torch.Tensor, weight: Optional[torch.Tensor], dtype: torch.dtype) -> bool:
    """Whether :func:`combine_rows` takes these dtypes (fp32, fp16, bf16 and their promotions)."""
    return rows.dtype in _ROUND and dtype in _ROUND and (weight is None or weight.dtype in _ROUND)


def combine_rows(rows: torch.Tensor, weight: Optional[torch.Tensor], valid: Optional[torch.Tensor], combine_index: torch.Tensor,
                 dtype: torch.dtype) -> torch.Tensor:
    """(tokens, H) in ``dtype``: for each token t, zeros plus, for j = 0..k-1 in order, ``row = rows[combine_index[t, j]]``
    times its ``weight`` (None: 1), zero where ``valid`` (S, 1) is False, cast to ``dtype``; bit for bit the torch ops."""
    if not supported(rows, weight, dtype):
        raise TypeError(f"combine_rows: rows {rows.dtype}, weight {None if weight is None else weight.dtype}, output {dtype}: "
                        "only float32, float16 and bfloat16 are supported")
    tokens, k = combine_index.shape
    h = rows.shape[1]
    out = torch.empty(tokens, h, dtype=dtype, device=rows.device)
    if out.numel() == 0:
        return out
    prod = rows.dtype if weight is None else torch.promote_types(rows.dtype, weight.dtype)
    rows_v, row_dt = in_view(rows)
    w_v, w_dt = (rows_v, 0) if weight is None else in_view(weight)
    out_v, out_dt = out_view(out)
    valid_v = rows_v if valid is None else valid.reshape(-1).contiguous()
    consts = {"K": k, "ROW_DT": row_dt, "W_DT": w_dt, "PROD_RND": _ROUND[prod], "OUT_RND": _ROUND[dtype], "OUT_DT": out_dt,
              "HAS_W": weight is not None, "HAS_VALID": valid is not None}
    # one config, not tuned: a memory-bound gather whose tuning key would hold the token count (via the strides)
    candidates = [{"BLOCK_H": next_pow2(h) if not rows.is_cuda else min(next_pow2(h), 1024), "num_warps": 4}]
    launch(combine_kernel, lambda meta: (tokens, triton.cdiv(h, meta["BLOCK_H"])),
           (rows_v, w_v, valid_v, combine_index, out_v, h, combine_index.stride(0), combine_index.stride(1)), consts, candidates,
           rows.device, rows.numel())  # combine_index as dispatch makes it: (tokens, k) of strides (1, tokens), no copy
    return out


__all__ = ["combine_rows", "supported"]
