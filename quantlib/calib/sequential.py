"""Layer-by-layer ("sequential") max calibration, for models larger than the device.

The forward loop is run once per decoder layer, plus once at the end; in pass ``p``:

- layers ``< p - 1`` are finished and are skipped (they return their input hidden states, so nothing
  but the embeddings runs before the layer of interest);
- layer ``p - 1`` is loaded onto the device once, runs on its cached inputs (captured in pass ``p - 1``,
  one entry per batch) with its activation quantizers calibrating, then goes back (to its original
  device, or to ``meta`` if it came from an offload folder);
- layer ``p`` records the inputs the model hands it (its hidden states are layer ``p - 1``'s real
  outputs, the other arguments are what the model passes that layer) and stops the forward pass;
- in the last pass (``p = L``) nothing stops: the model runs past the layers, and the quantizers outside
  them (the final norm's, the head's, any before the first layer) calibrate on the real tensors too.

Every quantizer therefore sees exactly the tensors of in-memory calibration (the unquantized model, the
same batches in the same order), so the amax are bit-identical; the memory held at once is the
resident part of the model, one layer and two layers' worth of cached inputs. The forward loop must feed
the same batches in the same order on every call (a batch of another shape raises), must not use the
model's output (a stopped pass returns None) and must not feed past key values (an empty cache is
dropped, which changes nothing).

Resume: after each layer the state (finished layers' amax, the next layer's cached inputs) is written
atomically to ``resume_file``; a later call with the same model, config and file continues after the
last finished layer and ends with the same amax.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import os
import sys
from dataclasses import dataclass
from typing import Any, Callable, Optional, Union

import torch
from torch import nn

from .._atomic_io import atomic_torch_save
from ..traversal import clear_weight_cache, iter_leaf_quantizers, quant_modules
from .activations import activation_leaves, finish_activations
from ..nn.containers import QuantizerContainer
from ..nn.tensor_quantizer import TensorQuantizer

RESUME_SCHEMA = 1


@dataclass
class SequentialOptions:
    """How layer-by-layer calibration runs: ``layers`` is the dotted name of the decoder layers'
    ``nn.ModuleList`` (None: found by :func:`decoder_layers`); ``device`` where each layer runs: moved (or
    loaded from the offload folder) there for its pass and sent back after it, so one layer is on the device
    at a time; the rest of the model must be there already (None: where its weights are, the CPU for layers
    on ``meta``); ``offload_folder`` where :func:`offload_to_disk` put the layers whose parameters are on
    ``meta``; ``resume_file`` the state written after each layer (None: none)."""

    layers: Optional[str] = None
    device: Optional[Union[str, torch.device]] = None
    offload_folder: Optional[str] = None
    resume_file: Optional[str] = None

    @classmethod
    def from_any(cls, value: Union[bool, dict, "SequentialOptions"]) -> "SequentialOptions":
        """``True``, a dict of the fields, or the options themselves."""
        if isinstance(value, SequentialOptions):
            return value
        if value is True:
            return cls()
        if isinstance(value, dict):
            unknown = set(value) - {"layers", "device", "offload_folder", "resume_file"}
            if unknown:
                raise ValueError(f"sequential calibration: unknown option(s) {sorted(unknown)}")
            return cls(**value)
        raise TypeError(f"sequential must be True, a dict or SequentialOptions, got {value!r}")


class _StopForward(Exception):
    """Raised by the layer that records its inputs: the rest of the pass is not needed."""


_NO_FORWARD = object()


def _patch_forward(module: nn.Module, fn: Callable) -> Callable[[], None]:
    """Set ``module.forward = fn`` on the instance; returns what puts back the instance ``forward`` it had
    (one that wrappers such as accelerate's hooks install), or removes ``fn`` where it had none."""
    saved = module.__dict__.get("forward", _NO_FORWARD)
    module.forward = fn

    def restore() -> None:
        if saved is _NO_FORWARD:
            del module.forward
        else:
            module.forward = saved

    return restore


# ---------------------------------------------------------------------------------- layers


def decoder_layers(model: nn.Module, path: Optional[str] = None) -> tuple[str, nn.ModuleList]:
    """(name, ModuleList) of the decoder layers: ``path``, or the ModuleList of members of one class that
    holds the most parameters."""
    if path is not None:
        found = model.get_submodule(path)
        if not isinstance(found, nn.ModuleList):
            raise ValueError(f"sequential calibration: {path!r} is a {type(found).__name__}, not an nn.ModuleList of layers")
        return path, found
    # the list of repeated blocks that holds the most parameters: the decoder layers, not the experts
    # list inside each of them (which can be longer)
    best, most = None, -1
    for name, m in model.named_modules():
        if isinstance(m, nn.ModuleList) and len(m) > 1 and len({type(x) for x in m}) == 1:
            size = sum(p.numel() for p in m.parameters())
            if size > most:
                best, most = (name, m), size
    if best is None:
        raise ValueError(f"sequential calibration: no nn.ModuleList of repeated layers in {type(model).__name__}; pass SequentialOptions(layers=...)")
    return best


def _is_quantizer(m: nn.Module) -> bool:
    return isinstance(m, (TensorQuantizer, QuantizerContainer))


def _own_tensors(layer: nn.Module):
    """(module, kind, name, tensor) of every parameter and buffer of ``layer`` outside its quantizers."""
    stack = [layer]
    while stack:
        m = stack.pop()
        for n, p in m._parameters.items():
            if p is not None:
                yield m, "_parameters", n, p
        for n, b in m._buffers.items():
            if b is not None:
                yield m, "_buffers", n, b
        stack.extend(c for c in m._modules.values() if c is not None and not _is_quantizer(c))


def layer_file(folder: str, name: str) -> str:
    """The file of layer ``name`` (its dotted name in the model) in an offload folder."""
    return os.path.join(folder, f"{name}.pt")


def _to_meta(layer: nn.Module, only: Optional[set] = None) -> None:
    """Parameters and buffers of ``layer`` outside its quantizers onto ``meta`` (``only``: those (module id, name))."""
    for m, kind, n, t in list(_own_tensors(layer)):
        if only is None or (id(m), n) in only:
            meta = torch.empty_like(t, device="meta")
            getattr(m, kind)[n] = nn.Parameter(meta, requires_grad=t.requires_grad) if kind == "_parameters" else meta


def offload_layer(layer: nn.Module, path: str) -> None:
    """Write ``layer``'s parameters and buffers outside its quantizers to ``path`` (atomically) and leave
    them on ``meta``: what :func:`offload_to_disk` does for each decoder layer."""
    prefixes = {id(m): p for p, m in layer.named_modules()}
    state = {}
    for m, _, n, t in _own_tensors(layer):
        key = f"{prefixes[id(m)]}.{n}".lstrip(".")
        if t.device.type == "meta":
            raise ValueError(f"offload_layer: {key} is already on meta")
        state[key] = t.detach().cpu()
    atomic_torch_save(state, path, crc32=False)  # nothing reads the checksums of an offloaded layer
    _to_meta(layer)


def offload_to_disk(model: nn.Module, folder: str, layers: Optional[str] = None) -> list[str]:
    """Write each decoder layer to ``folder`` (one file a layer, :func:`offload_layer`) and leave its
    tensors on ``meta``; returns the files. Sequential calibration with ``offload_folder=folder`` loads them
    back one layer at a time (they are read, never written back)."""
    name, mlist = decoder_layers(model, layers)
    os.makedirs(folder, exist_ok=True)
    files = [layer_file(folder, f"{name}.{i}") for i in range(len(mlist))]
    for layer, path in zip(mlist, files):
        offload_layer(layer, path)
    return files


@dataclass
class _Home:
    """Where a layer goes back to: ``device`` (None: its disk-loaded tensors, ``loaded``, go back to meta)."""

    device: Optional[torch.device]
    loaded: set
    moved: bool = False  # a disk-loaded layer was sent to a device


def _load_layer(layer: nn.Module, where: str, opts: SequentialOptions, device: Optional[torch.device]) -> _Home:
    """Bring ``layer`` onto the device (tensors on ``meta`` from the offload folder), once for all batches."""
    tensors = list(_own_tensors(layer))
    on_meta = [(m, kind, n, t) for m, kind, n, t in tensors if t.device.type == "meta"]
    if not on_meta:
        home = _Home(tensors[0][3].device if tensors else torch.device("cpu"), set())
        if device is not None:
            layer.to(device)
        return home
    if opts.offload_folder is None:
        raise ValueError(f"sequential calibration: {where} has parameters on meta and no offload_folder was given")
    path = layer_file(opts.offload_folder, where)
    state = torch.load(path, map_location="cpu", mmap=True, weights_only=True)
    prefixes = {id(m): p for p, m in layer.named_modules()}
    loaded = set()
    for m, kind, n, t in on_meta:
        key = f"{prefixes[id(m)]}.{n}".lstrip(".")
        if key not in state:
            raise ValueError(f"sequential calibration: {path} lacks {key!r} of {where}")
        value = state[key].to(device) if device is not None else state[key]
        getattr(m, kind)[n] = nn.Parameter(value, requires_grad=t.requires_grad) if kind == "_parameters" else value
        loaded.add((id(m), n))
    if device is not None:
        layer.to(device)  # its quantizers and bookkeeping buffers
    return _Home(None, loaded, device is not None)


@functools.lru_cache(maxsize=1)
def _malloc_trim() -> Optional[Callable[[int], int]]:
    if sys.platform != "linux":
        return None
    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim
    except (OSError, AttributeError):  # not glibc (musl has no malloc_trim)
        return None


def _return_freed_memory() -> None:
    """Hand the heap's free pages back to the OS. glibc keeps freed activations of a pass in its heap
    (its mmap threshold grows after the first large free), and they add up over dozens of layers:
    measured on a 39-layer model, peak RSS 93 MiB without this, 51 MiB with it (benchmarks/RESULTS_sequential.md)."""
    trim = _malloc_trim()
    if trim is not None:
        trim(0)


def _release_layer(layer: nn.Module, home: _Home) -> None:
    clear_weight_cache(layer)  # cached (unquantized) weights would keep the layer's tensors alive
    if home.device is None:
        _to_meta(layer, home.loaded)
        if home.moved:  # what stays resident (quantizers, bookkeeping buffers) waits on the CPU
            for m in layer.modules():
                if _is_quantizer(m):
                    m.to("cpu")
            for m, kind, n, t in list(_own_tensors(layer)):
                if t.device.type != "meta":
                    getattr(m, kind)[n] = t.to("cpu") if kind == "_buffers" else nn.Parameter(t.to("cpu"), requires_grad=t.requires_grad)
    else:
        layer.to(home.device)
    _return_freed_memory()


# ---------------------------------------------------------------------------------- inputs


def _hidden(args: tuple, kwargs: dict) -> torch.Tensor:
    if args:
        return args[0]
    if "hidden_states" in kwargs:
        return kwargs["hidden_states"]
    raise ValueError("sequential calibration: a decoder layer was called without positional hidden states or a 'hidden_states' keyword")


def _strip_cache(kwargs: dict, where: str) -> dict:
    """Drop empty KV caches (the layer computes the same without one); a cache with past tokens raises."""
    out = {}
    for k, v in kwargs.items():
        if hasattr(v, "get_seq_length") and hasattr(v, "update"):
            if v.get_seq_length() != 0:
                raise ValueError(f"sequential calibration: {where} received {k}= a cache with past tokens; calibrate without past key values")
            continue
        out[k] = v
    return out


def _copy(value: Any) -> Any:
    """``value`` with every tensor in it (in tuples, lists, dicts) detached and cloned."""
    if isinstance(value, torch.Tensor):
        return value.detach().clone()
    if isinstance(value, (tuple, list)):
        return type(value)(_copy(v) for v in value)
    if isinstance(value, dict):
        return {k: _copy(v) for k, v in value.items()}
    return value


def _skip_output(template: Any, hidden: torch.Tensor) -> Any:
    if template == "tensor":
        return hidden
    return (hidden,) + (None,) * (template[1] - 1)


def _template(output: Any) -> Any:
    if isinstance(output, torch.Tensor):
        return "tensor"
    if isinstance(output, (tuple, list)) and output and isinstance(output[0], torch.Tensor):
        return ("tuple", len(output))
    raise ValueError(f"sequential calibration: a decoder layer returned {type(output).__name__}; expected a tensor or a tuple starting with one")


# ---------------------------------------------------------------------------------- the passes


class _Driver:
    """The state machine behind the patched layer forwards (see the module docstring)."""

    def __init__(self, model: nn.Module, name: str, layers: nn.ModuleList) -> None:
        self.model, self.name, self.layers = model, name, layers
        self.run_idx: Optional[int] = None  # the layer that runs on its cached inputs this pass
        self.capture_idx: Optional[int] = None  # the layer that records its inputs this pass
        self.cached: list[tuple[tuple, dict]] = []  # inputs of run_idx, one per batch
        self.captured: list[tuple[tuple, dict]] = []
        self.templates: list[Any] = [None] * len(layers)
        self.position = 0

    def layer_forward(self, idx: int, original: Callable) -> Callable:
        def forward(*args, **kwargs):
            if idx == self.capture_idx:
                # copies: the model may reuse the memory of what it hands a layer (Megatron's global buffers)
                self.captured.append((_copy(args), _copy(_strip_cache(kwargs, f"{self.name}.{idx}"))))
                raise _StopForward
            if idx == self.run_idx:
                if self.position >= len(self.cached):
                    raise RuntimeError(f"sequential calibration: the forward loop ran more batches than in the pass that captured {self.name}.{idx}'s inputs")
                cargs, ckwargs = self.cached[self.position]
                if _hidden(args, kwargs).shape != _hidden(cargs, ckwargs).shape:
                    raise RuntimeError(
                        f"sequential calibration: batch {self.position} of this pass has hidden states of shape {tuple(_hidden(args, kwargs).shape)} at "
                        f"{self.name}.{idx}, the pass that recorded its inputs {tuple(_hidden(cargs, ckwargs).shape)}: the forward loop must feed the same batches in the same order every time"
                    )
                self.position += 1
                out = original(*cargs, **ckwargs)
                self.templates[idx] = _template(out)
                return out
            if self.templates[idx] is None:
                raise RuntimeError(f"sequential calibration: {self.name}.{idx} was reached before it ran")
            return _skip_output(self.templates[idx], _hidden(args, kwargs))

        return forward

    def run_pass(self, forward_loop: Callable[[nn.Module], Any]) -> None:
        self.position, self.captured = 0, []
        model_forward = self.model.forward

        def stopping_forward(*args, **kwargs):
            try:
                return model_forward(*args, **kwargs)
            except _StopForward:
                return None

        restore = _patch_forward(self.model, stopping_forward)
        try:
            with torch.no_grad():
                forward_loop(self.model)
        finally:
            restore()
        if self.run_idx is not None and self.position != len(self.cached):
            raise RuntimeError(f"sequential calibration: {self.name}.{self.run_idx} got {len(self.cached)} cached batches but the loop ran {self.position}")


def _leaf_ids(module: nn.Module) -> set[int]:
    return {id(q) for _, q in iter_leaf_quantizers(module)}


def _fingerprint(model: nn.Module, layers: nn.ModuleList) -> dict:
    cfg = getattr(model, "_quantlib_config", None)
    return {"layers": len(layers), "quantizers": [n for n, _ in iter_leaf_quantizers(model)], "config": repr(cfg.to_dict()) if cfg is not None else None}


def _read_resume(path: Optional[str], fingerprint: dict) -> Optional[dict]:
    if path is None or not os.path.exists(path):
        return None
    state = torch.load(path, map_location="cpu", weights_only=True)
    if state.get("schema") != RESUME_SCHEMA or state.get("fingerprint") != fingerprint:
        raise ValueError(f"sequential calibration: resume file {path} was written for another model or config; delete it to start over")
    return state


def calibrate_sequential(model: nn.Module, forward_loop: Optional[Callable[[nn.Module], Any]], options: Union[bool, dict, SequentialOptions], expert_policy: str = "max_of_peers") -> None:
    """Max calibration of ``model`` (weights and activations), one decoder layer at a time (see the module docstring)."""
    if forward_loop is None:
        raise ValueError("sequential calibration needs a forward_loop (it replays the model's layers on its batches)")
    opts = SequentialOptions.from_any(options)
    device = torch.device(opts.device) if opts.device is not None else None
    name, layers = decoder_layers(model, opts.layers)
    in_layers = set().union(*(_leaf_ids(layer) for layer in layers))
    layer_modules = {id(m) for layer in layers for m in layer.modules()}
    for _, m in quant_modules(model):
        if id(m) not in layer_modules:
            m.calibrate_weights()  # resident modules; a layer's weights calibrate when it is loaded
    active = activation_leaves(model)
    enabled = [q for _, q in iter_leaf_quantizers(model) if q.is_enabled]
    fingerprint = _fingerprint(model, layers)
    resume = _read_resume(opts.resume_file, fingerprint)
    driver = _Driver(model, name, layers)
    restores = [_patch_forward(layer, driver.layer_forward(i, layer.forward)) for i, layer in enumerate(layers)]
    for _, q in active:
        q.reset_amax()
    for q in enabled:
        q.disable_quant()  # as in-memory calibration: activations of the unquantized model
    start = 0
    try:
        if resume is not None:
            start = resume["done"]
            by_name = dict(iter_leaf_quantizers(model))
            for qname, amax in resume["amax"].items():
                by_name[qname].amax = amax
            driver.templates[:start] = resume["templates"]
            driver.captured = [(tuple(a), dict(k)) for a, k in resume["inputs"]]
        else:
            driver.capture_idx = 0
            driver.run_pass(forward_loop)
        for p in range(start + 1, len(layers) + 1):
            idx = p - 1
            layer = layers[idx]
            driver.cached, driver.run_idx = driver.captured, idx
            driver.capture_idx = p if p < len(layers) else None
            home = _load_layer(layer, f"{name}.{idx}", opts, device)
            if device is not None:
                driver.cached = [_to_device(entry, device) for entry in driver.cached]
            try:
                for _, m in quant_modules(layer):
                    m.calibrate_weights()
                here = _leaf_ids(layer)
                mine = [(n, q) for n, q in active if id(q) in here]
                if p == len(layers):  # the last pass runs past the layers: the quantizers outside them
                    mine += [(n, q) for n, q in active if id(q) not in in_layers]  # see the real hidden states
                for _, q in mine:
                    q.enable_calib()
                try:
                    driver.run_pass(forward_loop)
                finally:
                    for _, q in mine:
                        q.disable_calib()
                for _, q in mine:
                    q.load_calib_amax()
            finally:
                _release_layer(layer, home)
            driver.cached = []
            if opts.resume_file is not None and p < len(layers):
                done = {n: q.amax.detach().cpu() for n, q in iter_leaf_quantizers(model) if id(q) in in_layers and q.amax is not None and _layer_of(n, name) < p}
                inputs = [(_to_device(e, torch.device("cpu"))) for e in driver.captured]
                atomic_torch_save({"schema": RESUME_SCHEMA, "fingerprint": fingerprint, "done": p, "amax": done, "templates": driver.templates[:p], "inputs": inputs}, opts.resume_file, crc32=False)
    finally:
        for restore in restores:
            restore()
        for q in enabled:
            q.enable_quant()
    finish_activations(model, active, expert_policy)
    if opts.resume_file is not None and os.path.exists(opts.resume_file):
        os.unlink(opts.resume_file)  # finished: a later run starts over


def _layer_of(qname: str, layers_name: str) -> int:
    rest = qname[len(layers_name) + 1 :] if layers_name else qname
    return int(rest.split(".", 1)[0])


def _to_device(entry: tuple[tuple, dict], device: torch.device) -> tuple[tuple, dict]:
    def move(v: Any) -> Any:
        if isinstance(v, torch.Tensor):
            return v.to(device)
        if isinstance(v, (tuple, list)):
            return type(v)(move(x) for x in v)
        if isinstance(v, dict):
            return {k: move(x) for k, x in v.items()}
        return v

    args, kwargs = entry
    return move(args), move(kwargs)


__all__ = ["SequentialOptions", "calibrate_sequential", "decoder_layers", "layer_file", "offload_layer", "offload_to_disk"]
