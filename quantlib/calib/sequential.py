"""Layer-by-layer ("sequential") calibration with any registered algorithm, for models larger than the device.

One pass of the forward loop records the inputs of the first decoder layer (args and kwargs exactly as the
model hands them, one entry per batch); then, for each layer ``i`` in order:

- layer ``i`` is loaded onto the device once and the algorithm's runner (``calib.registry``) is called on it
  alone (a view of the model that holds only this layer, so quantizers keep their full names), with a
  forward loop that replays the layer on its cached inputs; the first replay keeps the layer's outputs; the
  layer then goes back (to its original device, or to ``meta`` if it came from an offload folder);
- the forward loop runs once more: layers ``< i`` are skipped (they return their input hidden states, so
  nothing but the embeddings runs before them), layer ``i`` returns its kept outputs, and layer ``i + 1``
  records its inputs and stops the pass.

A last pass runs past the layers (layer ``L - 1`` returns its kept outputs) and the runner is called on
the quantizers outside the layers (the head's, the final norm's, any before the first layer), on the real
tensors.

Every algorithm takes its statistics from the unquantized model (max calibration's pass, which SmoothQuant
and AWQ hook to record each linear's inputs; the replay runs with quantization off and, as in memory, with
the scales the runner cleared), and a layer's inputs come from its unquantized predecessors; so amax and
``pre_quant_scale`` are bit-identical to in-memory calibration with the same algorithm, the same batches
in the same order. Every rank runs the same layers in the same order, so the runners' data-parallel
reductions (``CalibContext.sync``) meet. The memory held at once is the resident part of the
model, one layer, its cached inputs and outputs (or the next layer's inputs) and what the algorithm
records for that layer. The forward loop must feed the same batches in the same order on every call (a
batch of another shape raises), must not use the model's output (a stopped pass returns None) and must not
feed past key values (an empty cache is dropped, which changes nothing).

Resume: after each layer the state (finished layers' amax, ``pre_quant_scale`` and the results runners
leave on modules, the next layer's cached inputs) is written atomically to ``resume_file``; a later call
with the same model, config, algorithm and file continues after the last finished layer and ends the same.
The file is fingerprinted with the model's tensor shapes and weight digests and refused, naming the file and
the first difference, for another model, config or algorithm, or where it cannot be read
(:mod:`quantlib.calib.resume`).
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import dataclasses
import functools
import os
import sys
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Optional, Union

import torch
from torch import nn

from .._atomic_io import atomic_torch_save
from ..calib_config import AlgorithmConfig
from ..fields import ConfigError, parse_fields
from ..nn.quant_module import QuantModule
from ..nn.tensor_quantizer import TensorQuantizer
from ..traversal import clear_weight_cache, iter_leaf_quantizers, iter_quantizers
from .activations import max_calibrate
from .registry import CalibContext, runner
from .resume import (
    RESUME_SCHEMA,
    check_digests,
    digests,
    fingerprint,
    finished_state,
    is_quantizer,
    model_tensors,
    own_tensors,
    read_resume,
    restore_finished,
    view,
)


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
    offload_folder: Optional[Union[str, os.PathLike]] = None
    resume_file: Optional[Union[str, os.PathLike]] = None

    @classmethod
    def from_any(cls, value: Union[bool, dict, "SequentialOptions"]) -> "SequentialOptions":
        """``True``, a dict of the fields, or the options themselves; unknown options and ill-typed values
        raise ConfigError naming the option and the value."""
        if isinstance(value, SequentialOptions):
            return value
        if value is True:
            return cls()
        if isinstance(value, dict):
            return cls(**parse_fields(cls, value, "sequential calibration: ", "option"))
        raise ConfigError(f"sequential must be True, a dict or SequentialOptions, got {value!r}")


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
        raise ValueError(f"sequential calibration: no nn.ModuleList of repeated layers in {type(model).__name__}; pass "
                         "SequentialOptions(layers=...)")
    return best


def layer_file(folder: str, name: str) -> str:
    """The file of layer ``name`` (its dotted name in the model) in an offload folder."""
    return os.path.join(folder, f"{name}.pt")


def _to_meta(layer: nn.Module, only: Optional[set] = None) -> None:
    """Parameters and buffers of ``layer`` outside its quantizers onto ``meta`` (``only``: those (module id, name))."""
    for m, kind, n, t in list(own_tensors(layer)):
        if only is None or (id(m), n) in only:
            meta = torch.empty_like(t, device="meta")
            getattr(m, kind)[n] = nn.Parameter(meta, requires_grad=t.requires_grad) if kind == "_parameters" else meta


def offload_layer(layer: nn.Module, path: str) -> None:
    """Write ``layer``'s parameters and buffers outside its quantizers to ``path`` (atomically) and leave
    them on ``meta``: what :func:`offload_to_disk` does for each decoder layer."""
    prefixes = {id(m): p for p, m in layer.named_modules()}
    state = {}
    for m, _, n, t in own_tensors(layer):
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
    tensors = list(own_tensors(layer))
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
    (its mmap threshold grows after the first large free), and they add up over dozens of layers
    (benchmarks/RESULTS_sequential.md: the peak grew with the layer count before this)."""
    trim = _malloc_trim()
    if trim is not None:
        trim(0)


def _release_layer(layer: nn.Module, home: _Home) -> None:
    clear_weight_cache(layer)  # cached (unquantized) weights would keep the layer's tensors alive
    if home.device is None:
        _to_meta(layer, home.loaded)
        if home.moved:  # what stays resident (quantizers, bookkeeping buffers) waits on the CPU
            for m in layer.modules():
                if is_quantizer(m):
                    m.to("cpu")
            for m, kind, n, t in list(own_tensors(layer)):
                if t.device.type != "meta":
                    getattr(m, kind)[n] = t.to("cpu") if kind == "_buffers" else nn.Parameter(t.to("cpu"), requires_grad=t.requires_grad)
    else:
        layer.to(home.device)
    _return_freed_memory()


@contextlib.contextmanager
def offloaded_layer(layer: nn.Module, where: str, offload_folder: str) -> Iterator[nn.Module]:
    """``layer`` (dotted name ``where``) with its ``meta`` tensors read from ``offload_folder`` onto the CPU
    for the ``with`` body, and back on ``meta`` after it (what the export of an offloaded model reads)."""
    home = _load_layer(layer, where, SequentialOptions(offload_folder=offload_folder), None)
    try:
        yield layer
    finally:
        _release_layer(layer, home)


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
                raise ValueError(f"sequential calibration: {where} received {k}= a cache with past tokens; calibrate without past key "
                                 "values")
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
    raise ValueError(f"sequential calibration: a decoder layer returned {type(output).__name__}; expected a tensor or a tuple starting "
                     "with one")


# ---------------------------------------------------------------------------------- the passes


class _Driver:
    """The state machine behind the patched layer forwards (see the module docstring)."""

    def __init__(self, model: nn.Module, name: str, layers: nn.ModuleList) -> None:
        self.model, self.name, self.layers = model, name, layers
        self.originals = [layer.forward for layer in layers]  # taken before the patch
        self.run_idx: Optional[int] = None  # the layer whose kept outputs stand in for it this pass
        self.capture_idx: Optional[int] = None  # the layer that records its inputs this pass
        self.cached: list[tuple[tuple, dict]] = []  # inputs of the layer being calibrated, one per batch
        self.shapes: list[torch.Size] = []  # hidden-state shapes of run_idx's inputs
        self.outputs: list[Any] = []  # run_idx's outputs, one per batch
        self.captured: list[tuple[tuple, dict]] = []
        self.templates: list[Any] = [None] * len(layers)
        self.position = 0
        #: with a resume file: its fingerprint and the weight digests of the tensors outside the layers and
        #: of the finished layers, by full name (None: no resume file)
        self.fingerprint: Optional[dict] = None
        self.digests: Optional[dict[str, tuple[int, int]]] = None

    def layer_forward(self, idx: int) -> Callable:
        def forward(*args, **kwargs):
            if idx == self.capture_idx:
                # copies: the model may reuse the memory of what it hands a layer (Megatron's global buffers)
                self.captured.append((_copy(args), _copy(_strip_cache(kwargs, f"{self.name}.{idx}"))))
                raise _StopForward
            if idx == self.run_idx:
                if self.position >= len(self.outputs):
                    raise RuntimeError("sequential calibration: the forward loop ran more batches than in the pass that captured "
                                       f"{self.name}.{idx}'s inputs")
                shape, recorded = _hidden(args, kwargs).shape, self.shapes[self.position]
                if shape != recorded:
                    raise RuntimeError(
                        f"sequential calibration: batch {self.position} of this pass has hidden states of shape {tuple(shape)} at "
                        f"{self.name}.{idx}, the pass that recorded its inputs {tuple(recorded)}: the forward loop must feed the same "
                        "batches in the same order every time"
                    )
                self.position += 1
                return self.outputs[self.position - 1]
            if self.templates[idx] is None:
                raise RuntimeError(f"sequential calibration: {self.name}.{idx} was reached before it ran")
            return _skip_output(self.templates[idx], _hidden(args, kwargs))

        return forward

    def replay(self, idx: int) -> Callable[[nn.Module], None]:
        """The forward loop a runner gets for layer ``idx``: the layer on each cached input; the first
        call keeps the outputs (a runner's later calls would see the same unquantized flow in memory only
        if it changed nothing in between, which no runner does)."""

        def loop(_view: nn.Module) -> None:
            keep = not self.outputs
            for args, kwargs in self.cached:
                out = self.originals[idx](*args, **kwargs)
                if keep:
                    self.outputs.append(_copy(out))
                    self.templates[idx] = _template(out)

        return loop

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
        if self.run_idx is not None and self.position != len(self.outputs):
            raise RuntimeError(f"sequential calibration: {self.name}.{self.run_idx} got {len(self.outputs)} cached batches but the loop "
                               f"ran {self.position}")


def _resident_paths(model: nn.Module, layers: nn.ModuleList) -> list[str]:
    """The outermost modules outside the decoder layers that are quantized or hold quantizers."""
    inside = {id(m) for m in layers.modules()}
    holders = {id(parent) for _, parent, _, _ in iter_quantizers(model)}
    paths: list[str] = []
    covered: set[int] = set()
    for path, m in model.named_modules():
        if id(m) in inside or id(m) in covered or not (isinstance(m, QuantModule) or id(m) in holders):
            continue
        if any(id(x) in inside for x in m.modules()):
            raise ValueError(f"sequential calibration: {path or type(model).__name__} holds quantizers and also the decoder layers; only "
                             "modules outside the layers can be calibrated apart from them")
        paths.append(path)
        covered.update(id(x) for x in m.modules())
    return paths


def _context(ctx: CalibContext, loop: Callable[[nn.Module], Any]) -> CalibContext:
    """``ctx`` with ``loop`` as its forward loop (and max calibration over it)."""
    return dataclasses.replace(ctx, forward_loop=loop, max_calibrate=lambda m: max_calibrate(m, loop, ctx.expert_input_policy))


def calibrate_sequential(model: nn.Module, algo: AlgorithmConfig, ctx: CalibContext, options: Union[bool, dict, SequentialOptions]) -> None:
    """Calibrate ``model`` with ``algo`` (any registered algorithm), one decoder layer at a time (see the
    module docstring); ``ctx`` is the context in-memory calibration would give the runner."""
    if ctx.forward_loop is None:
        raise ValueError("sequential calibration needs a forward_loop (it replays the model's layers on its batches)")
    loop = ctx.forward_loop
    opts = SequentialOptions.from_any(options)
    if algo.mutates_weights and (opts.offload_folder is not None or opts.resume_file is not None):  # neither keeps rewritten weights
        lost = "an offload_folder (read, never written) or a resume_file would lose"
        raise ConfigError(f"sequential calibration: algorithm {algo.method!r} rewrites the weights, which {lost}; calibrate without them")
    device = torch.device(opts.device) if opts.device is not None else None
    name, layers = decoder_layers(model, opts.layers)
    run = runner(algo.method)
    residents = view(model, _resident_paths(model, layers))
    driver = _Driver(model, name, layers)
    resume = _open_resume(model, driver, algo, opts, ctx.config)
    restores = [_patch_forward(layer, driver.layer_forward(i)) for i, layer in enumerate(layers)]
    # the passes run the unquantized model, as in memory; the runners switch their own quantizers (a
    # chain's weights calibrate with quantization on: member i sees the output of members < i)
    quant_off = _QuantOff([q for _, q in iter_leaf_quantizers(model) if q.is_enabled])
    try:
        start = 0
        if resume is not None:
            start = resume["done"]
            restore_finished(model, name, layers, resume)
            driver.templates[:start] = resume["templates"]
            driver.captured = [(tuple(a), dict(k)) for a, k in resume["inputs"]]
        else:
            driver.capture_idx = 0
            with quant_off:
                driver.run_pass(loop)
        for idx in range(start, len(layers)):
            _calibrate_layer(model, driver, idx, run, algo, ctx, opts, device)
            if idx + 1 < len(layers):
                driver.capture_idx = idx + 1
                with quant_off:
                    driver.run_pass(loop)
                driver.outputs = []
                if opts.resume_file is not None:
                    _write_resume(model, driver, idx + 1, opts.resume_file)
        driver.capture_idx = None  # the last pass runs past the layers, for the quantizers outside them
        run(residents, algo, _context(ctx, lambda _view: driver.run_pass(loop)))
    finally:
        for restore in restores:
            restore()
    if opts.resume_file is not None and os.path.exists(opts.resume_file):
        os.unlink(opts.resume_file)  # finished: a later run starts over


def _open_resume(model: nn.Module, driver: _Driver, algo: AlgorithmConfig, opts: SequentialOptions, config: Any) -> Optional[dict]:
    """With a resume file, fingerprint the model (shapes, and digests of the weights outside the layers) into
    ``driver``; return the file's state where it exists and was written for this model (its finished layers'
    weights are read again to be compared, from the offload folder where they are on meta), else None."""
    if opts.resume_file is None:
        return None
    path = opts.resume_file
    driver.fingerprint = fingerprint(model, driver.layers, algo, config)
    driver.digests = digests(model_tensors(model, skip=driver.layers))
    if not os.path.exists(path):
        return None
    state = read_resume(path, driver.fingerprint)
    check_digests(path, driver.digests, state["digests"])
    for i in range(state["done"]):
        check_digests(path, _layer_digests(driver.layers[i], f"{driver.name}.{i}", opts), state["digests"])
    driver.digests = dict(state["digests"])
    return state


def _layer_digests(layer: nn.Module, where: str, opts: SequentialOptions) -> dict[str, tuple[int, int]]:
    """Digests of the weights of layer ``where``, loaded from the offload folder for the time where they are on meta."""
    if not any(t.device.type == "meta" for *_, t in own_tensors(layer)):
        return digests(model_tensors(layer, where))
    home = _load_layer(layer, where, opts, None)
    try:
        return digests(model_tensors(layer, where))
    finally:
        _release_layer(layer, home)


def _write_resume(model: nn.Module, driver: _Driver, done: int, path: str) -> None:
    """Layers ``< done`` are finished: write their state, the fingerprint and the next layer's inputs to ``path``."""
    inputs = [_to_device(e, torch.device("cpu")) for e in driver.captured]
    state = {"schema": RESUME_SCHEMA, "fingerprint": driver.fingerprint, "digests": driver.digests, "done": done,
             "templates": driver.templates[:done], "inputs": inputs}
    atomic_torch_save({**state, **finished_state(model, driver.name, done)}, path, crc32=False)


class _QuantOff:
    """``with``: quantization of ``quantizers`` off (they keep calibrating if they do), back on after."""

    def __init__(self, quantizers: list[TensorQuantizer]) -> None:
        self.quantizers = quantizers

    def __enter__(self) -> None:
        for q in self.quantizers:
            q.disable_quant()

    def __exit__(self, *exc) -> bool:
        for q in self.quantizers:
            q.enable_quant()
        return False


def _calibrate_layer(model: nn.Module, driver: _Driver, idx: int, run: Callable, algo: AlgorithmConfig, ctx: CalibContext,
                     opts: SequentialOptions, device: Optional[torch.device]) -> None:
    """Load layer ``idx``, run the algorithm on it over its cached inputs (keeping its outputs), send it back."""
    where = f"{driver.name}.{idx}"
    layer = driver.layers[idx]
    driver.cached, driver.captured, driver.outputs = driver.captured, [], []
    home = _load_layer(layer, where, opts, device)
    try:
        if driver.digests is not None:  # its weights are loaded now: their digest costs one read
            driver.digests.update(digests(model_tensors(layer, where)))
        if device is not None:
            driver.cached = [_to_device(entry, device) for entry in driver.cached]
        driver.shapes = [_hidden(a, k).shape for a, k in driver.cached]
        run(view(model, [where]), algo, _context(ctx, driver.replay(idx)))
    finally:
        _release_layer(layer, home)
    if driver.cached and not driver.outputs:
        raise RuntimeError(f"sequential calibration: algorithm {algo.method!r} never ran the forward loop on {where}, so the next layer "
                           "has no inputs")
    driver.cached, driver.run_idx = [], idx


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
