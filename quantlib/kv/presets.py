"""KV-cache quantization: ModelOpt's KV presets, merging them into a model config, and the check that
every attention module of the model can take them.

The quantizers are ``k_bmm_quantizer`` and ``v_bmm_quantizer`` (and ``q_bmm_quantizer``, off in every
preset) on the attention module, as ModelOpt names them; they fake-quantize the key and value states
the attention kernel reads (after RoPE and the cache update), which is what an engine stores in its
KV cache. The plugins that insert them: :mod:`quantlib.plugins.hf_attention` (transformers) and
:mod:`quantlib.plugins.megatron_attention` (Megatron-Core's ``DotProductAttention``).

The presets hold only the KV rules, like ModelOpt 0.47's: merge one into a weight/activation preset
with :func:`merge_kv_config` (the KV rules are appended, so they win), or use it alone (every other
quantizer is then disabled by the merge's first rule).
"""

from __future__ import annotations

import copy
import fnmatch
from typing import Optional, Union

from torch import nn

from ..config import ConfigError, QuantizeConfig, turns_on
from ..traversal import class_names

#: the quantizers a KV preset configures, by their attribute name on the attention module
KV_QUANTIZER_NAMES: tuple[str, ...] = ("k_bmm_quantizer", "v_bmm_quantizer")
#: the quantizers of the attention's inputs (``q_bmm_quantizer`` quantizes the query, off by default)
QKV_QUANTIZER_NAMES: tuple[str, ...] = ("q_bmm_quantizer",) + KV_QUANTIZER_NAMES
#: the quantizer of the attention probabilities (the softmax output before the P @ V matmul), off by
#: default; see :mod:`quantlib.plugins.attention_probs`
PROBS_QUANTIZER_NAME = "p_bmm_quantizer"
#: every quantizer the attention plugins add
ATTENTION_QUANTIZER_NAMES: tuple[str, ...] = QKV_QUANTIZER_NAMES + (PROBS_QUANTIZER_NAME,)

_KV = "*[kv]_bmm_quantizer"
_NVFP4_KV = {"num_bits": (2, 1), "effective_bits": 4.5, "block_sizes": {-1: 16, "type": "dynamic", "scale_bits": (4, 3)}}

#: FP8 E4M3 keys and values, one static per-tensor amax per quantizer (max calibration)
FP8_KV_CFG: dict = {"quant_cfg": [{"quantizer_name": _KV, "cfg": {"num_bits": (4, 3), "axis": None}}]}
#: ModelOpt's affine FP8 KV: a static bias (the mean over batch and sequence, one per head and channel)
#: subtracted before the FP8 quantization and added back (see quantlib.nn.bias_collector); transformers attention only.
FP8_AFFINE_KV_CFG: dict = {
    "quant_cfg": [
        {"quantizer_name": _KV, "cfg": {"num_bits": (4, 3), "axis": None}},
        {"quantizer_name": _KV, "cfg": {"num_bits": (4, 3), "axis": None, "bias": {-2: None, -4: None, "type": "static"}}},
    ]
}
#: NVFP4 keys and values: blocks of 16 along the head dim, E4M3 block scales, a calibrated global amax
NVFP4_KV_CFG: dict = {"quant_cfg": [{"quantizer_name": _KV, "cfg": dict(_NVFP4_KV)}]}

KV_PRESETS: dict[str, dict] = {"FP8_KV_CFG": FP8_KV_CFG, "FP8_AFFINE_KV_CFG": FP8_AFFINE_KV_CFG, "NVFP4_KV_CFG": NVFP4_KV_CFG}


def _kv_entries(kv_config: Union[dict, list]) -> list[dict]:
    entries = kv_config.get("quant_cfg") if isinstance(kv_config, dict) else kv_config
    if not isinstance(entries, (list, tuple)):
        raise ConfigError("merge_kv_config: kv_config must be a KV preset (a dict with a list 'quant_cfg') or its list of rules, got "
                          f"{type(entries).__name__}")
    return copy.deepcopy(list(entries))


def merge_kv_config(config: Union[dict, QuantizeConfig, None], kv_config: Union[dict, list]) -> dict:
    """``config`` with the rules of ``kv_config`` (a KV preset or its rule list) appended, as ModelOpt's
    ``update_quant_cfg_with_kv_cache_quant`` does; ``config=None`` quantizes only the KV cache. Returns a
    new list-form config dict (the inputs are not modified); the algorithm defaults to ``"max"``."""
    kv = _kv_entries(kv_config)
    if config is None:
        base = {"quant_cfg": [{"quantizer_name": "*", "enable": False}], "algorithm": "max"}
    else:
        base = QuantizeConfig.from_any(copy.deepcopy(config) if isinstance(config, dict) else config).to_dict()
        base["quant_cfg"] = [{k: v for k, v in e.items() if v is not None} for e in base["quant_cfg"]]
    base["quant_cfg"] = base["quant_cfg"] + kv
    if not base.get("algorithm"):
        base["algorithm"] = "max"
    QuantizeConfig.from_any(base)  # validate the merged rules now, naming the bad one
    return base


# ---------------------------------------------------------------------------------- reach check

# a rule enabling p_bmm_quantizer needs a reachable attention as much as a KV rule does
_PROBES = {"kv": ("m.k_bmm_quantizer", "m.v_bmm_quantizer", "m.p_bmm_quantizer"), "linear": ("m.input_quantizer", "m.weight_quantizer",
                                                                                             "m.output_quantizer")}


def kv_rules(config: QuantizeConfig) -> list[str]:
    """Patterns of ``config``'s rules that enable attention quantizers specifically (they match a k/v/p
    bmm quantizer name but no linear's quantizer name; a catch-all ``*`` is not a KV rule)."""
    found = []
    for e in config.quant_cfg:
        if not turns_on(e.attrs, e.enable):
            continue
        if any(fnmatch.fnmatchcase(p, e.pattern) for p in _PROBES["kv"]) and not any(fnmatch.fnmatchcase(p, e.pattern)
                                                                                     for p in _PROBES["linear"]):
            found.append(e.pattern)
    return found


def _looks_like_attention(module: nn.Module) -> bool:
    from ..nn.quant_module import QuantModuleRegistry

    cls = QuantModuleRegistry.original_class_of(module)
    children = dict(module.named_children())
    return cls.__name__.endswith("Attention") or ("k_proj" in children and "v_proj" in children)


def _would_enable(config: QuantizeConfig, name: str, module: nn.Module) -> bool:
    return turns_on(*config.resolve(name, class_names(module)))


def unreached_attention(model: nn.Module, config: Optional[QuantizeConfig] = None) -> list[str]:
    """Names (with class) of the attention-like modules of ``model`` (class name ending in ``Attention``,
    or children ``k_proj`` and ``v_proj``) that hold no KV quantizer themselves and have no ancestor or
    descendant that does: the attention quantlib cannot reach. With ``config``, only those where it would
    enable a ``k_bmm_quantizer``, ``v_bmm_quantizer`` or ``p_bmm_quantizer`` (so a disabled vision tower does not count)."""
    reached = [name for name, m in model.named_modules() if all(hasattr(m, q) for q in KV_QUANTIZER_NAMES)]
    missing = []
    for name, m in model.named_modules():
        if not _looks_like_attention(m):
            continue
        if any(r == name or r.startswith(name + ".") or name.startswith(r + ".") or r == "" or name == "" for r in reached):
            continue
        if config is not None and not any(_would_enable(config, f"{name}.{q}" if name else q, m) for q in KV_QUANTIZER_NAMES
                                          + (PROBS_QUANTIZER_NAME,)):
            continue
        missing.append(f"{name or '<root>'} ({type(m).__name__})")
    return missing


def check_kv_reach(model: nn.Module, config: Union[QuantizeConfig, dict]) -> None:
    """Raise :class:`ConfigError` if ``config`` enables KV quantizers but some attention module of
    ``model`` where they would be enabled has none (named in the message), or the model has no KV
    quantizer at all: a KV preset is never silently skipped."""
    cfg = config if isinstance(config, QuantizeConfig) else QuantizeConfig.from_any(config)
    rules = kv_rules(cfg)
    if not rules:
        return
    missing = unreached_attention(model, cfg)
    if missing:
        raise ConfigError(
            f"KV-cache / attention rule(s) {rules} cannot reach the attention of {len(missing)} module(s): {missing[:5]}; quantlib inserts "
            "k/v/p quantizers "
            "into transformers attention classes that call the attention interface and into Megatron-Core's local DotProductAttention only"
        )
    if not any(hasattr(m, q) for m in model.modules() for q in KV_QUANTIZER_NAMES):
        raise ConfigError(f"KV-cache / attention rule(s) {rules}: the model has no attention module with k/v/p quantizers "
                          f"({type(model).__name__})")


__all__ = [
    "ATTENTION_QUANTIZER_NAMES",
    "FP8_AFFINE_KV_CFG",
    "FP8_KV_CFG",
    "KV_PRESETS",
    "KV_QUANTIZER_NAMES",
    "NVFP4_KV_CFG",
    "PROBS_QUANTIZER_NAME",
    "QKV_QUANTIZER_NAMES",
    "check_kv_reach",
    "kv_rules",
    "merge_kv_config",
    "unreached_attention",
]
