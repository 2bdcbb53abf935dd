"""Conversion rebinds the hooks a module registered on itself (issue 14: Megatron's TE grouped linears
register ``_load_state_dict_pre_hook``s with ``with_module=True``, which torch keeps by weak reference;
after conversion they pointed at the dead original and ``load_state_dict`` raised).

The stand-in registers every kind of self-bound hook TE and Megatron-Core use, the way they do it."""

from __future__ import annotations

import functools
import gc
import weakref

import pytest
import torch
from torch import nn

import quantlib as ql
from quantlib.nn import QuantModuleRegistry
from quantlib.nn.modules.linear import _QuantLinear
from quantlib.nn.rebind import rebind_hooks


class SelfHookedLinear(nn.Linear):
    """A linear whose hooks all refer to itself: a weak-module pre-hook on an unbound method (Megatron's
    ``_normalize_grouped_parameter_keys``), one on an ``__init__`` closure (``merge_extra_states``), a
    bound-method post hook and state-dict hook, a forward hook closing over ``weakref.ref(self)``, a
    ``WeakMethod``, a partial and a list of closures kept as attributes. Each records the module it ran on in ``seen``."""

    def __init__(self) -> None:
        super().__init__(8, 4)
        self.seen: list[tuple[str, int]] = []
        self._register_load_state_dict_pre_hook(type(self)._rename_keys, with_module=True)

        def merge(module, state_dict, prefix, *args):
            module.seen.append(("merge", id(module)))

        self._register_load_state_dict_pre_hook(merge, with_module=True)
        self.register_load_state_dict_post_hook(self._post)
        self._register_state_dict_hook(self._on_save)
        me = weakref.ref(self)

        def forward_hook(module, args, out):
            me().seen.append(("forward", id(me())))

        self.register_forward_hook(forward_hook)
        self.on_event = weakref.WeakMethod(self._event)
        self.callback = functools.partial(SelfHookedLinear._event_of, self)
        self.wgrad_hooks = [lambda: me()._event()]  # as TE's wgrad_accumulation_and_reduce_hooks list
        self.myself = me

    def _rename_keys(self, state_dict, prefix, *args):
        self.seen.append(("rename", id(self)))
        if f"{prefix}w" in state_dict:
            state_dict[f"{prefix}weight"] = state_dict.pop(f"{prefix}w")

    def _post(self, module, incompatible):
        self.seen.append(("post", id(self)))

    def _on_save(self, module, state_dict, prefix, local_metadata):
        self.seen.append(("save", id(self)))

    def _event(self):
        return id(self)

    def _event_of(self):
        return id(self)


@pytest.fixture
def registered():
    QuantModuleRegistry.register(SelfHookedLinear, "test.SelfHookedLinear")(type("_QuantSelfHooked", (_QuantLinear,), {}))
    yield
    QuantModuleRegistry.unregister(SelfHookedLinear)


def test_load_state_dict_after_conversion_runs_hooks_on_the_new_module(registered):
    torch.manual_seed(0)
    model = nn.Sequential(SelfHookedLinear())
    original = weakref.ref(model[0])
    state = {"0.w": torch.randn(4, 8), "0.bias": torch.randn(4)}
    model = ql.quantize(model, ql.INT8_DEFAULT_CFG, forward_loop=lambda m: m(torch.randn(2, 8)))
    gc.collect()
    assert original() is None  # the replaced module is gone: a hook still bound to it would be dead
    layer = model[0]
    layer.seen.clear()
    model.load_state_dict(state, strict=False)
    model.state_dict()
    model(torch.randn(2, 8))
    assert layer.seen == [("rename", id(layer)), ("merge", id(layer)), ("post", id(layer)), ("save", id(layer)), ("forward", id(layer))]
    assert torch.equal(layer.weight, state["0.w"])
    assert layer.on_event()() == id(layer) and layer.callback() == id(layer) and layer.myself() is layer
    assert layer.wgrad_hooks[0]() == id(layer)


def test_rebind_leaves_hooks_of_other_modules_alone():
    a, b, other = nn.Linear(2, 2), nn.Linear(2, 2), nn.Linear(2, 2)
    a._register_load_state_dict_pre_hook(lambda module, *args: None, with_module=True)
    wrapped_a = next(iter(a._load_state_dict_pre_hooks.values()))
    b.__dict__.update({k: v for k, v in a.__dict__.items() if k.startswith("_load_state")})
    b.peer = weakref.ref(other)
    b.peer_method = other.forward
    assert rebind_hooks(a, b) == 1
    assert next(iter(b._load_state_dict_pre_hooks.values())).module() is b and wrapped_a.module() is a
    assert b.peer() is other and b.peer_method.__self__ is other
    assert rebind_hooks(a, b) == 0  # nothing left that refers to a
