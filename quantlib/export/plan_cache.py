"""A model's checked export plan kept between calls of the RL weight sync, which sends every step's weights
through a model whose quantizers (and module tree) do not change between steps.

A plan depends on the module tree (which modules, parameters and buffers, of which shape, dtype and device), on
every quantizer's state and on the export's arguments, never on the weights' values (items read the weights when
packed). The state is compared at every call: each quantizer's ``generation`` (never reused; bumped by every
attribute set, buffer added or moved, state loaded) and the sum of its buffers' version counters (in-place amax
writes), the identity of every module's children, parameters and buffers, and each tensor's shape, dtype and device.
Anything else rebuilds the plan, so a cached plan is the plan a fresh build gives.
"""

from __future__ import annotations

import operator
from typing import Callable, Optional, TypeVar

from torch import nn

from ..nn.containers import QuantizerContainer
from ..nn.quant_module import _quantizer_token
from ..nn.tensor_quantizer import TensorQuantizer
from .modules import ModuleWalk

T = TypeVar("T")
#: the model's attribute holding its :class:`_Entry`
_ATTR = "_quantlib_sync_plan"
_META = operator.attrgetter("shape", "dtype", "device")


class _State:
    """What a plan was built from: the walked modules, the quantizer containers and leaves, and their tokens."""

    __slots__ = ("modules", "containers", "leaves", "memo", "held", "token")

    def __init__(self, mw: ModuleWalk) -> None:
        self.modules = [m for _, m in mw.modules]
        self.containers: list[nn.Module] = []
        self.leaves: list[TensorQuantizer] = []
        for m in self.modules:
            for c in m._modules.values():
                self._quantizer(c)
        self.memo: dict = {}  # _quantizer_token's: the leaves' buffers, kept while their generations are the same
        self.held, self.token = self._token()

    def _quantizer(self, q: Optional[nn.Module]) -> None:
        if isinstance(q, TensorQuantizer):
            self.leaves.append(q)
        elif isinstance(q, QuantizerContainer):
            self.containers.append(q)
            for c in q._modules.values():
                self._quantizer(c)

    def _token(self) -> tuple[list, tuple]:
        """(the modules whose ids the token holds, kept alive so that no id is reused; the token). Tensors are compared
        by id, shape, dtype and device and not kept: a replaced weight is freed at once, and one that takes a freed one's
        id in the same place packs right (items read their tensors when packed)."""
        held: list = []
        tensors: list = []
        for m in self.modules:
            held += m._modules.values()
            tensors += m._parameters.values()
            tensors += m._buffers.values()
        for c in self.containers:
            held += c._modules.values()
        tensors = [t for t in tensors if t is not None]
        # the leaves' generations and buffer versions; None while one calibrates or for an inference tensor's buffer
        # (its in-place writes cannot be seen)
        quantizers = _quantizer_token(self.leaves, self.memo)
        return held, (tuple(map(id, held)), tuple(map(id, tensors)), tuple(map(_META, tensors)), quantizers)

    def current(self) -> bool:
        """Whether the model is still in the state this was taken in (the buffers of the same leaves: an added or
        replaced buffer bumped a generation)."""
        if self.token[3] is None:
            return False
        _, token = self._token()
        return token == self.token


class _Entry:
    """The export's arguments, the state it was planned in and its plan (what the build gave): one per model (a sync loop asks for the same
    plan every step). Held in the model's ``__dict__`` (freed with it) and never copied: a copy or a pickle of the model
    gets an empty entry, since the plan's items read the original's modules."""

    __slots__ = ("key", "state", "plan")

    def __init__(self) -> None:
        self.key: Optional[tuple] = None
        self.state: Optional[_State] = None
        self.plan: object = None

    def __reduce__(self) -> tuple:
        return _Entry, ()


def cached_plan(model: nn.Module, key: tuple, build: Callable[[ModuleWalk], T]) -> T:
    """The plan (or what holds it) ``build(ModuleWalk(model))`` gives for ``model`` with the export's arguments ``key`` (hashable), built
    again only where the arguments, a quantizer's state or the module tree changed since the last call. The plan is
    shared: callers replace its items, never edit them."""
    entry = model.__dict__.get(_ATTR)
    if isinstance(entry, _Entry) and entry.state is not None and entry.key == key and entry.state.current():
        return entry.plan
    mw = ModuleWalk(model)
    plan = build(mw)
    entry = _Entry()
    entry.key, entry.state, entry.plan = key, _State(mw), plan
    model.__dict__[_ATTR] = entry  # not setattr: a module's __setattr__ may do more than store it
    return plan
