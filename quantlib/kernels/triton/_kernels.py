"""The Triton kernels: one per data layout, specialised by constexpr ``OP`` and ``KIND``.

- :func:`block1d_kernel`: blocks of ``B`` along the last dim of a ``[R, C]`` view; a program owns
  ``ROWS`` rows and ``NBT`` blocks (a ``[ROWS, NBT, BP]`` tile, ``BP = next_pow2(B)``).
- :func:`block2d_kernel`: ``BM x BK`` blocks over the last two dims of a ``[L, M, K]`` view; a program
  owns one block.
- :func:`rowwise_kernel`: INT / FP8 with a static amax broadcast over ``[R, C]``, or a dynamic amax
  per row.
- :func:`fp8_cast_kernel`: FP8 codes of ``[R, C]`` with one quantization scale, or one a row (the export
  of FP8 per tensor / per channel weights).
- :func:`absmax_kernel`: partial amax bits of a flat tensor (NVFP4's dynamic global amax).

``OP``: 0 block amax, 1 fake quant, 2 real quantization (codes + scales). ``KIND``: 0 INT, 1 FP8
blockwise, 2 MX, 3 NVFP4, 4 FP8 per tensor / channel. Every load of ``x`` happens once; outputs are
written once (one pass over device memory, the dynamic-NVFP4 global amax excepted).
"""

import triton
import triton.language as tl

from ._numerics import (
    abs_bits,
    bits_to_f32,
    clamp_nan,
    div_block,
    e2m1_code,
    e2m1_round,
    e8m0_byte,
    e8m0_inverse,
    e8m0_value,
    fp8_block_round,
    fp8_block_scale,
    fp8_byte,
    fp8_fake,
    int_fake,
    load_f32,
    mx_element,
    mx_element_code,
    nvfp4_s2,
    nvfp4_sb8,
    round_fp8,
    store_out,
)


@triton.jit
def _block_values(
    x, a, s2, lo, hi, eps, KIND: tl.constexpr, QMAX: tl.constexpr, FP8E: tl.constexpr, POW2: tl.constexpr, E2M1: tl.constexpr,
    EMAX: tl.constexpr, FLOOR: tl.constexpr, HW: tl.constexpr,
):
    """Fake-quantized fp32 values of ``x`` whose block amax ``a`` (and NVFP4 global scale ``s2``) is broadcast to its shape."""
    if KIND == 0:
        return int_fake(x, a, lo, hi, HW)
    elif KIND == 1:
        d = fp8_block_scale(a, eps, QMAX, POW2)
        return fp8_block_round(x, d, QMAX, FP8E, POW2, HW) * d
    elif KIND == 2:
        byte = e8m0_byte(a, QMAX, EMAX, FLOOR)
        y = x * e8m0_inverse(byte)
        y = tl.where(y < -QMAX, -QMAX, tl.where(y > QMAX, QMAX, y))
        if E2M1:
            v = e2m1_round(y)
        else:
            v = mx_element(y, FP8E, HW)
        return v * e8m0_value(byte)
    else:
        p = nvfp4_sb8(a, s2, HW) * s2
        return e2m1_round(div_block(x, p, HW)) * p


@triton.jit
def block1d_kernel(
    x_ptr, out_ptr, scale_ptr, amax_ptr, g_ptr, s2_ptr,
    R, C, NB, OUTC,
    lo: tl.constexpr, hi: tl.constexpr, eps: tl.constexpr, OP: tl.constexpr, KIND: tl.constexpr, STATIC: tl.constexpr,
    GROWS: tl.constexpr, B: tl.constexpr, BP: tl.constexpr, NBT: tl.constexpr, ROWS: tl.constexpr,
    IN_DT: tl.constexpr, OUT_DT: tl.constexpr,
    QMAX: tl.constexpr, FP8E: tl.constexpr, POW2: tl.constexpr, E2M1: tl.constexpr, EMAX: tl.constexpr, FLOOR: tl.constexpr,
    HW: tl.constexpr,
):
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    blks = tl.program_id(1) * NBT + tl.arange(0, NBT)
    r3 = rows[:, None, None]
    b3 = blks[None, :, None]
    j3 = tl.arange(0, BP)[None, None, :]
    col = b3 * B + j3
    mask = (r3 < R) & (col < C)
    if BP != B:
        mask = mask & (j3 < B)
    offs = r3.to(tl.int64) * C + col
    x = load_f32(x_ptr, offs, mask, IN_DT)

    r2 = rows[:, None]
    b2 = blks[None, :]
    mask2 = (r2 < R) & (b2 < NB)
    offs2 = r2.to(tl.int64) * NB + b2
    if KIND == 3:
        if GROWS:  # NVFP4 with a global amax per row (stacked experts): each row's own s2, as a [ROWS, NBT] tile
            s2 = nvfp4_s2(tl.load(g_ptr + r2.to(tl.int64) + 0 * b2, mask=mask2, other=1.0))
            s3 = s2[:, :, None]
        else:
            s2 = nvfp4_s2(tl.load(g_ptr))
            s3 = s2
    else:
        s2 = 1.0
        s3 = 1.0
    if STATIC:
        a = tl.load(amax_ptr + offs2, mask=mask2, other=1.0)
        if (KIND == 0) or (KIND == 3):  # INT, NVFP4 static blocks: NaN in a group makes its scale NaN
            a = tl.where(tl.max(abs_bits(x), axis=2) > 0x7F800000, float("nan"), a)
    else:
        a = bits_to_f32(tl.max(abs_bits(x), axis=2))
    if OP == 0:
        tl.store(amax_ptr + offs2, a, mask=mask2)
    elif OP == 1:
        v = _block_values(x, a[:, :, None], s3, lo, hi, eps, KIND, QMAX, FP8E, POW2, E2M1, EMAX, FLOOR, HW)
        store_out(out_ptr, offs, v, mask, OUT_DT)
    else:
        if KIND == 1:
            d = fp8_block_scale(a, eps, QMAX, POW2)
            tl.store(scale_ptr + offs2, d, mask=mask2)
            r = fp8_block_round(x, d[:, :, None], QMAX, FP8E, POW2, HW)
            c = tl.where(r != r, 0x7F, fp8_byte(r, FP8E, HW))  # every NaN code is 0x7F, whatever its sign
            tl.store(out_ptr + offs, c.to(tl.uint8), mask=mask)
        elif KIND == 2:
            byte = e8m0_byte(a, QMAX, EMAX, FLOOR)
            tl.store(scale_ptr + offs2, byte.to(tl.uint8), mask=mask2)
            y = x * e8m0_inverse(byte)[:, :, None]
            y = tl.where(y < -QMAX, -QMAX, tl.where(y > QMAX, QMAX, y))
            if E2M1:
                code = e2m1_code(y)
            else:
                code = mx_element_code(mx_element(y, FP8E, HW), FP8E, HW)
        else:
            sb8 = nvfp4_sb8(a, s2, HW)
            tl.store(scale_ptr + offs2, fp8_byte(sb8, 0, HW).to(tl.uint8), mask=mask2)
            if GROWS:  # s2 of every row, written by the tile of its first block
                tl.store(s2_ptr + r2.to(tl.int64) + 0 * b2, s2, mask=mask2 & (b2 == 0))
            elif (tl.program_id(0) == 0) & (tl.program_id(1) == 0):
                tl.store(s2_ptr, s2)
            code = e2m1_code(div_block(x, (sb8 * s2)[:, :, None], HW))
        if KIND == 1:
            pass
        elif (KIND == 2) and (E2M1 == 0):
            tl.store(out_ptr + offs, code.to(tl.uint8), mask=mask)
        else:
            lo4, hi4 = tl.split(tl.reshape(code, (ROWS, NBT, BP // 2, 2)))
            packed = lo4 | (hi4 << 4)
            pcol = b3 * (B // 2) + tl.arange(0, BP // 2)[None, None, :]
            tl.store(out_ptr + r3.to(tl.int64) * OUTC + pcol, packed.to(tl.uint8), mask=(r3 < R) & (pcol < OUTC))


@triton.jit
def block2d_kernel(
    x_ptr, out_ptr, scale_ptr, amax_ptr,
    M, K, MB, KB,
    lo: tl.constexpr, hi: tl.constexpr, eps: tl.constexpr, OP: tl.constexpr, KIND: tl.constexpr, STATIC: tl.constexpr,
    BM: tl.constexpr, BK: tl.constexpr, BMP: tl.constexpr, BKP: tl.constexpr,
    IN_DT: tl.constexpr, OUT_DT: tl.constexpr,
    QMAX: tl.constexpr, FP8E: tl.constexpr, POW2: tl.constexpr, HW: tl.constexpr,
):
    pid = tl.program_id(0)  # lead * MB + mb
    kb = tl.program_id(1)
    lead = pid // MB
    mb = pid - lead * MB
    rows = mb * BM + tl.arange(0, BMP)[:, None]
    cols = kb * BK + tl.arange(0, BKP)[None, :]
    mask = (rows < M) & (cols < K)
    if BMP != BM:
        mask = mask & (tl.arange(0, BMP)[:, None] < BM)
    if BKP != BK:
        mask = mask & (tl.arange(0, BKP)[None, :] < BK)
    offs = (lead.to(tl.int64) * M + rows) * K + cols
    x = load_f32(x_ptr, offs, mask, IN_DT)
    soff = pid.to(tl.int64) * KB + kb
    if STATIC:
        a = tl.load(amax_ptr + soff)
        if KIND == 0:  # INT: NaN in a group makes its scale NaN
            a = tl.where(tl.max(tl.max(abs_bits(x), axis=1), axis=0) > 0x7F800000, float("nan"), a)
    else:
        a = bits_to_f32(tl.max(tl.max(abs_bits(x), axis=1), axis=0))
    if OP == 0:
        tl.store(amax_ptr + soff, a)
    elif OP == 1:
        a11 = tl.zeros((1, 1), dtype=tl.float32) + a  # the block's scalars as tiles (div_block reduces them)
        if KIND == 0:
            v = int_fake(x, a11, lo, hi, HW)
        else:
            d = fp8_block_scale(a11, eps, QMAX, POW2)
            v = fp8_block_round(x, d, QMAX, FP8E, POW2, HW) * d
        store_out(out_ptr, offs, v, mask, OUT_DT)
    else:
        d = fp8_block_scale(a, eps, QMAX, POW2)
        tl.store(scale_ptr + soff, d)
        d11 = tl.zeros((1, 1), dtype=tl.float32) + d
        r = fp8_block_round(x, d11, QMAX, FP8E, POW2, HW)
        c = tl.where(r != r, 0x7F, fp8_byte(r, FP8E, HW))  # every NaN code is 0x7F, whatever its sign
        tl.store(out_ptr + offs, c.to(tl.uint8), mask=mask)


@triton.jit
def _row_values(x, a, lo, hi, KIND: tl.constexpr, QMAX: tl.constexpr, FP8E: tl.constexpr, HW: tl.constexpr, AMODE: tl.constexpr):
    if KIND == 0:
        if (AMODE == 3) or (AMODE == 5):  # an amax per element: a reciprocal each would not pay
            return int_fake(x, a, lo, hi, False)
        else:
            return int_fake(x, a, lo, hi, HW)
    else:
        return fp8_fake(x, a, QMAX, FP8E, HW)


@triton.jit
def _group_offsets(rows, cols, base, mask, gid_ptr, a_sr, a_sc, AMODE: tl.constexpr, ROWS: tl.constexpr, BC: tl.constexpr):
    """Offset of each element's amax in a [ROWS, BC] tile (AMODE as in :func:`rowwise_kernel`)."""
    if AMODE == 5:
        return tl.load(gid_ptr + base + cols, mask=mask, other=0).to(tl.int64)
    else:
        return rows.to(tl.int64) * a_sr + cols.to(tl.int64) * a_sc + tl.zeros((ROWS, BC), dtype=tl.int64)


@triton.jit
def rowwise_kernel(
    x_ptr, out_ptr, amax_ptr, gid_ptr, flag_ptr, gflag_ptr, R, C, a_sr, a_sc,
    lo: tl.constexpr, hi: tl.constexpr, KIND: tl.constexpr, AMODE: tl.constexpr, NAN_GROUPS: tl.constexpr,
    ROWS: tl.constexpr, BC: tl.constexpr, ONE_PASS: tl.constexpr, NCH: tl.constexpr,
    IN_DT: tl.constexpr, OUT_DT: tl.constexpr, QMAX: tl.constexpr, FP8E: tl.constexpr, HW: tl.constexpr,
):
    """AMODE: 0 one amax, 1 per row (a_sr), 2 per column (a_sc), 3 strides (a_sr, a_sc), 4 dynamic per
    row, 5 group index per element (gid). With NAN_GROUPS (static INT), a NaN element flags its group
    (``flag_ptr[group]``, ``gflag_ptr[0]``) for :func:`nan_groups_kernel`."""
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)[:, None]
    rmask = rows < R
    base = rows.to(tl.int64) * C
    if AMODE == 4:
        cols = tl.arange(0, BC)[None, :]
        if ONE_PASS:
            mask = rmask & (cols < C)
            x = load_f32(x_ptr, base + cols, mask, IN_DT)
            a = bits_to_f32(tl.max(abs_bits(x), axis=1))[:, None]
            store_out(out_ptr, base + cols, _row_values(x, a, lo, hi, KIND, QMAX, FP8E, HW, AMODE), mask, OUT_DT)
        else:
            m = tl.zeros((ROWS, BC), dtype=tl.int32)
            for ch in range(0, NCH):
                c0 = ch * BC
                mask = rmask & (cols + c0 < C)
                m = tl.maximum(m, abs_bits(load_f32(x_ptr, base + c0 + cols, mask, IN_DT)))
            a = bits_to_f32(tl.max(m, axis=1))[:, None]
            for ch in range(0, NCH):
                c0 = ch * BC
                mask = rmask & (cols + c0 < C)
                x = load_f32(x_ptr, base + c0 + cols, mask, IN_DT)
                store_out(out_ptr, base + c0 + cols, _row_values(x, a, lo, hi, KIND, QMAX, FP8E, HW, AMODE), mask, OUT_DT)
    else:
        cols = tl.program_id(1) * BC + tl.arange(0, BC)[None, :]
        mask = rmask & (cols < C)
        x = load_f32(x_ptr, base + cols, mask, IN_DT)
        if AMODE == 0:
            a = tl.zeros((1, 1), dtype=tl.float32) + tl.load(amax_ptr)  # a tile: div_block reduces it
        elif AMODE == 1:
            a = tl.load(amax_ptr + rows.to(tl.int64) * a_sr, mask=rmask, other=1.0)
        elif AMODE == 2:
            a = tl.load(amax_ptr + cols.to(tl.int64) * a_sc, mask=cols < C, other=1.0)
        else:
            a = tl.load(amax_ptr + _group_offsets(rows, cols, base, mask, gid_ptr, a_sr, a_sc, AMODE, ROWS, BC), mask=mask, other=1.0)
        store_out(out_ptr, base + cols, _row_values(x, a, lo, hi, KIND, QMAX, FP8E, HW, AMODE), mask, OUT_DT)
        if NAN_GROUPS:
            isnan = mask & (x != x)
            # the flags' per-element offsets cost registers and instructions like the math: only for a
            # tile that holds a NaN
            if tl.max(isnan.to(tl.int32)) != 0:
                aoff = _group_offsets(rows, cols, base, mask, gid_ptr, a_sr, a_sc, AMODE, ROWS, BC)
                ones = tl.full((ROWS, BC), 1, tl.int32)
                tl.atomic_max(flag_ptr + aoff, ones, mask=isnan)
                tl.atomic_max(gflag_ptr + tl.zeros((ROWS, BC), dtype=tl.int32), ones, mask=isnan)


@triton.jit
def nan_groups_kernel(
    out_ptr, gid_ptr, flag_ptr, gflag_ptr, R, C, a_sr, a_sc, NTILES_C, NTILES, ITERS: tl.constexpr,
    AMODE: tl.constexpr, ROWS: tl.constexpr, BC: tl.constexpr, NPROG: tl.constexpr, OUT_DT: tl.constexpr,
):
    """Writes NaN over every group that :func:`rowwise_kernel` flagged; a no-op without NaN."""
    if tl.load(gflag_ptr) != 0:
        for i in range(0, ITERS):
            t = tl.program_id(0) + i * NPROG
            tr = t // NTILES_C
            rows = tr * ROWS + tl.arange(0, ROWS)[:, None]
            cols = (t - tr * NTILES_C) * BC + tl.arange(0, BC)[None, :]
            mask = (rows < R) & (cols < C) & (t < NTILES)
            base = rows.to(tl.int64) * C
            aoff = _group_offsets(rows, cols, base, mask, gid_ptr, a_sr, a_sc, AMODE, ROWS, BC)
            flagged = tl.load(flag_ptr + aoff, mask=mask, other=0) != 0
            nan = tl.full((ROWS, BC), float("nan"), tl.float32)
            store_out(out_ptr, base + cols, nan, mask & flagged, OUT_DT)


@triton.jit
def fp8_cast_kernel(
    x_ptr, out_ptr, s_ptr, R, C, PER_ROW: tl.constexpr, ROWS: tl.constexpr, BC: tl.constexpr,
    IN_DT: tl.constexpr, QMAX: tl.constexpr, FP8E: tl.constexpr, HW: tl.constexpr,
):
    """``out = fp8_byte(cast(clamp(x * s, -Q, Q)))`` with the precomputed scale ``s`` (``s_ptr[0]``, or
    ``s_ptr[row]`` with PER_ROW): the codes whose fake quantization the model was evaluated with."""
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)[:, None]
    cols = tl.program_id(1) * BC + tl.arange(0, BC)[None, :]
    rmask = rows < R
    mask = rmask & (cols < C)
    offs = rows.to(tl.int64) * C + cols
    x = load_f32(x_ptr, offs, mask, IN_DT)
    if PER_ROW:
        s = tl.load(s_ptr + rows, mask=rmask, other=1.0)
    else:
        s = tl.zeros((1, 1), dtype=tl.float32) + tl.load(s_ptr)
    r = round_fp8(clamp_nan(x * s, -QMAX, QMAX), FP8E, HW)
    tl.store(out_ptr + offs, fp8_byte(r, FP8E, HW).to(tl.uint8), mask=mask)


@triton.jit
def absmax_kernel(x_ptr, part_ptr, N, BLOCK: tl.constexpr, IN_DT: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    x = load_f32(x_ptr, offs, offs < N, IN_DT)
    tl.store(part_ptr + tl.program_id(0), tl.max(abs_bits(x), axis=0))
