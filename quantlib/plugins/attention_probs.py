"""The attention-probabilities quantizer ``p_bmm_quantizer`` (ModelOpt's name): it fake-quantizes P,
the softmax output, before the P @ V matmul; disabled until a config enables it (``*p_bmm_quantizer``).

Where it runs:

- transformers, ``eager`` attention: the model's own eager attention function runs under
  :class:`SoftmaxQuantizer`, a torch function mode active only during that call, which passes the output
  of every softmax it calls through the quantizer (dropout then applies to the quantized P, as the eager
  code does it). An eager function that calls no softmax is refused;
- transformers, ``sdpa``: SDPA computes P inside its kernel, out of reach; with ``p_bmm_quantizer``
  enabled the module's eager attention function runs instead (same inputs, the SDPA mask turned into
  the eager additive mask), under the same mode, so the result equals the eager implementation's;
- transformers, flash / flex / paged and any other implementation: :class:`ProbsQuantizationError`,
  naming the module (those kernels never materialize P);
- Megatron-Core's local ``DotProductAttention``: the output of its ``scale_mask_softmax`` submodule,
  through :func:`quantize_output` (attention dropout then applies as Megatron applies it).
"""

from __future__ import annotations

import contextlib
import inspect
from typing import Any, Callable, Iterator, Optional

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from ..nn.tensor_quantizer import TensorQuantizer

#: the implementations whose P quantlib can reach
PROBS_IMPLEMENTATIONS = ("eager", "sdpa")

_SOFTMAX = (torch.nn.functional.softmax, torch.softmax, torch.Tensor.softmax, torch.special.softmax)


class ProbsQuantizationError(RuntimeError):
    """An enabled ``p_bmm_quantizer`` on attention whose probabilities quantlib cannot reach."""


class SoftmaxQuantizer(TorchFunctionMode):
    """While active, every softmax call returns ``quantizer(softmax(...))``; counts the calls."""

    def __init__(self, quantizer: TensorQuantizer) -> None:
        super().__init__()
        self.quantizer = quantizer
        self.calls = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        # the mode is off inside this method: the softmax below and the quantizer's own ops pass through
        out = func(*args, **(kwargs or {}))
        if func in _SOFTMAX:
            self.calls += 1
            out = self.quantizer(out)
        return out


def _where(module: nn.Module) -> str:
    name = getattr(module.p_bmm_quantizer, "_qname", None) or "p_bmm_quantizer"
    return f"{name} ({type(module).__name__})"


def _eager_attention(module: nn.Module) -> Optional[Callable]:
    """The unwrapped ``eager_attention_forward`` that the forward of ``module``'s original class calls."""
    from ..nn.quant_module import QuantModuleRegistry

    forward = inspect.unwrap(QuantModuleRegistry.original_class_of(module).forward)
    eager = forward.__globals__.get("eager_attention_forward")
    return inspect.unwrap(eager) if eager is not None else None


def _run_quantized(module: nn.Module, fn: Callable, *args, **kwargs) -> Any:
    mode = SoftmaxQuantizer(module.p_bmm_quantizer)
    with mode:
        out = fn(module, *args, **kwargs)
    if mode.calls == 0:
        raise ProbsQuantizationError(f"{_where(module)}: the eager attention function {getattr(fn, '__qualname__', fn)!r} called no "
                                     "softmax, so P was never quantized")
    return out


def _sdpa_as_eager(
    module: nn.Module,
    eager: Callable,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: Optional[torch.Tensor] = None,
    dropout: float = 0.0,
    scaling: Optional[float] = None,
    is_causal: Optional[bool] = None,
    **kwargs,
) -> Any:
    """transformers' SDPA call computed by ``eager`` with P quantized: SDPA's boolean mask (True: attend)
    becomes the additive mask eager attention takes, and a missing causal mask is built as SDPA's
    ``is_causal`` would apply it (key and value cropped to the query length, upper-left aligned)."""
    q_len = query.shape[2]
    causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    if attention_mask is None and causal and q_len > 1:
        key, value = key[:, :, :q_len], value[:, :, :q_len]
        attention_mask = torch.ones(q_len, q_len, dtype=torch.bool, device=query.device).tril()[None, None]
    if attention_mask is not None and attention_mask.dtype == torch.bool:
        zero = torch.tensor(0.0, dtype=query.dtype, device=query.device)
        attention_mask = torch.where(attention_mask, zero, torch.finfo(query.dtype).min)
    if scaling is None:
        scaling = query.shape[-1] ** -0.5  # SDPA's default scale
    return _run_quantized(module, eager, query, key, value, attention_mask, scaling=scaling, dropout=dropout, **kwargs)


def attend_with_probs(module: nn.Module, impl: str, fn: Callable, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, *args,
                      **kwargs) -> Any:
    """Attention function ``fn`` (implementation ``impl``) of ``module`` with its P quantized by
    ``module.p_bmm_quantizer``; raises :class:`ProbsQuantizationError` where P cannot be reached."""
    if impl == "eager":
        return _run_quantized(module, fn, query, key, value, *args, **kwargs)
    if impl != "sdpa":
        raise ProbsQuantizationError(
            f"{_where(module)}: attention implementation {impl!r} computes the softmax inside its kernel, where quantlib cannot "
            f"quantize it; run the model with attn_implementation in {PROBS_IMPLEMENTATIONS} or disable the quantizer "
            "(quantlib.disable_quantizer(model, '*p_bmm_quantizer'))"
        )
    eager = _eager_attention(module)
    if eager is None:
        raise ProbsQuantizationError(f"{_where(module)}: 'sdpa' attention with p_bmm_quantizer runs the model's eager attention, but its "
                                     "modeling module has no eager_attention_forward")
    return _sdpa_as_eager(module, eager, query, key, value, *args, **kwargs)


@contextlib.contextmanager
def quantize_output(softmax: nn.Module, quantizer: TensorQuantizer, where: str) -> Iterator[None]:
    """While active, the output of module ``softmax`` goes through ``quantizer``; raises
    :class:`ProbsQuantizationError` (naming ``where``) if the module was not called."""
    calls = [0]

    def hook(_module, _args, out):
        calls[0] += 1
        return quantizer(out)

    handle = softmax.register_forward_hook(hook)
    try:
        yield
    finally:
        handle.remove()
    if calls[0] == 0:
        raise ProbsQuantizationError(f"{where}: the attention never called its softmax module {type(softmax).__name__}, so P was never "
                                     "quantized")


__all__ = ["PROBS_IMPLEMENTATIONS", "ProbsQuantizationError", "SoftmaxQuantizer", "attend_with_probs", "quantize_output"]
