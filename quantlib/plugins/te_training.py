"""Training quantized Transformer Engine modules: which of TE's ``autocast`` (``fp8_autocast``) recipes quantlib's
fake quant runs under, and TE's ``fuse_wgrad_accumulation`` contract (the weight gradient lands in
``weight.main_grad``) kept through quantlib's straight-through estimator. Nothing here imports TE.

Under TE's autocast, quantlib fake-quantizes the weight and the GEMM input in their high-precision dtype first; TE then
casts those already-quantized values to FP8 with the recipe's own scales before its GEMM. The GEMM therefore sees
``te_cast(fake_quant(x))``, a second rounding:

- ``Float8CurrentScaling`` (each tensor scaled by 448 / its own amax): where quantlib's per-tensor FP8 E4M3 fake quant
  reaches its amax (weights under max calibration), TE's cast gives back quantlib's E4M3 codes, with quantlib's scale up
  to fp32 rounding (the GEMM then even skips the bf16 rounding of the fake-quantized values). Anything else (a static
  input amax above the batch's maximum, per-channel or block scales, INT, 4-bit formats) is rounded again to E4M3.
- ``DelayedScaling``: as current scaling, but with the scale of earlier steps' amax history (1.0 at the first step):
  the E4M3 codes are not recovered in general.
- ``Float8BlockScaling`` (weights in 128x128 blocks, inputs in 1x128 tiles, power-of-2 scales by default): rounded again
  per block by TE; of a quantlib FP8 128x128 weight, TE's block amax is quantlib's, but TE's power-of-2 scale is not.

Those three (the FP8 recipes of sm_90) run: the result equals TE's own FP8 GEMM of the fake-quantized tensors (the GPU
tests check it bit for bit against an unquantized TE module given them), not quantlib's fake-quant numerics alone.
``MXFP8BlockScaling``, ``NVFP4BlockScaling`` (sm_100) and custom recipes are refused by name: their rounding of
already fake-quantized values has not been run on a GPU that has them.
"""

from __future__ import annotations

from typing import Any, Optional

import torch

#: TE recipe classes quantlib's fake quant runs under (the FP8 recipes of sm_90; see the module docstring)
SUPPORTED_RECIPES = ("DelayedScaling", "Float8CurrentScaling", "Float8BlockScaling")


def check_recipe(where: str, recipe: Any) -> None:
    """Refuse, naming ``where`` and the recipe, a TE autocast recipe quantlib's fake quant does not run under."""
    name = type(recipe).__name__
    if any(cls.__name__ in SUPPORTED_RECIPES for cls in type(recipe).__mro__):
        return
    raise RuntimeError(
        f"{where}: quantlib's fake quant under Transformer Engine's autocast recipe {name} is not supported: TE would "
        f"round the fake-quantized weights and inputs again with {name}'s scales, which has not been verified (it needs "
        f"sm_100); supported: {', '.join(SUPPORTED_RECIPES)}, or run the quantized model outside TE's autocast"
    )


def check_fused_wgrad(where: str, weight: torch.Tensor) -> None:
    """Refuse a weight TE's ``fuse_wgrad_accumulation`` cannot accumulate into (no ``main_grad`` to write)."""
    if not isinstance(weight, torch.nn.Parameter):
        raise RuntimeError(f"{where}: fuse_wgrad_accumulation=True needs the weight to be a parameter with main_grad, got a "
                           f"{type(weight).__name__} (split weights are concatenated by TE: not supported)")  # fmt: skip
    if not hasattr(weight, "main_grad") and not hasattr(weight, "get_main_grad"):
        raise RuntimeError(f"{where}: fuse_wgrad_accumulation=True but the weight has no main_grad (Megatron's DDP allocates it; "
                           "set weight.main_grad, or build the layer with fuse_wgrad_accumulation=False)")  # fmt: skip


def _main_grad(weight: torch.nn.Parameter) -> torch.Tensor:
    """The buffer TE writes the weight gradient into (Megatron-FSDP creates it lazily through ``get_main_grad``)."""
    if hasattr(weight, "__fsdp_param__") and hasattr(weight, "get_main_grad"):
        return weight.get_main_grad()
    return weight.main_grad


class _ToMainGrad(torch.autograd.Function):
    """Identity on a weight parameter; its backward adds the gradient that reached it (after quantlib's STE) into
    ``weight.main_grad`` as TE's fused wgrad GEMM would, and hands autograd what TE hands it: nothing, or, where
    Megatron's DDP marks the parameter (``grad_added_to_main_grad``), a dummy gradient (zeros)."""

    @staticmethod
    def forward(ctx, weight: torch.nn.Parameter, overwrite: bool) -> torch.Tensor:
        ctx.weight, ctx.overwrite = weight, overwrite
        return weight.view_as(weight)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        weight, overwrite = ctx.weight, ctx.overwrite
        ctx.weight = None
        main = _main_grad(weight)
        if overwrite:
            main.copy_(grad)
        else:
            main.add_(grad)
        if hasattr(weight, "grad_added_to_main_grad"):
            weight.grad_added_to_main_grad = True
            # Megatron's DDP hook skips it (grad_added_to_main_grad) but fires on it (reduction buckets count hooks);
            # zeros, as TE's dummy with zero_out_wgrad, so that adding it is harmless too
            return torch.zeros_like(weight), None
        return None, None


def to_main_grad(weight: torch.Tensor, is_first_microbatch: Optional[bool]) -> torch.Tensor:
    """``weight`` (a parameter with ``main_grad``) as a tensor whose gradient goes into ``weight.main_grad`` instead of
    ``weight.grad``: added, or written over where TE would (``overwrite_main_grad``, or the first microbatch when
    ``is_first_microbatch`` is given)."""
    overwrite = bool(getattr(weight, "overwrite_main_grad", False)) or is_first_microbatch is True
    return _ToMainGrad.apply(weight, overwrite)


__all__ = ["SUPPORTED_RECIPES", "check_fused_wgrad", "check_recipe", "to_main_grad"]
