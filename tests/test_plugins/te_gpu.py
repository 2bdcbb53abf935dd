"""Helpers of the GPU tests on real Transformer Engine (tests/plugins/test_te_gpu.py,
test_megatron_te_gpu.py): the presets under test, the fake-quant references computed through the same
TE GEMM, and Megatron's single-GPU parallel state. Imports TE only when called."""

from __future__ import annotations

import contextlib
from typing import Callable, Iterator, Optional

import torch
from torch import nn

import quantlib as ql
from quantlib.model_quant import iter_leaf_quantizers, leaves_of
from quantlib.nn import GroupedQuantizer, TensorQuantizer
from quantlib.nn.containers import QuantizerContainer
from quantlib.plugins.te_adapters import swapped

#: every preset TE modules are tested with (weight + activation, and weight-only ones)
PRESETS = {
    "fp8": ql.FP8_DEFAULT_CFG,
    "fp8_block": ql.FP8_BLOCKWISE_CFG,
    "nvfp4": ql.NVFP4_DEFAULT_CFG,
    "mxfp8": ql.MXFP8_DEFAULT_CFG,
    "int8": ql.INT8_DEFAULT_CFG,
    "int4_block": ql.INT4_BLOCKWISE_WEIGHT_ONLY_CFG,
    "w4a8": ql.W4A8_AWQ_BETA_CFG,
}


def gpu_and_te() -> Optional[str]:
    """None where a CUDA GPU and TE's torch binding are there, else why the TE GPU tests skip."""
    if not torch.cuda.is_available():
        return "needs a CUDA GPU"
    try:
        import transformer_engine.pytorch  # noqa: F401
    except Exception as exc:  # the binding fails with ImportError, OSError or RuntimeError by release
        return f"needs Transformer Engine's torch binding ({type(exc).__name__}: {exc})"
    return None


def require_megatron_te() -> None:
    """Skip the calling test module (at import) without a GPU, TE's binding, Megatron-Core or psutil."""
    import pytest

    why = gpu_and_te()
    if why is not None:
        pytest.skip(why, allow_module_level=True)
    pytest.importorskip("megatron.core", reason="needs megatron-core")
    pytest.importorskip("psutil", reason="Megatron dist checkpointing hangs without psutil")


def leaf_amaxes(module: nn.Module) -> list[Optional[torch.Tensor]]:
    """The amax of every leaf quantizer of ``module`` (a model, or a quantizer itself), in order."""
    if isinstance(module, (TensorQuantizer, QuantizerContainer)):
        return [q.amax for _, q in leaves_of("q", module)]
    return [q.amax for _, q in iter_leaf_quantizers(module)]


def weight_members(module: nn.Module) -> list[nn.Module]:
    """The weight quantizer of each GEMM (the members of a grouped one, else the one quantizer)."""
    q = module.weight_quantizer
    return list(q) if isinstance(q, GroupedQuantizer) else [q]


def weight_names(module: nn.Module) -> list[str]:
    """The weight parameters of a TE linear (``weight``) or grouped linear (``weight0..``)."""
    n = getattr(module, "num_gemms", None)
    return ["weight"] if n is None else [f"weight{i}" for i in range(n)]


def load_fake_quant_weights(reference: nn.Module, quantized: nn.Module) -> None:
    """Give the unquantized ``reference`` the fake-quantized weights of ``quantized`` and its other
    parameters (biases, norm weights) as they are."""
    members = weight_members(quantized)
    names = weight_names(quantized)
    with torch.no_grad():
        for name, p in reference.named_parameters():
            source = quantized.get_parameter(name)
            if name in names:
                source = members[names.index(name)](source)
            p.copy_(source)


@contextlib.contextmanager
def quantized_norm_output(module: nn.Module, input_quantizer: nn.Module) -> Iterator[None]:
    """Apply ``input_quantizer`` to what a (reference, unquantized) LayerNormLinear's normalization returns:
    the GEMM input of the quantized module (under TE's autocast, before TE's FP8 cast, as the quantized one does)."""
    from transformer_engine.pytorch.module import layernorm_linear

    from quantlib.plugins.te_adapters import quantized_norm

    name = next(n for n in ("apply_normalization", "_apply_normalization") if hasattr(layernorm_linear, n))
    norm = getattr(layernorm_linear, name)
    with swapped(layernorm_linear, name, quantized_norm(norm, input_quantizer, 5 if name == "apply_normalization" else None)):
        yield


def recipes() -> dict:
    """TE's FP8 autocast recipes of sm_90, by name (quantlib's fake quant runs under each)."""
    from transformer_engine.common import recipe

    return {
        "delayed": recipe.DelayedScaling(fp8_format=recipe.Format.HYBRID, amax_history_len=16, amax_compute_algo="max"),
        "current": recipe.Float8CurrentScaling(),
        "block": recipe.Float8BlockScaling(),
    }


def autocast(recipe):
    """TE's autocast with ``recipe`` (``te.autocast`` from 2.x on; ``fp8_autocast`` before)."""
    import transformer_engine.pytorch as te

    if hasattr(te, "autocast"):
        return te.autocast(enabled=True, recipe=recipe)
    return te.fp8_autocast(enabled=True, fp8_recipe=recipe)


def give_main_grad(module: nn.Module, fill: float = 0.0) -> list[nn.Parameter]:
    """Give every parameter of ``module`` an fp32 ``main_grad`` filled with ``fill`` and Megatron DDP's
    ``grad_added_to_main_grad = False``, as Megatron's DistributedDataParallel does before a backward."""
    params = [p for p in module.parameters() if p.requires_grad]
    for p in params:
        p.main_grad = torch.full(p.shape, fill, dtype=torch.float32, device=p.device)
        p.grad_added_to_main_grad = False
    return params


def zero_main_grad(params: list[nn.Parameter]) -> None:
    """Megatron DDP's ``zero_grad_buffer`` before a step: ``main_grad`` zeroed, nothing added to it yet, no ``grad``."""
    for p in params:
        p.main_grad.zero_()
        p.grad_added_to_main_grad = False
        p.grad = None


def finish_main_grad(params: list[nn.Parameter]) -> None:
    """What Megatron's DDP does after a backward: a gradient TE did not add to ``main_grad`` is added now
    (``weight.grad`` then released); the optimizer reads ``main_grad``, here copied into ``grad``."""
    for p in params:
        if p.grad is not None and not p.grad_added_to_main_grad:
            p.main_grad.add_(p.grad)
        p.grad = p.main_grad.to(p.dtype)


def reference_output(quantized: nn.Module, build: Callable[[], nn.Module], layernorm: bool, *args) -> torch.Tensor:
    """The fake-quant reference of ``quantized(*args)``: a fresh unquantized module of the same class and
    config, holding the fake-quantized weights, fed the fake-quantized input, through the same TE GEMM."""
    ref = build()
    load_fake_quant_weights(ref, quantized)
    x, *rest = args
    with torch.no_grad():
        if layernorm:
            with quantized_norm_output(ref, quantized.input_quantizer):
                out = ref(x, *rest)
        else:
            out = ref(quantized.input_quantizer(x), *rest)
    out = out[0] if isinstance(out, tuple) else out
    return quantized.output_quantizer(out)


def first(out):
    """The output tensor of a TE module or Megatron wrapper (which return ``(out, bias)``)."""
    return out[0] if isinstance(out, tuple) else out


def init_megatron_tp1(seed: int = 0) -> bool:
    """Megatron's parallel state for one GPU (TP = EP = PP = 1) on the running default group, or on a
    new NCCL group of one rank; reinitialized each call, whatever ran before in the process. Returns
    whether it created the default group (then :func:`release_megatron` destroys it)."""
    from megatron.core import parallel_state as mpu
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    created = not torch.distributed.is_initialized()
    if created:
        from tests.ranks import free_port

        torch.distributed.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    mpu.destroy_model_parallel()
    mpu.initialize_model_parallel(1, 1)
    model_parallel_cuda_manual_seed(seed)
    return created


def release_megatron(created: bool) -> None:
    """Undo :func:`init_megatron_tp1`: later tests in the process must not calibrate over Megatron's
    groups (``quantlib.distributed.discover_parallel_state`` finds them) nor fork ranks from a process
    whose default group is initialized."""
    from megatron.core import parallel_state as mpu

    mpu.destroy_model_parallel()
    if created and torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


def qat_losses(model: nn.Module, step: Callable[[nn.Module], torch.Tensor], steps: int = 6, lr: float = 1e-3) -> list[float]:
    """Losses of ``steps`` Adam steps on ``step(model)`` (the loss of one batch), first one before any step."""
    model.train()
    opt = torch.optim.Adam([p for p in model.parameters() if p.requires_grad], lr=lr)
    losses = []
    for _ in range(steps):
        opt.zero_grad(set_to_none=True)
        loss = step(model)
        loss.backward()
        opt.step()
        losses.append(float(loss))
    return losses
