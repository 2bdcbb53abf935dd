"""The resume file of layer-by-layer calibration (:mod:`quantlib.calib.sequential`): what it holds, the
checks it must pass before it is used, and the finished layers' state it saves and puts back.

It holds the fingerprint of the run (config, algorithm, number of layers, quantizer names, and the shape
and dtype of every parameter and persistent buffer of the model outside its quantizers), a digest of the
weights outside the decoder layers (their outputs are the next layer's cached inputs) and of each finished
layer's weights, the finished layers' amax, ``pre_quant_scale``, NVFP4 static block amax and runners'
results, and the next layer's cached inputs. A file written for another model (the same module names with
other widths or other weights), config or algorithm, by another schema, or one that cannot be read
(truncated, corrupt, not written by quantlib) is refused with a CalibrationError naming the file and the
first difference: it is never half used.

The digest of a tensor is exact integer arithmetic on its raw bits (read as 16-bit integers, 8-bit for
one-byte dtypes): their sum, which any change of one element changes, and a sum weighted by position
modulo 251, which swapped rows change; the same on every device and thread count, and one read of the
weights, far less than calibration's passes over them.
"""

from __future__ import annotations

import functools
from typing import Any, Iterator, Optional

import torch
from torch import nn

from ..calib_config import AlgorithmConfig
from ..nn.containers import QuantizerContainer
from ..nn.tensor_quantizer import CalibrationError, TensorQuantizer
from ..traversal import iter_leaf_quantizers, quant_modules
from .registry import RESULT_ATTRIBUTES

RESUME_SCHEMA = 3  # 2: pre_quant_scale, runners' module results, the algorithm; 3: tensor shapes, weight digests

#: the position weights of the digest repeat with this period; a chunk is a multiple of it
_PERIOD = 251
_CHUNK = _PERIOD * 4096
_DELETE = "delete it to start over, or calibrate without resume_file"


def is_quantizer(m: nn.Module) -> bool:
    """True for a TensorQuantizer or a container of them."""
    return isinstance(m, (TensorQuantizer, QuantizerContainer))


def own_tensors(layer: nn.Module, skip: Optional[nn.Module] = None) -> Iterator[tuple[nn.Module, str, str, torch.Tensor]]:
    """(module, kind, name, tensor) of every parameter and buffer of ``layer`` outside its quantizers (and
    outside ``skip``'s subtree)."""
    stack = [layer]
    while stack:
        m = stack.pop()
        for n, p in m._parameters.items():
            if p is not None:
                yield m, "_parameters", n, p
        for n, b in m._buffers.items():
            if b is not None:
                yield m, "_buffers", n, b
        stack.extend(c for c in m._modules.values() if c is not None and c is not skip and not is_quantizer(c))


def model_tensors(root: nn.Module, prefix: str = "", skip: Optional[nn.Module] = None) -> dict[str, torch.Tensor]:
    """Full name -> tensor of the parameters and persistent buffers of ``root`` (named under ``prefix``)
    outside its quantizers and ``skip``: the model's own state (non-persistent buffers are derived caches)."""
    names = {id(m): p for p, m in root.named_modules(remove_duplicate=False)}
    out = {}
    for m, kind, n, t in own_tensors(root, skip):
        if kind == "_buffers" and n in m._non_persistent_buffers_set:
            continue
        out[".".join(x for x in (prefix, names[id(m)], n) if x)] = t
    return out


def view(model: nn.Module, paths: list[str]) -> nn.Module:
    """A module tree that holds only the submodules at ``paths`` of ``model``, under the same names (plain
    ``nn.Module`` containers in between), so a runner given it sees and names only them."""
    root = nn.Module()
    for path in paths:
        parent, parts = root, path.split(".")
        for part in parts[:-1]:
            if part not in parent._modules:
                parent._modules[part] = nn.Module()
            parent = parent._modules[part]
        parent._modules[parts[-1]] = model.get_submodule(path)
    return root


# ---------------------------------------------------------------------------------- digests


@functools.lru_cache(maxsize=8)
def _position_weights(device: torch.device) -> torch.Tensor:
    return (torch.arange(_CHUNK, dtype=torch.int32, device=device) % _PERIOD) + 1


def tensor_digest(t: torch.Tensor) -> torch.Tensor:
    """int64 [2] on ``t``'s device: the sum of ``t``'s raw bits as integers and their sum weighted by
    position (see the module docstring); exact, so equal tensors give equal digests anywhere."""
    flat = t.detach().reshape(-1)
    bits = flat.view(torch.int16) if flat.element_size() % 2 == 0 else flat.view(torch.uint8)
    weights = _position_weights(bits.device)
    total = torch.zeros(2, dtype=torch.int64, device=bits.device)
    with torch.no_grad():
        for start in range(0, bits.numel(), _CHUNK):
            x = bits[start : start + _CHUNK]
            total[0] += x.sum(dtype=torch.int64)
            total[1] += (x.to(torch.int32) * weights[: x.numel()]).sum(dtype=torch.int64)  # |x w| < 2^23
    return total


def digests(tensors: dict[str, torch.Tensor]) -> dict[str, tuple[int, int]]:
    """Name -> digest of every tensor not on ``meta`` (one device sync for all)."""
    real = {n: t for n, t in tensors.items() if t.device.type != "meta"}
    if not real:
        return {}
    values = torch.stack([tensor_digest(t).cpu() for t in real.values()]).tolist()
    return {n: (v[0], v[1]) for n, v in zip(real, values)}


# ---------------------------------------------------------------------------------- the checks


def fingerprint(model: nn.Module, layers: nn.ModuleList, algo: AlgorithmConfig, cfg: Any) -> dict:
    """What a resume file must have been written for: config (``cfg``, a QuantizeConfig or None), algorithm,
    layers, quantizer names, shapes."""
    return {
        "layers": len(layers),
        "quantizers": [n for n, _ in iter_leaf_quantizers(model)],
        "config": repr(cfg.to_dict()) if cfg is not None else None,
        "algorithm": repr(algo.to_dict()),
        "shapes": {n: (tuple(t.shape), str(t.dtype)) for n, t in model_tensors(model).items()},
    }


def _load(path: str) -> dict:
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # torch raises several types for truncated or foreign files
        text = str(exc)
        why = ("it holds objects other than tensors and plain containers" if "weights_only" in text or "Weights only" in text
               else (text.splitlines() or [type(exc).__name__])[0])
        raise CalibrationError(f"sequential calibration: resume file {path} cannot be read (truncated, corrupt or not written by quantlib: "
                               f"{why}); {_DELETE}") from None
    if not isinstance(state, dict) or "schema" not in state:
        raise CalibrationError(f"sequential calibration: {path} is not a quantlib resume file (no 'schema' in it); {_DELETE}")
    return state


def _first_shape_difference(here: dict, there: dict) -> Optional[str]:
    for n in here.keys() | there.keys():
        if n not in there:
            return f"{n} is in the model but not in the file"
        if n not in here:
            return f"{n} is in the file but not in the model"
    for n, (shape, dtype) in here.items():
        if (tuple(there[n][0]), there[n][1]) != (shape, dtype):
            return f"{n} is {shape} {dtype} here, {tuple(there[n][0])} {there[n][1]} in the file"
    return None


def read_resume(path: str, fp: dict) -> dict:
    """The state in ``path``, after checking it was written by this schema for fingerprint ``fp``."""
    state = _load(path)
    if state["schema"] != RESUME_SCHEMA:
        raise CalibrationError(f"sequential calibration: resume file {path} has schema {state['schema']!r}, this quantlib writes "
                               f"{RESUME_SCHEMA}; {_DELETE}")
    saved = state.get("fingerprint", {})
    for key in ("layers", "quantizers", "config", "algorithm"):
        if saved.get(key) != fp[key]:
            raise CalibrationError(f"sequential calibration: resume file {path} was written for another model, config or algorithm (its "
                                   f"{key} differs); {_DELETE}")
    shape = _first_shape_difference(fp["shapes"], saved.get("shapes", {}))
    if shape is not None:
        raise CalibrationError(f"sequential calibration: resume file {path} was written for another model: {shape}; {_DELETE}")
    return state


def check_digests(path: str, here: dict[str, tuple[int, int]], saved: dict) -> None:
    """Raise, naming the first tensor, where one of ``here`` has a digest unlike the file's (``saved``)."""
    for n, d in here.items():
        if n in saved and tuple(saved[n]) != d:
            raise CalibrationError(f"sequential calibration: resume file {path} was written for another model: the values of {n} differ "
                                   f"(same shape); {_DELETE}")


# ---------------------------------------------------------------------------------- finished layers


def _cpu(value: Any) -> Any:
    return value.detach().cpu() if isinstance(value, torch.Tensor) else value


def finished_state(model: nn.Module, name: str, done: int) -> dict:
    """amax, pre_quant_scale, NVFP4 static block amax and runners' module results of layers ``< done``, on the CPU."""
    v = view(model, [f"{name}.{i}" for i in range(done)])
    leaves = list(iter_leaf_quantizers(v))
    results = {n: {a: _cpu(getattr(m, a)) for a in RESULT_ATTRIBUTES if hasattr(m, a)} for n, m in quant_modules(v)}
    return {
        "amax": {n: _cpu(q.amax) for n, q in leaves if q.amax is not None},
        "pre_quant_scale": {n: _cpu(q.pre_quant_scale) for n, q in leaves if q.pre_quant_scale is not None},
        "block_amax": {n: _cpu(q.block_amax) for n, q in leaves if q.block_amax is not None},
        "results": {n: r for n, r in results.items() if r},
    }


def restore_finished(model: nn.Module, name: str, layers: nn.ModuleList, state: dict) -> None:
    """Layers ``< state["done"]`` get the state :func:`finished_state` saved, on their own device."""
    for i in range(state["done"]):
        tensors = [t for *_, t in own_tensors(layers[i]) if t.device.type != "meta"]
        device = tensors[0].device if tensors else torch.device("cpu")
        v = view(model, [f"{name}.{i}"])
        for n, q in iter_leaf_quantizers(v):
            amax, pqs = state["amax"].get(n), state["pre_quant_scale"].get(n)
            q.amax = None if amax is None else amax.to(device)
            q.pre_quant_scale = None if pqs is None else pqs.to(device)
            blocks = state["block_amax"].get(n)
            if blocks is not None:
                q.block_amax = blocks.to(device)
        for n, m in quant_modules(v):
            for attr in RESULT_ATTRIBUTES:
                m.__dict__.pop(attr, None)
            for attr, value in state["results"].get(n, {}).items():
                setattr(m, attr, value.to(device) if isinstance(value, torch.Tensor) else value)
