"""QuantModule: the mixin that gives a module its input / weight / output quantizers, and the registry
that builds the quantized class of an original module class."""

from __future__ import annotations

import copy
import operator
from collections import OrderedDict
from typing import Any, Callable, ClassVar, Iterable, Iterator, Optional

import torch
from torch import nn

from ..config import QuantizerAttributeConfig
from .containers import GroupedQuantizer
from .rebind import rebind_hooks
from .tensor_quantizer import TensorQuantizer, latest_generation

#: the weight axis that tensor parallelism splits, by ``QuantModule.parallel_role``
_TP_WEIGHT_AXIS = {"column": 0, "row": 1}


class QuantModule(nn.Module):
    """Mixin placed before the original class: ``class QuantLinear(QuantModule, nn.Linear)``.

    Subclasses say which quantizers they own (``quantizer_names``), which of them quantize weights and
    with which tensors (:meth:`weight_groups`), and their parallel role for the amax sync.
    """

    quantizer_names: tuple[str, ...] = ("input_quantizer", "weight_quantizer", "output_quantizer")
    weight_quantizer_names: tuple[str, ...] = ("weight_quantizer",)
    #: weight quantizers that are GroupedQuantizers (one member per GEMM); checkpoints validate with it.
    grouped_quantizer_names: tuple[str, ...] = ()
    #: "replicated", "column", "row" (tensor parallel) — set by plugins that know it.
    parallel_role: str = "replicated"
    #: True for the linears of MoE experts (their input amax syncs across the expert group).
    is_expert: bool = False
    #: quantizers that may take a ``bias`` (affine quantization, see quantlib.nn.bias_collector); none by default
    affine_quantizer_names: tuple[str, ...] = ()
    #: True where the GEMM reads a transform of the forward's input (TE LayerNormLinear: the normalized
    #: input): calibration that replays inputs records what ``input_quantizer`` is called on instead.
    gemm_input_at_input_quantizer: bool = False
    #: the parsed QuantizeConfig last applied to this module (``set_quantizer_by_cfg``, a checkpoint
    #: restore): the model-level settings (expert_input_policy, sync_expert_weight_amax) that later
    #: calls read live on the converted modules, never as an attribute of the user's model
    applied_config: Any = None

    def _setup(self) -> None:
        """Create the quantizers (called once, right after conversion)."""
        self.input_quantizer = TensorQuantizer(QuantizerAttributeConfig())
        self.weight_quantizer = TensorQuantizer(QuantizerAttributeConfig(axis=0))
        self.output_quantizer = TensorQuantizer(QuantizerAttributeConfig(enable=False))
        self._weight_cache = {}

    def quantize_weight(self, tensor: torch.Tensor, name: str = "weight_quantizer", member: Optional[int] = None) -> torch.Tensor:
        """``quantizer(tensor)``, reused while neither the tensor nor the quantizer changed.

        The key holds the tensor's version counter (bumped by optimizer steps, ``load_state_dict`` and
        any in-place write) and the quantizer's state (its generation and its buffers' versions). Nothing
        is cached where autograd needs the graph (QAT), while calibrating, or under torch.compile.
        """
        q = getattr(self, name)
        if member is not None:
            m = q._modules.get(str(member))  # ModuleList's __getitem__ normalises the index first: slower
            q = q[member] if m is None else m
        leaves = (q,) if type(q) is TensorQuantizer else _leaves(q)
        if all(leaf._disabled for leaf in leaves):
            return tensor  # nothing to cache: a disabled quantizer returns its input
        if torch.compiler.is_compiling() or (torch.is_grad_enabled() and tensor.requires_grad):
            return q(tensor)
        token = _quantizer_token(leaves)
        if token is None or tensor.is_inference():
            return q(tensor)
        key = (id(tensor), tensor.data_ptr(), tensor._version, tensor.dtype, tensor.device, token)
        cache = self.__dict__.setdefault("_weight_cache", {})
        hit = cache.get((name, member))
        if hit is not None and hit[0] == key:
            return hit[1]
        out = q(tensor)
        # the entry keeps the tensor alive, whose id() is in its key: no new tensor can get that id (and hit
        # a stale entry) while it exists (the quantizers' generations are never reused)
        cache[(name, member)] = (key, out, tensor)
        return out

    def quantizers_off(self) -> bool:
        """True when every quantizer of this module is disabled (then its forward is the original's)."""
        modules = self._modules
        for name in self.quantizer_names:
            q = modules.get(name)
            if q is not None and not (q._disabled if type(q) is TensorQuantizer else all_disabled((q,))):
                return False
        return True

    def __getstate__(self) -> dict:
        # the caches hold views made under no_grad and id()-keyed entries: meaningless in a copy
        state = dict(self.__dict__)
        for k in _CACHES:
            state.pop(k, None)
        return state

    def __reduce_ex__(self, protocol):
        # the quantized class is built at run time (type()): rebuild it from the original class,
        # which pickles by name, through the registry of the process that loads
        original = QuantModuleRegistry.original_class_of(self)
        if QuantModuleRegistry._classes.get(original) is not type(self):
            return super().__reduce_ex__(protocol)  # a class made elsewhere: pickled by its own name
        return (_rebuild, (original,), self.__getstate__())

    def weight_groups(self) -> Iterator[tuple[str, list[torch.Tensor]]]:
        """(weight quantizer name, its tensors): one tensor per member of a GroupedQuantizer."""
        yield "weight_quantizer", [self.weight]

    def tp_weight_shape(self) -> Optional[tuple[int, ...]]:
        """The local shape of this module's weight, from which its tensor-parallel split is read (None: no weight)."""
        for _, tensors in self.weight_groups():
            if tensors:
                return tuple(tensors[0].shape)
        return None

    def tp_split(self, qname: str) -> tuple[Optional[int], int]:
        """(axis of the tensor that quantizer ``qname`` sees which tensor parallelism splits, or None; that
        axis's local extent, 0 where unknown). Read from ``parallel_role``: a column layer splits its weight's
        rows and its output's last dim, a row layer its weight's columns and its input's last dim."""
        axis = _TP_WEIGHT_AXIS.get(self.parallel_role)
        if axis is None:
            return None, 0
        shape = self.tp_weight_shape()
        extent = shape[axis] if shape is not None and len(shape) > axis else 0
        if qname in self.weight_quantizer_names:
            return axis, extent
        if axis == 0 and qname == "output_quantizer":
            return (None, 0) if getattr(self, "gather_output", False) else (-1, extent)
        if axis == 1 and qname == "input_quantizer":
            return -1, extent
        if qname in ("input_quantizer", "output_quantizer"):
            return None, 0  # a column layer's input and a row layer's (reduced) output are whole
        return -1, 0  # other quantizers (attention's): split along the last dim, extent unknown

    def num_weight_members(self, name: str) -> int:
        """How many members a grouped weight quantizer ``name`` has (1 for a plain quantizer)."""
        for qname, tensors in self.weight_groups():
            if qname == name:
                return len(tensors)
        raise KeyError(name)

    def calibrate_weights(self) -> None:
        """Every weight quantizer gets its amax from its own tensor(s), whatever data calibration sees."""
        for name, tensors in self.weight_groups():
            q = getattr(self, name)
            if isinstance(q, GroupedQuantizer):
                members = [(m, t) for m, t in zip(q, tensors)]
            else:
                members = [(q, tensors[0])]
            for m, t in members:
                if m.is_enabled and m.needs_calibration:
                    m.calibrate(t)


#: per-module caches that copies and pickles leave behind (rebuilt on first use)
_CACHES = ("_weight_cache", "_expert_views")


def all_disabled(quantizers: Iterable[nn.Module]) -> bool:
    """True when no leaf quantizer of ``quantizers`` (TensorQuantizers or containers) is enabled; reads
    one flag per plain quantizer, so a disabled module can afford it on every forward."""
    for q in quantizers:
        if isinstance(q, TensorQuantizer):
            if not q._disabled:
                return False
        elif not all_disabled(q._modules.values()):
            return False
    return True


def _rebuild(original: type) -> nn.Module:
    """An empty instance of ``original``'s quantized class (pickle then sets its state)."""
    if not QuantModuleRegistry.is_registered(original):
        QuantModuleRegistry.find()  # the original's framework is imported by now (unpickling found the class)
    if not QuantModuleRegistry.is_registered(original):
        raise TypeError(f"cannot unpickle a quantized {original.__module__}.{original.__qualname__}: no quantized class is registered for "
                        "it in this process")
    qcls = QuantModuleRegistry.quantized_class(original)
    return qcls.__new__(qcls)


def _leaves(q: nn.Module) -> list[TensorQuantizer]:
    return list(q.leaves()) if hasattr(q, "leaves") else [q]


_GEN = operator.attrgetter("_gen")
_VERSION = operator.attrgetter("_version")


def _quantizer_token(leaves, memo: Optional[dict] = None) -> Optional[tuple]:
    """Everything the output of a quantizer with these leaves depends on besides its input: each leaf's
    :attr:`~TensorQuantizer.generation` (config, switches, which buffers; never reused) and the sum of its
    buffers' version counters (in-place writes: with the generations equal no buffer was replaced, so
    the sum only grows); None while one calibrates or where a buffer has no version counter (an
    inference tensor). ``memo``: a dict of the caller's, for the same leaves at every call, where what follows from the
    generations (whether one calibrates, the buffers) is kept: while no generation was issued since (the RL sync's
    plan check, every step) the call reads the buffers' versions alone."""
    latest = latest_generation()  # before the generations (see latest_generation)
    parts = None if memo is None else memo.get("token_parts")
    if parts is None or parts[3] != latest:
        gens = tuple(map(_GEN, leaves))
        if parts is None or parts[0] != gens:
            # the switches and the buffer set are attributes: a change of either bumped a generation
            calibrating = any(leaf._if_calib and not leaf._disabled for leaf in leaves)
            parts = (gens, calibrating, tuple(t for leaf in leaves for t in leaf._buffers.values() if t is not None), latest)
        else:
            parts = parts[:3] + (latest,)
        if memo is not None:
            memo["token_parts"] = parts
    if parts[1]:
        return None
    try:
        return parts[0], sum(map(_VERSION, parts[2]))
    except RuntimeError:  # "Inference tensors do not track version counter"
        return None


class QuantModuleRegistry:
    """Maps original module classes to quantized ones; ``convert`` swaps a module, keeping its parameters."""

    _mixins: "OrderedDict[type, type]" = OrderedDict()
    _classes: dict[type, type] = {}
    #: callables that register the quantized classes of the frameworks the process has imported; filled
    #: from above (``quantlib.plugins`` adds its loader when imported), so this layer never imports them
    _finders: ClassVar[list[Callable[[], object]]] = []

    @classmethod
    def add_finder(cls, finder: Callable[[], object]) -> None:
        """Have :meth:`find` call ``finder`` (once registered; adding it again is a no-op)."""
        if finder not in cls._finders:
            cls._finders.append(finder)

    @classmethod
    def find(cls) -> None:
        """Run every finder: register the quantized classes of the frameworks imported so far."""
        for finder in cls._finders:
            finder()

    @classmethod
    def register(cls, original: type, name: Optional[str] = None) -> Callable[[type], type]:
        """Decorator on a QuantModule mixin that quantizes modules of class ``original`` (exact type)."""

        def deco(mixin: type) -> type:
            if not issubclass(mixin, QuantModule):
                raise TypeError(f"{mixin.__name__} must subclass QuantModule")
            cls._mixins[original] = mixin
            cls._classes.pop(original, None)
            mixin._registry_name = name or original.__name__
            return mixin

        return deco

    @classmethod
    def unregister(cls, original: type) -> None:
        cls._mixins.pop(original, None)
        cls._classes.pop(original, None)

    @classmethod
    def is_registered(cls, original: type) -> bool:
        return original in cls._mixins

    @classmethod
    def quantized_class(cls, original: type) -> type:
        """``type("Quant<Name>", (mixin, original), {})``, built once per original class."""
        if original not in cls._classes:
            mixin = cls._mixins[original]
            cls._classes[original] = type(f"Quant{original.__name__}", (mixin, original), {"_original_class": original})
        return cls._classes[original]

    @classmethod
    def convert(cls, module: nn.Module) -> QuantModule:
        """The quantized module, sharing the original's parameters, buffers, submodules and hooks (rebound
        to the new module where they referred to the original: :func:`~quantlib.nn.rebind.rebind_hooks`)."""
        qcls = cls.quantized_class(type(module))
        new = qcls.__new__(qcls)
        new.__dict__ = dict(module.__dict__)
        # _setup adds quantizers (modules, buffers): those containers are copied; the hook dicts are
        # shared, so the handles of hooks registered before conversion still remove them
        for k in ("_parameters", "_buffers", "_modules", "_non_persistent_buffers_set"):
            if k in new.__dict__:
                new.__dict__[k] = copy.copy(new.__dict__[k])
        rebind_hooks(module, new)
        new._setup()
        return new

    @classmethod
    def original_class_of(cls, module: nn.Module) -> type:
        return getattr(type(module), "_original_class", type(module))
