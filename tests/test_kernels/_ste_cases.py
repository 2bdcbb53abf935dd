"""Cases of the straight-through gradient: (spec, input shape, amax shape or None); shared by the CPU
and GPU tests of :func:`quantlib.kernels.ops.ste_grad`."""

from __future__ import annotations

import torch

from quantlib.formats import FormatSpec, Kind
from quantlib.formats.blocks import blocked_shape

FP8 = FormatSpec(kind=Kind.FP8, element=(4, 3))
INT8 = FormatSpec(kind=Kind.INT, num_bits=8)

#: (id, spec, x shape, amax shape); amax shape None: the format's mask needs none (gradient passes)
CASES = [
    ("per-tensor 0-dim", FP8, (6, 40), ()),
    ("per-tensor (1,)", INT8, (6, 40), (1,)),
    ("per-tensor (1,1) rank 3", FP8, (2, 3, 40), (1, 1)),
    ("per-tensor rank 1", INT8, (37,), ()),
    ("per-row", INT8, (6, 40), (6, 1)),
    ("per-row rank 3", FP8, (2, 3, 40), (2, 3, 1)),
    ("per-column", INT8, (6, 40), (40,)),
    ("per-column 2-D", FP8, (2, 3, 40), (1, 40)),
    ("an amax per element", FP8, (6, 40), (6, 40)),
    ("no 2-D view", INT8, (2, 3, 4), (1, 3, 1)),
    ("int block 16", FormatSpec(kind=Kind.INT, num_bits=4, block=(16,)), (6, 40), "blocks"),
    ("int block (1,16) rank 3", FormatSpec(kind=Kind.INT, num_bits=4, block=(1, 16)), (2, 3, 40), "blocks"),
    ("fp8 block 2-D", FormatSpec(kind=Kind.FP8_BLOCK, element=(4, 3), block=(8, 16)), (2, 20, 40), "blocks"),
    ("int block 2-D", FormatSpec(kind=Kind.INT, num_bits=8, block=(4, 8)), (10, 20), "blocks"),
    ("nvfp4 static", FormatSpec(kind=Kind.NVFP4, element=(2, 1), block=(16,)), (6, 48), ()),
    ("nvfp4 dynamic, global amax", FormatSpec(kind=Kind.NVFP4, element=(2, 1), block=(16,), dynamic=True), (6, 48), ()),
]


def amax_for(spec: FormatSpec, shape: tuple, amax_shape, seed: int = 0) -> torch.Tensor:
    """An fp32 amax of ``amax_shape`` ("blocks": the blocked shape) with values around 1."""
    if amax_shape == "blocks":
        block = tuple(spec.block)
        amax_shape = blocked_shape(shape, block[1:] if len(block) == 2 and block[0] == 1 else block)
    g = torch.Generator().manual_seed(seed)
    return 0.5 + torch.rand(amax_shape, generator=g)


def inputs(shape: tuple, amax: torch.Tensor, dtype: torch.dtype, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """(x, grad): x around the amax, with values at exactly +-amax (as x's dtype rounds it), NaN, Inf
    and -0; grad random with NaN, Inf and -0 among its values."""
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(shape, generator=g) * 1.2).to(dtype)
    flat = x.view(-1)
    n = flat.numel()
    picks = torch.randperm(n, generator=g)
    top = float(amax.max())
    specials = [float("nan"), float("inf"), -float("inf"), -0.0, 0.0, top, -top, 2.0 * top]
    for i, v in enumerate(specials[: n // 4]):
        flat[picks[i]] = v
    # values exactly at a single amax (per tensor): the boundary is inside
    if amax.numel() == 1:
        a = float(amax.reshape(()))
        for i, v in enumerate((a, -a, a * (1 + 2**-20))[: max(0, n // 4 - len(specials))]):
            flat[picks[len(specials) + i]] = v
    grad = torch.randn(shape, generator=g).to(dtype)
    gf = grad.view(-1)
    for i, v in enumerate([float("nan"), float("inf"), -0.0][: n // 4]):
        gf[picks[-1 - i]] = v
    return x, grad


_INT_VIEW = {torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.float16: torch.int16}


def bits(t: torch.Tensor) -> torch.Tensor:
    """The bits of a float tensor as integers, on the CPU (NaN payloads and -0 compare exactly)."""
    return t.detach().cpu().contiguous().view(_INT_VIEW[t.dtype])
