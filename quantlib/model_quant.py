"""quantize(), calibrate(), wildcard enable/disable and the summary table."""

from __future__ import annotations

import fnmatch
import io
import logging
import sys
from typing import TYPE_CHECKING, Any, Callable, Optional, Union

from torch import nn

from .calib import awq_clip, awq_lite, gptq, mse, smoothquant  # noqa: F401  (register their runners)
from .calib.activations import max_calibrate, tokens_per_expert_report  # noqa: F401  (tokens_per_expert_report re-exported)
from .calib.registry import CalibContext, register_runner, runner
from .calib_config import AlgorithmConfig
from .collectives import StatSync
from .config import ConfigError, QuantizeConfig, algorithm_config, turns_on
from .coverage import report_coverage
from .kv.presets import check_kv_reach
from .nn import bypass
from .nn.containers import GroupedQuantizer, QuantizerContainer, build_quantizer, fits
from .nn.modules.modelopt_only import MODELOPT_ONLY
from .nn.quant_module import QuantModule, QuantModuleRegistry
from .nn.tensor_quantizer import TensorQuantizer
from .rollback import atomic, check_weight_quantizers
from .traversal import (  # noqa: F401  (re-exported)
    applied_config,
    class_names,
    clear_weight_cache,
    expert_group_key,
    iter_leaf_quantizers,
    iter_quantizers,
    leaves_of,
    quant_modules,
    set_applied_config,
)

ForwardLoop = Callable[[nn.Module], Any]
if TYPE_CHECKING:
    from .calib.sequential import SequentialOptions
_log = logging.getLogger("quantlib")


# ------------------------------------------------------------------------------------ conversion


def convert(model: nn.Module) -> nn.Module:
    """Swap every module of a registered class for its quantized class (in place; returns the model,
    which is new only if the root itself was swapped). Parameters are shared, never copied. Modules that may
    bypass a quantized child in training are hooked to refuse it (:mod:`quantlib.nn.bypass`)."""
    QuantModuleRegistry.find()
    model = _convert(model, {})
    bypass.guard(model)  # modules whose training forward may read a quantized child's weight without calling it
    return model


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


def set_quantizer_by_cfg(model: nn.Module, config: Union[QuantizeConfig, dict]) -> None:
    """Apply a config's rules to every quantizer; a list config makes a SequentialQuantizer, a single
    one a TensorQuantizer (members of a GroupedQuantizer each get it). A parsed config is used as is; it
    is recorded on the converted modules (``QuantModule.applied_config``) for later calls to read."""
    cfg = config if isinstance(config, QuantizeConfig) else QuantizeConfig.from_any(config)
    set_applied_config(model, cfg)
    for name, parent, attr, q in list(iter_quantizers(model)):
        attrs, enable = cfg.resolve(name, class_names(parent))
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


def warn_modelopt_only(model: nn.Module, cfg: QuantizeConfig) -> None:
    """Warn, naming the modules, where ``cfg`` would enable quantizers of modules that ModelOpt converts
    and quantlib does not (``quantlib.nn.modules.modelopt_only``): there the two libraries differ."""
    found: dict[str, list[str]] = {}
    for name, m in model.named_modules():
        qnames = MODELOPT_ONLY.get(type(m), ())
        if qnames and not QuantModuleRegistry.is_registered(type(m)):
            if any(turns_on(*cfg.resolve(f"{name}.{qn}" if name else qn, class_names(m))) for qn in qnames):
                found.setdefault(type(m).__name__, []).append(name)
    for cls, names in found.items():
        _log.warning("%d nn.%s module(s) %s stay in full precision: ModelOpt would quantize them with this config, quantlib does not "
                     "convert nn.%s", len(names), cls, names[:5], cls)


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


# ------------------------------------------------------------------------------------ calibration


@atomic  # a failed quantize() leaves the model exactly as it was
def quantize(model: nn.Module, config: Union[QuantizeConfig, dict], forward_loop: Optional[ForwardLoop] = None, parallel_state=None,
             sequential: Union[bool, dict, "SequentialOptions", None] = None) -> nn.Module:
    """Convert ``model`` and calibrate it with ``config``'s algorithm on ``forward_loop(model)``.

    Calling it again with another config re-configures and recalibrates. Returns the model.
    ``sequential`` (True, a dict or ``quantlib.calib.sequential.SequentialOptions``): calibrate one decoder layer at a time.
    """
    cfg = QuantizeConfig.from_any(config)  # the one parse: typed objects flow down from here
    options = _sequential_options(sequential)
    model = convert(model)
    set_quantizer_by_cfg(model, cfg)
    warn_modelopt_only(model, cfg)
    check_weight_quantizers(model)
    if cfg.algorithm_config is None:
        check_bias_support(model, None)  # else _calibrate checks, knowing the layout
    check_kv_reach(model, cfg)
    for _, leaf in iter_leaf_quantizers(model):
        leaf.pre_quant_scale = None  # a new recipe starts from the model's own function
    if cfg.algorithm_config is not None:
        _calibrate(model, cfg.algorithm_config, cfg, forward_loop, parallel_state, options)  # quantize's own rollback covers it
    report_coverage(model, cfg)
    return model


@atomic  # a failed or interrupted calibrate() leaves every quantizer (amax, pre_quant_scale) as it was
def calibrate(model: nn.Module, algorithm: Union[str, dict, AlgorithmConfig, None] = "max", forward_loop: Optional[ForwardLoop] = None,
              parallel_state=None, sequential: Union[bool, dict, "SequentialOptions", None] = None) -> nn.Module:
    """(Re)calibrate an already converted model with ``algorithm`` (a name or ModelOpt's dict form, see
    ``quantlib.calib_config``; None: nothing). ``max``: weight amax from the weights, activation amax
    from ``forward_loop(model)`` (None: weights only; activations then use their dynamic amax); the
    other algorithms start from it. Amax are then synced over ``parallel_state`` (None: discovered, see
    ``quantlib.distributed.discover_parallel_state``). ``sequential``: calibrate one decoder layer at a
    time, with any algorithm (``quantlib.calib.sequential``). All or nothing: where it raises (KeyboardInterrupt
    too), the model is put back as it was on entry. The model-level settings (``expert_input_policy``,
    ``sync_expert_weight_amax``) are those of the config last applied to the model."""
    algo = algorithm_config(algorithm)
    if algo is None:
        return model
    options = _sequential_options(sequential)
    return _calibrate(model, algo, applied_config(model), forward_loop, parallel_state, options)


def _sequential_options(sequential: Union[bool, dict, "SequentialOptions", None]) -> Optional["SequentialOptions"]:
    """The parsed ``sequential`` argument (None: calibrate in one pass)."""
    if not sequential:
        return None
    from .calib.sequential import SequentialOptions

    return SequentialOptions.from_any(sequential)


def _calibrate(
    model: nn.Module,
    algo: AlgorithmConfig,
    cfg: Optional[QuantizeConfig],
    forward_loop: Optional[ForwardLoop],
    parallel_state,
    options: Optional["SequentialOptions"],
) -> nn.Module:
    """:func:`calibrate` with everything parsed: ``cfg`` (None: the defaults) gives the model-level settings."""
    policy = cfg.expert_input_policy if cfg is not None else "max_of_peers"
    share_weights = cfg is not None and cfg.sync_expert_weight_amax
    if algo.mutates_weights and share_weights:  # the closing sync would move its weights off the grid
        why = "rounds each expert's weight with its own amax, which sync_expert_weight_amax=True then replaces"
        raise ConfigError(f"algorithm {algo.method!r} {why}; set it to False")
    if parallel_state is None:
        from .distributed import discover_parallel_state

        parallel_state = discover_parallel_state()
    check_bias_support(model, algo.method, parallel_state, sequential=options is not None)
    ctx = CalibContext(
        forward_loop, lambda m: max_calibrate(m, forward_loop, policy), policy,
        tensor_parallel=_tensor_parallel(parallel_state), sync=StatSync(parallel_state), config=cfg,
    )
    local_error = None
    try:
        if options is not None:
            from .calib.sequential import calibrate_sequential

            calibrate_sequential(model, algo, ctx, options)
        else:
            runner(algo.method)(model, algo, ctx)
    except Exception as exc:  # a bad batch or OOM too: raised alone, it would leave the other ranks in the sync
        if parallel_state is None:
            raise
        local_error = exc  # sync_amax makes every rank raise; this one re-raises exc
    # one process has no group to reduce over, but a layer's local experts still share one weight amax
    local_experts = parallel_state is None and share_weights
    if (parallel_state is not None or local_experts) and algo.distributed_sync:
        from .distributed import ParallelState, sync_amax

        state = parallel_state or ParallelState()
        sync_amax(model, state, local_error=local_error, expert_input_policy=policy, sync_expert_weight_amax=share_weights)
    elif local_error is not None:
        raise local_error
    return model


def check_bias_support(model: nn.Module, algorithm: Optional[str], parallel_state=None, sequential: bool = False) -> None:
    """Raise ConfigError, naming the quantizer and its ``bias``, where an enabled quantizer has a bias
    that quantlib cannot calibrate or keep: outside a module's ``affine_quantizer_names`` (transformers
    attention's q/k/v), inside a container, with an algorithm other than max, layer by layer (the
    sequential driver's resume file keeps amax only), or over data parallel ranks (the running mean is
    not reduced across them)."""
    for name, parent, attr, q in iter_quantizers(model):
        for leaf_name, leaf in leaves_of(name, q):
            bias = leaf.attrs.bias
            if bias is None or not leaf.is_enabled:
                continue
            where = f"{leaf_name} ({type(parent).__name__}): bias={bias}"
            if leaf is not q:
                raise ConfigError(f"{where}: a quantizer with a bias cannot be a member of a list config (SequentialQuantizer) or of "
                                  "grouped experts")
            if attr not in getattr(parent, "affine_quantizer_names", ()):
                raise ConfigError(
                    f"{where}: affine quantization is implemented for the q/k/v bmm quantizers of transformers attention only "
                    "(Megatron's DotProductAttention sees [seq, batch, heads, dim], where the preset's axes -2/-4 would average over heads "
                    "and seq)"
                )
            if algorithm is not None and algorithm != "max":
                raise ConfigError(f"{where}: algorithm {algorithm!r}: a bias is calibrated by algorithm 'max' only")
            if sequential:
                raise ConfigError(f"{where}: sequential (layer-by-layer) calibration does not keep a bias; calibrate in one pass")
            if parallel_state is not None and parallel_state.size("data") > 1:
                raise ConfigError(f"{where}: calibration over {parallel_state.size('data')} data-parallel ranks: the bias is not reduced "
                                  "across them; calibrate on one rank")


def _tensor_parallel(parallel_state) -> bool:
    """Whether a layout (None: one rank) splits linears over several ranks."""
    return parallel_state is not None and (parallel_state.size("tensor") > 1 or parallel_state.size("expert_tensor") > 1)


@register_runner("max")
def _run_max(model: nn.Module, algo: AlgorithmConfig, ctx: CalibContext) -> None:
    ctx.max_calibrate(model)


        # else: left unset; the distributed sync fills it from the other ranks' experts or raises


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
    if q.attrs.bias is not None:  # affine: a bias averaged over these axes
        gran += f" bias over {q.attrs.bias_axes}"
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


__all__ = [
    "applied_config", "calibrate", "clear_weight_cache", "convert", "disable_quantizer", "enable_quantizer",
    "iter_quantizers", "print_quant_summary", "quant_summary", "quantize", "set_quantizer_by_cfg",
]
