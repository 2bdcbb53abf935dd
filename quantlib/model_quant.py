"""quantize(), calibrate(), wildcard enable/disable and the summary table."""

from __future__ import annotations

import fnmatch
import io
import logging
import sys
from typing import TYPE_CHECKING, Any, Callable, Iterator, Optional, Union

import torch
from torch import nn

from .config import QuantizeConfig
from .kv_cache import check_kv_reach
from .nn.containers import GroupedQuantizer, QuantizerContainer, build_quantizer, fits
from .nn.quant_module import QuantModule, QuantModuleRegistry
from .nn.tensor_quantizer import CalibrationError, TensorQuantizer

ForwardLoop = Callable[[nn.Module], Any]
if TYPE_CHECKING:
    from .calib.sequential import SequentialOptions
_log = logging.getLogger("quantlib")


# ------------------------------------------------------------------------------------ traversal


def iter_quantizers(model: nn.Module) -> Iterator[tuple[str, nn.Module, str, nn.Module]]:
    """(full name, parent module, attribute name, quantizer) of every top-level quantizer; the members
    of a container are not listed separately (see :func:`iter_leaf_quantizers`)."""

    def walk(module: nn.Module, prefix: str):
        for attr, child in module.named_children():
            full = f"{prefix}.{attr}" if prefix else attr
            if isinstance(child, (TensorQuantizer, QuantizerContainer)):
                yield full, module, attr, child
            else:
                yield from walk(child, full)

    yield from walk(model, "")


def leaves_of(name: str, q: nn.Module) -> Iterator[tuple[str, TensorQuantizer]]:
    """(name, TensorQuantizer) of ``q`` itself or of each member (``name.i``, depth first)."""
    if isinstance(q, TensorQuantizer):
        yield name, q
        return
    for i, m in enumerate(q):
        yield from leaves_of(f"{name}.{i}", m)


def iter_leaf_quantizers(model: nn.Module) -> Iterator[tuple[str, TensorQuantizer]]:
    for name, _, _, q in iter_quantizers(model):
        yield from leaves_of(name, q)


def quant_modules(model: nn.Module) -> Iterator[tuple[str, QuantModule]]:
    for name, m in model.named_modules():
        if isinstance(m, QuantModule):
            yield name, m


def _weight_quantizer_ids(model: nn.Module) -> set[int]:
    ids = set()
    for _, m in quant_modules(model):
        for qname in m.weight_quantizer_names:
            for _, leaf in leaves_of(qname, getattr(m, qname)):
                ids.add(id(leaf))
    return ids


# ------------------------------------------------------------------------------------ conversion


def convert(model: nn.Module) -> nn.Module:
    """Swap every module of a registered class for its quantized class (in place; returns the model,
    which is new only if the root itself was swapped). Parameters are shared, never copied."""
    from . import plugins

    plugins.register_available()
    return _convert(model, {})


def _convert(module: nn.Module, done: dict[int, nn.Module]) -> nn.Module:
    """``module`` or its quantized version, with every registered descendant swapped, top down on the
    live tree (so the children of a converted module are converted too); a module reached twice (shared)
    is converted once and stays shared."""
    if id(module) in done:
        return done[id(module)]
    new = module
    if not isinstance(module, QuantModule) and QuantModuleRegistry.is_registered(type(module)):
        new = QuantModuleRegistry.convert(module)
    done[id(module)] = new
    for attr, child in list(new._modules.items()):
        if child is None or isinstance(child, (TensorQuantizer, QuantizerContainer)):
            continue
        converted = _convert(child, done)
        if converted is not child:
            new._modules[attr] = converted
    return new


def _class_names(module: nn.Module) -> tuple[str, ...]:
    return tuple(c.__name__ for c in QuantModuleRegistry.original_class_of(module).__mro__ if issubclass(c, nn.Module))


def set_quantizer_by_cfg(model: nn.Module, config: Union[QuantizeConfig, dict]) -> None:
    """Apply a config's rules to every quantizer; a list config makes a SequentialQuantizer, a single
    one a TensorQuantizer (members of a GroupedQuantizer each get it)."""
    cfg = QuantizeConfig.from_any(config)
    for name, parent, attr, q in list(iter_quantizers(model)):
        attrs, enable = cfg.resolve(name, _class_names(parent))
        if attrs is not None:
            if isinstance(q, GroupedQuantizer):
                for i, m in enumerate(q):
                    if fits(m, attrs):
                        m.set_from_attribute_config(attrs)
                    else:
                        q[i] = build_quantizer(attrs)
            elif fits(q, attrs):
                q.set_from_attribute_config(attrs)
            else:
                setattr(parent, attr, build_quantizer(attrs))
                q = getattr(parent, attr)
        if enable is not None:
            q.enable() if enable else q.disable()
        for leaf_name, leaf in leaves_of(name, q):
            leaf._qname = leaf_name


def _set_enabled(model: nn.Module, pattern: str, enabled: bool) -> int:
    count = 0
    for name, _, _, q in iter_quantizers(model):
        if fnmatch.fnmatchcase(name, pattern):
            q.enable() if enabled else q.disable()
            count += 1
    return count


def enable_quantizer(model: nn.Module, pattern: str) -> int:
    """Enable the quantizers whose full name matches the wildcard ``pattern``; returns how many."""
    return _set_enabled(model, pattern, True)


def disable_quantizer(model: nn.Module, pattern: str) -> int:
    """Disable the quantizers whose full name matches the wildcard ``pattern``; returns how many."""
    return _set_enabled(model, pattern, False)


def clear_weight_cache(model: nn.Module) -> int:
    """Drop every cached fake-quantized weight; returns how many. Needed only after writes that bypass
    the version counter the cache keys on (``weight.data.mul_(...)``); ordinary in-place writes,
    optimizer steps and ``load_state_dict`` invalidate it by themselves."""
    n = 0
    for _, m in quant_modules(model):
        cache = m.__dict__.get("_weight_cache")
        if cache:
            n += len(cache)
            cache.clear()
    return n


# ------------------------------------------------------------------------------------ calibration


def quantize(model: nn.Module, config: Union[QuantizeConfig, dict], forward_loop: Optional[ForwardLoop] = None, parallel_state=None, sequential: Union[bool, dict, "SequentialOptions", None] = None) -> nn.Module:
    """Convert ``model`` and calibrate it with ``config``'s algorithm on ``forward_loop(model)``.

    Calling it again with another config re-configures and recalibrates. Returns the model.
    ``sequential`` (True, a dict or ``quantlib.calib.sequential.SequentialOptions``): calibrate one decoder layer at a time.
    """
    cfg = QuantizeConfig.from_any(config)
    model = convert(model)
    set_quantizer_by_cfg(model, cfg)
    check_kv_reach(model, cfg)
    model._quantlib_config = cfg
    if cfg.algorithm_name is not None:
        calibrate(model, cfg.algorithm, forward_loop, parallel_state, sequential=sequential)
    return model


def calibrate(model: nn.Module, algorithm: Union[str, dict, None] = "max", forward_loop: Optional[ForwardLoop] = None, parallel_state=None, sequential: Union[bool, dict, "SequentialOptions", None] = None) -> nn.Module:
    """(Re)calibrate an already converted model: weight amax from the weights, activation amax from
    ``forward_loop(model)`` (None: weights only; activations then use their dynamic amax). Amax are then
    synced over ``parallel_state`` (None: discovered, see ``quantlib.distributed.discover_parallel_state``).
    ``sequential``: calibrate one decoder layer at a time (``quantlib.calib.sequential``)."""
    method = algorithm.get("method") if isinstance(algorithm, dict) else algorithm
    if method is None:
        return model
    if method != "max":
        raise ValueError(f"calibrate: algorithm {method!r} is not available (use 'max')")
    cfg: Optional[QuantizeConfig] = getattr(model, "_quantlib_config", None)
    if parallel_state is None:
        from .distributed import discover_parallel_state

        parallel_state = discover_parallel_state()
    local_error = None
    try:
        if sequential:
            from .calib.sequential import calibrate_sequential

            calibrate_sequential(model, forward_loop, sequential, cfg.expert_input_policy if cfg else "max_of_peers")
        else:
            for _, m in quant_modules(model):
                m.calibrate_weights()
            if forward_loop is not None:
                _calibrate_activations(model, forward_loop, cfg.expert_input_policy if cfg else "max_of_peers")
    except CalibrationError as exc:
        if parallel_state is None:
            raise
        local_error = exc  # raised by the sync on every rank together: alone, this rank would hang the others
    if parallel_state is not None:
        from .distributed import sync_amax

        sync_amax(model, parallel_state, local_error=local_error)
    return model


def _calibrate_activations(model: nn.Module, forward_loop: ForwardLoop, expert_policy: str) -> None:
    weight_ids = _weight_quantizer_ids(model)
    leaves = list(iter_leaf_quantizers(model))
    active = [(n, q) for n, q in leaves if id(q) not in weight_ids and q.is_enabled and q.needs_calibration]
    enabled = [q for _, q in leaves if q.is_enabled]
    for _, q in active:
        q.reset_amax()
        q.enable_calib()
    for q in enabled:
        q.disable_quant()  # as ModelOpt: activations are calibrated on the unquantized model
    try:
        with torch.no_grad(), _progress(model):
            forward_loop(model)
    finally:
        for _, q in active:
            q.disable_calib()
        for q in enabled:
            q.enable_quant()
    for _, q in active:
        q.load_calib_amax()
    tokens_per_expert_report(model)
    missing = [(n, q) for n, q in active if q.amax is None]
    if missing:
        _fill_missing(model, missing, expert_policy)


def tokens_per_expert_report(model: nn.Module, warn: bool = True) -> dict[str, list[int]]:
    """Tokens each expert received in the last calibration, by module name, from every QuantModule that
    counts them (``tokens_per_expert``); logged at the end of calibration, experts with none as warnings
    (their weight amax still comes from their own weights)."""
    report = {}
    for name, m in quant_modules(model):
        counts = getattr(m, "tokens_per_expert", None)
        if isinstance(counts, torch.Tensor):
            report[name] = counts.tolist()
            idle = [e for e, c in enumerate(report[name]) if c == 0]
            if warn and idle:
                _log.warning("%s: no calibration tokens reached expert(s) %s of %d", name, idle, len(report[name]))
            else:
                _log.info("%s: tokens per expert %s", name, report[name])
    return report


def expert_group_key(name: str) -> Optional[str]:
    """Name with the expert index replaced by ``*`` (the last numeric path component), or None."""
    parts = name.split(".")
    for i in range(len(parts) - 1, -1, -1):
        if parts[i].isdigit():
            return ".".join(parts[:i] + ["*"] + parts[i + 1 :])
    return None


def _fill_missing(model: nn.Module, missing: list[tuple[str, TensorQuantizer]], policy: str) -> None:
    """Quantizers the forward loop never reached: experts follow the policy, anything else raises."""
    experts = {id(leaf) for _, m in quant_modules(model) if m.is_expert for qn in m.quantizer_names for _, leaf in leaves_of(qn, getattr(m, qn))}
    # a module with grouped weights holds all local experts of its layer: its quantizers have no local
    # peers (expert_group_key of their names would replace the layer index instead)
    alone = {id(getattr(m, qn)) for _, m in quant_modules(model) if m.is_expert and any(isinstance(getattr(m, w, None), GroupedQuantizer) for w in m.weight_quantizer_names) for qn in m.quantizer_names}
    not_experts = [n for n, q in missing if id(q) not in experts]
    if not_experts:
        raise CalibrationError(f"calibration data never reached {len(not_experts)} quantizer(s): {not_experts[:5]}; feed data that reaches them or disable them in the config")
    if policy == "skip":
        for n, _ in missing:
            _log.warning("%s: no tokens reached this expert; its input quantizer uses a dynamic amax", n)
        return
    if policy == "error":
        raise CalibrationError(f"no tokens reached {len(missing)} expert input quantizer(s): {[n for n, _ in missing][:5]} (expert_input_policy='error')")
    peers: dict[str, list[torch.Tensor]] = {}
    for n, q in iter_leaf_quantizers(model):
        if id(q) in experts and id(q) not in alone and q.amax is not None:
            peers.setdefault(expert_group_key(n), []).append(q.amax)
    for n, q in missing:
        found = None if id(q) in alone else peers.get(expert_group_key(n))
        if found:
            q.amax = torch.stack([a.reshape(found[0].shape) for a in found]).amax(dim=0)
            _log.info("%s: no tokens reached this expert; input amax set to the max of %d peers", n, len(found))
        # else: left unset; the distributed sync fills it from the other ranks' experts or raises


class _progress:
    """A progress bar over forward calls of the root module, shown only if calibration takes a while."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model

    def __enter__(self):
        from tqdm.auto import tqdm

        self.bar = tqdm(desc="quantlib calibration", unit="batch", delay=2.0, leave=False, file=sys.stderr)
        self.handle = self.model.register_forward_hook(self._tick)
        return self

    def _tick(self, *_) -> None:
        self.bar.update(1)  # returns None: a forward hook's return value would replace the output

    def __exit__(self, *exc):
        self.handle.remove()
        self.bar.close()
        return False


# ------------------------------------------------------------------------------------ summary


def _describe(q: TensorQuantizer) -> tuple[str, str, str, str]:
    if not q.is_enabled:
        return "disabled", "", "", ""
    s = q.spec
    fmt = f"int{s.num_bits}" if s.kind.value == "int" else s.kind.value.replace("_", "-")
    if s.element:
        fmt += f" e{s.element[0]}m{s.element[1]}"
    gran = "per-tensor"
    if q.axis is not None:
        gran = f"axis={q.axis}"
    if s.block is not None:
        gran = "block " + "x".join(map(str, s.block))
    if s.dynamic:
        gran += " dynamic" if s.block is not None else "per-token dynamic"
    amax = q.amax
    if amax is None:
        return fmt, gran, "-", "dynamic" if not q.needs_calibration else "uncalibrated"
    if amax.device.type == "meta":
        return fmt, gran, str(tuple(amax.shape)), "meta"
    rng = f"{amax.min().item():.4g}" if amax.numel() == 1 else f"{amax.min().item():.4g}..{amax.max().item():.4g}"
    return fmt, gran, str(tuple(amax.shape)), rng


def quant_summary(model: nn.Module) -> str:
    """A table of every quantizer: name, format, granularity, amax shape and range."""
    rows = [("quantizer", "format", "granularity", "amax shape", "amax")]
    for name, q in iter_leaf_quantizers(model):
        rows.append((name,) + _describe(q))
    widths = [max(len(r[i]) for r in rows) for i in range(5)]
    out = io.StringIO()
    for j, r in enumerate(rows):
        out.write("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() + "\n")
        if j == 0:
            out.write("  ".join("-" * w for w in widths) + "\n")
    enabled = sum(1 for _, q in iter_leaf_quantizers(model) if q.is_enabled)
    out.write(f"{len(rows) - 1} quantizers, {enabled} enabled\n")
    return out.getvalue()


def print_quant_summary(model: nn.Module, file=None) -> None:
    """Print :func:`quant_summary`."""
    print(quant_summary(model), end="", file=file or sys.stdout)


__all__ = ["calibrate", "clear_weight_cache", "convert", "disable_quantizer", "enable_quantizer", "iter_quantizers", "print_quant_summary", "quant_summary", "quantize", "set_quantizer_by_cfg"]
