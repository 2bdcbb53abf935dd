"""Launching: tile configs, a small autotuner for CUDA tensors, and input / output views.

CPU tensors run under Triton's interpreter with one fixed, large tile (fewer interpreted programs).
CUDA tensors of at least :data:`TUNE_MIN_NUMEL` elements time a few candidate configs once per
(kernel, constexprs, size bucket, candidates) with ``triton.testing.do_bench`` and keep the fastest; smaller ones
take the first candidate. Sizes count by their next power of two: tuning syncs the device and launches the kernel
about a hundred times, which a key of exact sizes would repeat for every new batch shape (each token count of an
eval loop); any config of a bucket is valid for all its sizes (the kernels mask their tiles), and the key holds the
candidates, so the kept config is always one of the call's own. Every kernel is pure (writes only its outputs), so
re-running it while tuning is safe.
Every launch passes ``enable_fp_fusion=False`` (see :mod:`._numerics`).
"""

from __future__ import annotations

from typing import Callable, Sequence

import torch

TUNE_MIN_NUMEL = 1 << 22
_BEST: dict[tuple, dict] = {}


def next_pow2(n: int) -> int:
    return 1 if n <= 1 else 1 << (int(n) - 1).bit_length()


def in_view(x: torch.Tensor) -> tuple[torch.Tensor, int]:
    """The contiguous input as the kernels read it, and its ``IN_DT`` code."""
    x = x.contiguous()
    if x.dtype == torch.bfloat16:
        return x.view(torch.int16), 2
    return x, 0 if x.dtype == torch.float32 else 1


def out_view(out: torch.Tensor) -> tuple[torch.Tensor, int]:
    """The fake-quant output as the kernels write it, and its ``OUT_DT`` code."""
    if out.dtype == torch.float32:
        return out, 0
    if out.dtype == torch.float16:
        return out, 3
    return (out, 1) if out.is_cuda else (out.view(torch.int16), 2)


def launch(kernel, grid: Callable[[dict], tuple], args: Sequence, consts: dict, candidates: Sequence[dict], device: torch.device,
           numel: int) -> None:
    """Run ``kernel`` with the best of ``candidates`` (dicts of tile constexprs plus ``num_warps``)."""
    if device.type != "cuda":
        cfg = candidates[0]
    elif len(candidates) == 1 or numel < TUNE_MIN_NUMEL:
        cfg = candidates[0]
    else:
        key = (kernel.fn.__name__ if hasattr(kernel, "fn") else str(kernel), tuple(sorted(consts.items())),
               tuple(a if isinstance(a, bool) else next_pow2(a) for a in args if isinstance(a, int)), device.index,
               tuple(tuple(sorted(c.items())) for c in candidates))
        cfg = _BEST.get(key)
        if cfg is None:
            cfg = _BEST[key] = _tune(kernel, grid, args, consts, candidates)
    _run(kernel, grid, args, consts, cfg)


def _run(kernel, grid, args, consts, cfg) -> None:
    meta = {**consts, **cfg}
    kernel[grid(meta)](*args, **meta, enable_fp_fusion=False)


def _tune(kernel, grid, args, consts, candidates) -> dict:
    from triton.testing import do_bench

    best, best_t = candidates[0], float("inf")
    for cfg in candidates:
        t = do_bench(lambda cfg=cfg: _run(kernel, grid, args, consts, cfg), warmup=5, rep=20, return_mode="median")
        if t < best_t:
            best, best_t = cfg, t
    return best


def tile_1d_candidates(R: int, NB: int, BP: int, cuda: bool) -> list[dict]:
    """(ROWS, NBT, num_warps) tiles of a [R, NB blocks of BP] layout."""

    def tile(elems: int, warps: int) -> dict:
        nbt = min(next_pow2(NB), max(1, elems // BP))
        rows = max(1, min(next_pow2(R), elems // (nbt * BP)))
        return {"ROWS": rows, "NBT": nbt, "num_warps": warps}

    if not cuda:
        return [tile(8192, 4)]
    out = []
    for cfg in (tile(4096, 8), tile(2048, 4), tile(8192, 8), tile(4096, 4)):
        if cfg not in out:
            out.append(cfg)
    return out


def tile_2d_candidates(BMP: int, BKP: int, cuda: bool) -> list[dict]:
    if not cuda:
        return [{"num_warps": 4}]
    return [{"num_warps": 8}, {"num_warps": 4}] if BMP * BKP >= 4096 else [{"num_warps": 4}, {"num_warps": 2}]


def tile_row_candidates(R: int, C: int, cuda: bool) -> list[dict]:
    """(ROWS, BC, num_warps) tiles of a [R, C] elementwise layout."""

    def tile(elems: int, bc: int, warps: int) -> dict:
        bc = min(next_pow2(C), bc)
        return {"ROWS": max(1, min(next_pow2(R), elems // bc)), "BC": bc, "num_warps": warps}

    if not cuda:
        return [tile(8192, 1024, 4)]
    out = []
    for cfg in (tile(4096, 1024, 8), tile(2048, 512, 4), tile(8192, 2048, 8)):
        if cfg not in out:
            out.append(cfg)
    return out


def tile_dynrow_candidates(R: int, C: int, cuda: bool) -> list[dict]:
    """(ROWS, BC, ONE_PASS, num_warps) of the per-row dynamic amax: a row in one tile when it fits."""
    limit = 16384 if cuda else 8192
    if next_pow2(C) <= limit:
        bc = next_pow2(C)
        rows = max(1, min(next_pow2(R), (8192 if cuda else 8192) // bc))
        if not cuda:
            return [{"ROWS": rows, "BC": bc, "ONE_PASS": True, "num_warps": 4}]
        cands = [{"ROWS": rows, "BC": bc, "ONE_PASS": True, "num_warps": 8}, {"ROWS": max(1, rows // 2), "BC": bc, "ONE_PASS": True,
                                                                              "num_warps": 4}]
        if bc >= 8192:
            cands.append({"ROWS": 1, "BC": bc, "ONE_PASS": True, "num_warps": 16})
        return cands
    return [{"ROWS": 1, "BC": 4096, "ONE_PASS": False, "num_warps": 8}, {"ROWS": 2, "BC": 2048, "ONE_PASS": False, "num_warps": 8}]
