"""Which linears read the very same input tensor, found by one probe forward (as ModelOpt's exporter finds
the linears it fuses), and what that says about a layout's sibling groups.

The probe runs the model once on a tiny input (transformers models: ``input_ids`` of shape [1, 2]) under
``no_grad``, in eval mode, with every quantizer switched off for its duration (nothing calibrates, no weight
is fake-quantized, no quantizer state or generation changes) and a pre-hook on each linear that records
the identity of its input. Linears called on one tensor object are what a consumer can fuse into one GEMM;
a layout's sibling groups (vLLM's packed modules, or a user's) are then checked against them: a declared
group whose members read different inputs is refused, and linears of one parent reading one input whose
leaf names no layout knows are left for :func:`~quantlib.export.checks.check_structure` to refuse. The probe also
watches each linear's weight: a model that computes with it outside the linear's own forward (a direct product, a
slice, a cast; Mamba's ``dt_proj``, a router read in fp32) would not run its quantizer, so the export refuses it
quantized by name, whatever the module's class.
Models with tensors on ``meta`` (offloaded layer-by-layer calibration) are not probed: their layout stays
the names-only one.
"""

from __future__ import annotations

import contextlib
import weakref
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Iterator, Optional

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from ..nn.tensor_quantizer import TensorQuantizer
from .modules import ModuleWalk
from .types import ExportError

_CACHE: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model -> (linears signature, input groups)
_HOW = ("pass layout=quantlib.export.structural_layout(model, forward) with a forward that runs the model, or "
        "layout=quantlib.export.ModelLayout(...) saying which linears are fused")


@dataclass(frozen=True)
class Structure:
    """What the probe forward found, reconciled with a layout's sibling groups."""

    #: the linears the probe reached (a linear outside it, e.g. an expert no token was routed to, falls back to
    #: the layout's leaf names)
    seen: frozenset
    #: module name -> the leaf names of its fused group (leaves of one parent that read one input and that the
    #: layout declares siblings); a seen module not in it is loaded alone
    fused: dict
    #: module names of one parent reading one input where some leaf is neither a declared sibling nor standalone
    unknown: tuple = ()
    #: linear name -> the module whose forward computed with its weight outside the linear's own forward ("": the model)
    read: dict = field(default_factory=dict)

    def group_of(self, name: str) -> Optional[tuple[str, ...]]:
        """The fused group of seen module ``name`` (None: loaded alone)."""
        return self.fused.get(name)


def probe_linears(walk: ModuleWalk) -> list[tuple[str, nn.Module]]:
    """The linears the probe watches: quantized modules with a weight of their own and plain ``nn.Linear``."""
    return [(n, m) for n, m, _ in walk.linears if isinstance(m._parameters.get("weight"), torch.Tensor)]


def on_meta(linears: list[tuple[str, nn.Module]]) -> bool:
    """Whether a linear's weight is on ``meta`` (offloaded): then no forward runs."""
    return any(m._parameters["weight"].is_meta for _, m in linears)


def transformers_forward(model: nn.Module) -> None:
    """The probe forward of a transformers model: ``input_ids`` [[1, 1]] (and as decoder input)."""
    p = next(model.parameters())
    ids = torch.ones((1, 2), dtype=torch.long, device=p.device)
    kwargs = {"decoder_input_ids": ids} if getattr(model.config, "is_encoder_decoder", False) else {}
    model(input_ids=ids, **kwargs)


def shared_inputs(model: nn.Module, walk: Optional[ModuleWalk] = None,
                  forward: Optional[Callable[[nn.Module], Any]] = None) -> Optional[list[tuple[str, ...]]]:
    """Groups of linear module names (module order) called on one input tensor in one probe forward of ``model``
    (``forward(model)``; default :func:`transformers_forward`), every linear the probe reached in exactly one
    group; None where a weight is on ``meta``. Cached per model while its linears are the same modules."""
    walk = ModuleWalk(model) if walk is None else walk
    signature = [(n, id(m)) for n, m, _ in walk.linears]  # what the groups depend on: the modules, not their weights' device
    hit = _CACHE.get(model)
    if hit is not None and hit[0] == signature and forward is None:
        return hit[1]
    linears = probe_linears(walk)
    if not linears or on_meta(linears):
        return None
    groups, read = _probe(model, linears, forward or transformers_forward)
    if forward is None:
        _CACHE[model] = (signature, groups, {}, read)
    return groups


def model_structure(model: nn.Module, walk: Optional[ModuleWalk], layout_name: str, siblings: tuple[tuple[str, ...], ...],
                    standalone: Optional[frozenset]) -> Optional[Structure]:
    """:func:`reconcile` of :func:`shared_inputs` (default forward), cached with the probe: weight sync asks every
    step, and a model of per-expert linears has tens of thousands."""
    groups = shared_inputs(model, walk)
    if groups is None:
        return None
    _, _, memo, read = _CACHE[model]
    key = (layout_name, siblings, standalone)
    found = memo.get(key)
    if found is None:
        found = memo[key] = replace(reconcile(groups, layout_name, siblings, standalone), read=read)
    return found


def _probe(model: nn.Module, linears: list[tuple[str, nn.Module]],
           forward: Callable[[nn.Module], Any]) -> tuple[list[tuple[str, ...]], dict[str, str]]:
    """(the groups of :func:`shared_inputs`, what :class:`_Watch` found read outside its linear's forward)."""
    inputs: dict[int, tuple[torch.Tensor, list[str]]] = {}  # the tensor is held so that its id is not reused

    def record(name: str) -> Callable:
        def hook(module: nn.Module, args: tuple, kwargs: dict) -> None:
            x = next((a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)), None)
            if x is not None:
                inputs.setdefault(id(x), (x, []))[1].append(name)

        return hook

    handles = [m.register_forward_pre_hook(record(n), with_kwargs=True) for n, m in linears]
    watch = _Watch(model, linears)
    try:
        with _quiet(model), watch:
            forward(model)
    except Exception as exc:  # any failure of a user's model: named, with the way around it
        raise ExportError(f"{type(model).__name__}: the structure probe (one forward on a tiny input, quantizers off) failed: "
                          f"{type(exc).__name__}: {exc}; quantlib finds the linears consumers fuse by it: {_HOW}") from exc
    finally:
        for h in handles:
            h.remove()
    return _merged([names for _, names in inputs.values()], [n for n, _ in linears]), watch.read


#: tensor methods that read a weight's metadata, not its values
_METADATA = frozenset({"__get__", "size", "dim", "numel", "element_size", "stride", "is_contiguous", "is_floating_point", "get_device",
                       "data_ptr", "new_zeros", "new_ones", "new_empty", "new_full", "new_tensor", "detach"})


class _Watch(TorchFunctionMode):
    """Records, for each linear of the probe, the module whose forward computes with the linear's weight while no
    module holding that tensor (the linear, a tied embedding) is in its forward."""

    def __init__(self, model: nn.Module, linears: list[tuple[str, nn.Module]]):
        super().__init__()
        self.names = {id(m._parameters["weight"]): n for n, m in linears}
        self.owners = [(m, id(p)) for m in model.modules() for p in m._parameters.values() if id(p) in self.names]
        self.active: dict[int, int] = dict.fromkeys(self.names, 0)
        self.stack: list[str] = []
        self.module_names = {id(m): n for n, m in model.named_modules()}
        self.read: dict[str, str] = {}
        self.handles: list = []

    def __enter__(self):
        for m, w in self.owners:
            self.handles.append(m.register_forward_pre_hook(lambda *_, w=w: self._enter(w)))
            self.handles.append(m.register_forward_hook(lambda *_, w=w: self._leave(w), always_call=True))
        self.handles.append(nn.modules.module.register_module_forward_pre_hook(self._push))
        self.handles.append(nn.modules.module.register_module_forward_hook(self._pop, always_call=True))
        return super().__enter__()

    def _push(self, module: nn.Module, args: tuple) -> None:
        self.stack.append(self.module_names.get(id(module), ""))

    def _pop(self, *_) -> None:
        if self.stack:
            self.stack.pop()

    def __exit__(self, *exc):
        for h in self.handles:
            h.remove()
        return super().__exit__(*exc)

    def _enter(self, w: int) -> None:
        self.active[w] += 1

    def _leave(self, w: int) -> None:
        self.active[w] -= 1

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if getattr(func, "__name__", "") not in _METADATA:
            for a in (*args, *(kwargs or {}).values()):
                for t in a if type(a) in (list, tuple) else (a,):  # torch.cat([w, ...])
                    self._seen(id(t))
        return func(*args, **(kwargs or {}))

    def _seen(self, key: int) -> None:
        if key in self.names and not self.active[key] and self.names[key] not in self.read:
            self.read[self.names[key]] = self.stack[-1] if self.stack else ""  # "": the root module, or no module's forward


def _merged(calls: list[list[str]], order: list[str]) -> list[tuple[str, ...]]:
    """Groups of names called on one input, merged where a module was called on several (layers shared across
    depth), in ``order``."""
    root = {n: n for names in calls for n in names}

    def find(n: str) -> str:
        while root[n] != n:
            root[n] = root[root[n]]
            n = root[n]
        return n

    for first, *rest in calls:
        for n in rest:
            root[find(n)] = find(first)
    groups: dict[str, list[str]] = {}
    for n in order:
        if n in root:
            groups.setdefault(find(n), []).append(n)
    return [tuple(g) for g in groups.values()]


@contextlib.contextmanager
def _quiet(model: nn.Module) -> Iterator[None]:
    """No grad, eval mode, no KV cache, every quantizer off, and all of it restored after. Quantizers are switched
    through their ``__dict__``: their generation (the weight caches' key) stays the same, and a module whose
    quantizers are all off caches nothing."""
    modules = list(model.modules())
    quantizers = [m for m in modules if type(m) is TensorQuantizer or isinstance(m, TensorQuantizer)]
    training = [m.training for m in modules]
    disabled = [q.__dict__["_disabled"] for q in quantizers]
    config = getattr(model, "config", None)
    cache = getattr(config, "use_cache", None)
    try:
        for m in modules:
            m.__dict__["training"] = False  # not setattr: a quantizer's bumps its generation
        for q in quantizers:
            q.__dict__["_disabled"] = True
        if cache:
            config.use_cache = False
        with torch.no_grad():
            yield
    finally:
        if cache:
            config.use_cache = cache
        for q, d in zip(quantizers, disabled):
            q.__dict__["_disabled"] = d
        for m, t in zip(modules, training):
            m.__dict__["training"] = t


def reconcile(groups: list[tuple[str, ...]], layout_name: str, siblings: tuple[tuple[str, ...], ...],
              standalone: Optional[frozenset]) -> Structure:
    """The :class:`Structure` of probe ``groups`` under a layout's declared ``siblings`` (leaf-name groups within one
    parent) and ``standalone`` leaves (None: any leaf); raises :class:`ExportError` naming the declared group and what
    the probe found where members of one declared group read different inputs."""
    input_of = {n: i for i, g in enumerate(groups) for n in g}
    parents: dict[str, dict[str, str]] = {}
    for g in groups:
        for n in g:
            parent, _, leaf = n.rpartition(".")
            parents.setdefault(parent, {})[leaf] = n
    fused: dict[str, tuple[str, ...]] = {}
    declared = {leaf for group in siblings for leaf in group}
    for parent, leaves in parents.items():
        for group in siblings:
            present = [leaves[leaf] for leaf in group if leaf in leaves]
            if len(present) < 2:
                continue
            if len({input_of[n] for n in present}) > 1:
                found = [[n for n in groups[i] if n.rpartition(".")[0] == parent] for i in dict.fromkeys(input_of[n] for n in present)]
                raise ExportError(f"layout {layout_name} declares {group} one fused GEMM (one input), but the probe forward finds "
                                  f"{' and '.join(map(str, found))} reading different inputs: the layout does not describe this model; "
                                  f"{_HOW}")
            for n in present:
                fused[n] = group
    unknown = []
    for g in groups:
        by_parent: dict[str, list[str]] = {}
        for n in g:
            by_parent.setdefault(n.rpartition(".")[0], []).append(n)
        for names in by_parent.values():
            leaves = [n.rpartition(".")[2] for n in names]
            strange = [leaf for leaf in leaves if leaf not in declared and standalone is not None and leaf not in standalone]
            if len(names) > 1 and strange:
                unknown.append(tuple(names))
    return Structure(frozenset(input_of), fused, tuple(unknown))
