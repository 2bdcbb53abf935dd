"""KV-cache quantizers in transformers' attention, inserted at its attention interface.

transformers' attention modules (Llama, Qwen3, Qwen3-MoE and most others since 4.48) compute q/k/v,
apply RoPE and the cache update, then call ``ALL_ATTENTION_FUNCTIONS.get_interface(impl,
eager_attention_forward)(self, query, key, value, mask, ...)``. This plugin never copies that code:

- every class whose ``forward`` looks up ``ALL_ATTENTION_FUNCTIONS`` (found in the modeling modules
  already imported) is registered with :class:`QuantHFAttention`, which adds ``q_bmm_quantizer``,
  ``k_bmm_quantizer``, ``v_bmm_quantizer`` and ``p_bmm_quantizer`` (ModelOpt's names; disabled until a
  config enables them);
- the attention functions are wrapped once: the interface's shared entries (sdpa, flash, flex, paged)
  and each registered class's module-level ``eager_attention_forward``. The wrapper quantizes query,
  key and value when its ``module`` argument is a :class:`QuantHFAttention` and passes everything else
  through unchanged, so unquantized models are not affected; with ``p_bmm_quantizer`` enabled it hands
  the call to :func:`quantlib.plugins.attention_probs.attend_with_probs` (eager and sdpa only);
- a :class:`QuantHFAttention` with an enabled quantizer whose forward did not pass through a wrapper
  (an attention function registered after the plugin loaded, or a model-local override) raises,
  naming the module and the implementation, instead of running unquantized.
"""

from __future__ import annotations

import functools
import inspect
import sys
from typing import Callable

import torch
from torch import nn

from ..kv.attention import AttentionQuantizers
from ..kv.presets import QKV_QUANTIZER_NAMES
from ..nn.quant_module import QuantModuleRegistry
from .attention_probs import attend_with_probs

_scanned: set[str] = set()


class KVQuantizationError(RuntimeError):
    """An attention module with enabled KV quantizers ran an attention function quantlib did not wrap."""


class QuantHFAttention(AttentionQuantizers):
    """Mixin for a transformers attention class that calls the attention interface."""

    # q/k/v reach the attention function as [batch, heads, seq, head dim], the layout ModelOpt's
    # FP8_AFFINE_KV_CFG bias axes (-2: seq, -4: batch) are written for; P has no such bias
    affine_quantizer_names = QKV_QUANTIZER_NAMES

    def _setup(self) -> None:
        super()._setup()
        self._kv_reached = False

    def quantize_qkv(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(query, key, value) through their quantizers (the wrapped attention function calls this)."""
        self._kv_reached = True
        if self.quantizers_off():  # the disabled path: one flag read per quantizer, no quantizer call
            return query, key, value
        return self.q_bmm_quantizer(query), self.k_bmm_quantizer(key), self.v_bmm_quantizer(value)

    def forward(self, *args, **kwargs):
        self._kv_reached = False
        out = super().forward(*args, **kwargs)
        if not self._kv_reached and any(getattr(self, n).is_enabled for n in self.quantizer_names):
            where = self.k_bmm_quantizer._qname.rsplit(".", 1)[0]
            impl = getattr(getattr(self, "config", None), "_attn_implementation", None)
            raise KVQuantizationError(
                f"{where} ({type(self).__name__}): attention implementation {impl!r} ran a function quantlib has not wrapped, so its "
                "q/k/v quantizers were never applied; call quantlib.plugins.hf_attention.refresh() after registering attention functions"
            )
        return out


def _wrap(fn: Callable, impl: str) -> Callable:
    """``fn`` (an attention function ``(module, query, key, value, ...)`` of implementation ``impl``)
    quantizing q/k/v (and P) for quantlib's modules."""
    if getattr(fn, "_quantlib_kv", False):
        return fn

    @functools.wraps(fn)
    def attention(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, *args, **kwargs):
        if isinstance(module, QuantHFAttention):
            query, key, value = module.quantize_qkv(query, key, value)
            if module.p_bmm_quantizer.is_enabled:
                return attend_with_probs(module, impl, fn, query, key, value, *args, **kwargs)
        return fn(module, query, key, value, *args, **kwargs)

    attention._quantlib_kv = True
    return attention


def _wrap_interface() -> None:
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS, AttentionInterface

    shared = AttentionInterface._global_mapping
    for key in list(shared):
        shared[key] = _wrap(shared[key], key)
    local = ALL_ATTENTION_FUNCTIONS._local_mapping
    for key in list(local):
        local[key] = _wrap(local[key], key)


def calls_attention_interface(cls: type) -> bool:
    """Whether ``cls.forward`` looks up transformers' ``ALL_ATTENTION_FUNCTIONS`` (read from its code)."""
    forward = inspect.unwrap(getattr(cls, "forward", None) or (lambda: None))
    code = getattr(forward, "__code__", None)
    return code is not None and "ALL_ATTENTION_FUNCTIONS" in code.co_names


def register_attention(cls: type) -> None:
    """Quantize the q/k/v of modules of ``cls`` (an attention class that calls the attention interface)."""
    if not calls_attention_interface(cls):
        raise TypeError(f"{cls.__module__}.{cls.__qualname__}: its forward does not call transformers' attention interface "
                        "(ALL_ATTENTION_FUNCTIONS)")
    forward_globals = inspect.unwrap(cls.forward).__globals__
    eager = forward_globals.get("eager_attention_forward")
    if eager is not None:
        forward_globals["eager_attention_forward"] = _wrap(eager, "eager")
    _wrap_interface()
    if not QuantModuleRegistry.is_registered(cls):
        QuantModuleRegistry.register(cls, cls.__name__)(type(f"_QuantAttention{cls.__name__}", (QuantHFAttention,), {}))


def refresh() -> list[str]:
    """Register the attention classes of every transformers modeling module imported since the last call
    (never imports one); wraps attention functions registered since. Returns the classes registered."""
    _wrap_interface()
    done = []
    for module_name, module in list(sys.modules.items()):
        modeling = module_name.startswith("transformers.models.") and ".modeling_" in module_name
        if module is None or module_name in _scanned or not modeling:
            continue
        _scanned.add(module_name)
        for obj in list(vars(module).values()):
            if isinstance(obj, type) and issubclass(obj, nn.Module) and obj.__module__ == module_name and calls_attention_interface(obj):
                if not QuantModuleRegistry.is_registered(obj):
                    register_attention(obj)
                    done.append(obj.__name__)
    return done


refresh()

__all__ = ["KVQuantizationError", "QuantHFAttention", "calls_attention_interface", "refresh", "register_attention"]
