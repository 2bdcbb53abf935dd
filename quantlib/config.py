"""Quantizer attribute configs, the wildcard config schema (ModelOpt's dict and list forms) and presets.

A :class:`QuantizerAttributeConfig` is validated when it is built and resolves to one typed
:class:`~quantlib.formats.FormatSpec`; nothing downstream recognises a format from dict fields.
"""

from __future__ import annotations

import copy
import fnmatch
from dataclasses import dataclass, field, fields
from typing import Any, Callable, Optional, Union

from .calib_config import AlgorithmConfig, parse_algorithm
from .fields import ConfigError, parse_fields
from .formats import FLOAT_FORMATS, FormatSpec, Kind, Rounding
from .formats.fp6 import FP6_FORMATS
from .formats.spec import MIN_EPS
from .kernels.backends import as_preference

# Keys ModelOpt documents that carry no meaning for fake quantization here: accepted, ignored.
_IGNORED_ATTR_KEYS = frozenset({"effective_bits", "trt_high_precision_dtype"})
_BLOCK_META_KEYS = frozenset({"type", "scale_bits", "scale_block_sizes"})


def _as_bits(value: Any, key: str = "num_bits") -> Union[int, tuple[int, int]]:
    if isinstance(value, bool):
        raise ConfigError(f"{key} must be an int or an (E, M) pair, got {value!r}")
    if isinstance(value, int):
        if not 1 <= value <= 16:
            raise ConfigError(f"{key}={value}: integer formats take 1..16 bits")
        return value
    if isinstance(value, (tuple, list)) and len(value) == 2 and all(isinstance(v, int) and not isinstance(v, bool) for v in value):
        return (int(value[0]), int(value[1]))
    raise ConfigError(f"{key} must be an int or an (E, M) pair, got {value!r}")


def _as_axis(value: Any) -> Optional[tuple[int, ...]]:
    if value is None:
        return None
    if isinstance(value, int) and not isinstance(value, bool):
        return (value,)
    if isinstance(value, (tuple, list)) and all(isinstance(v, int) and not isinstance(v, bool) for v in value):
        if not value:
            raise ConfigError(f"axis={value!r}: an empty tuple keeps no axis; use axis=None for one amax per tensor")
        if len(set(value)) != len(value):
            raise ConfigError(f"axis={value!r}: an axis is listed twice")
        return tuple(value)
    raise ConfigError(f"axis must be None, an int or a tuple of ints, got {value!r}")


_BIAS_META_KEYS = frozenset({"type", "method"})
_BIAS_EXAMPLE = "{-2: None, -4: None, 'type': 'static'}"


def _as_bias(value: Any) -> Optional[dict]:
    """ModelOpt's ``bias`` (affine quantization): a dict whose int keys are the axes the bias is averaged
    over (values None), plus ``"type"`` and ``"method"``; returns a normalised copy or None."""
    if value is None:
        return None
    if not isinstance(value, dict):
        raise ConfigError(f"bias must be a dict such as {_BIAS_EXAMPLE} or None, got {value!r}")
    for k, v in value.items():
        if k in _BIAS_META_KEYS:
            continue
        if not isinstance(k, int) or isinstance(k, bool):
            raise ConfigError(f"bias: unknown key {k!r} (value {v!r}); keys are the axes to average over (ints), 'type' and 'method'")
        if v is not None:
            raise ConfigError(f"bias[{k}]={v!r}: an axis entry takes None (the bias is averaged over the whole axis)")
    kind, method = value.get("type", "static"), value.get("method", "mean")
    if kind not in ("static", "dynamic"):
        raise ConfigError(f"bias['type']={kind!r}: expected 'static' or 'dynamic'")
    if kind == "dynamic":
        raise ConfigError("bias['type']='dynamic': only a static (calibrated) bias is implemented")
    if method not in ("mean", "max_min"):
        raise ConfigError(f"bias['method']={method!r}: expected 'mean' or 'max_min'")
    if method == "max_min":
        raise ConfigError("bias['method']='max_min': only method 'mean' (ModelOpt's default) is implemented")
    axes = sorted(k for k in value if k not in _BIAS_META_KEYS)
    if not axes:
        raise ConfigError(f"bias={value!r} names no axis to average over, e.g. {_BIAS_EXAMPLE}")
    return {**{a: None for a in axes}, "type": kind, "method": method}


#: Largest FP8-blockwise ``eps``: the floor exists so that all-zero blocks get a nonzero scale; a larger
#: one would coarsen every block whose amax is below it (1e30 turns every block into zeros, inf into NaN).
MAX_EPS = 1.0


@dataclass
class QuantizerAttributeConfig:
    """What one quantizer does, in ModelOpt's vocabulary and with ModelOpt's defaults (plus ``eps``,
    ``pow2_scale``, ``rounding``, ``backend``). Invalid values and impossible combinations raise
    :class:`ConfigError` here."""

    enable: bool = True
    num_bits: Union[int, tuple[int, int]] = 8
    axis: Optional[Union[int, tuple[int, ...]]] = None
    block_sizes: Optional[dict] = None
    unsigned: bool = False
    # ModelOpt's default: INT codes in [-2^(b-1), 2^(b-1)-1]; a ModelOpt config must mean the same here
    narrow_range: bool = False
    fake_quant: bool = True
    calibrator: str = "max"
    learn_amax: bool = False
    # ModelOpt's "type": "dynamic" takes the amax of every tensor the quantizer sees and never calibrates
    type: str = "static"
    eps: float = 1e-10  # FP8 blockwise: floor of the block amax
    pow2_scale: bool = False  # FP8 blockwise: round scales up to powers of two
    rounding: str = "rceil"  # MX: E8M0 exponent rule, see formats.Rounding
    backend: str = "auto"  # kernels backend: a KernelPreference or its name (stored as the name)
    # ModelOpt's affine quantization: a calibrated mean, subtracted before quantizing and added back after
    bias: Optional[dict] = None
    # QAT backward: True (ModelOpt 0.47's default) passes the gradient everywhere and saves nothing for
    # the backward; False zeroes it where |x| > amax (static amax), which keeps x alive until the backward
    pass_through_bwd: bool = True

    def __post_init__(self) -> None:
        self.num_bits = _as_bits(self.num_bits)
        self.axis = _as_axis(self.axis)
        for key in ("enable", "unsigned", "narrow_range", "fake_quant", "learn_amax", "pow2_scale", "pass_through_bwd"):
            if not isinstance(getattr(self, key), bool):
                raise ConfigError(f"{key} must be a bool, got {getattr(self, key)!r}")
        if not self.fake_quant:
            raise ConfigError("fake_quant=False (real quantized GEMMs) is not supported: use fake_quant=True and export codes with "
                              "quantlib.kernels")
        if self.learn_amax:
            raise ConfigError("learn_amax=True is not supported")
        if self.calibrator != "max":
            raise ConfigError(f"calibrator={self.calibrator!r}: only 'max' is available")
        if self.type not in ("static", "dynamic"):
            raise ConfigError(f"type={self.type!r}: expected 'static' or 'dynamic'")
        if self.backend is None:  # ModelOpt's default backend
            self.backend = "auto"
        self.backend = as_preference(self.backend).value  # a KernelPreference is stored as its name
        if not isinstance(self.rounding, str) or self.rounding not in {r.value for r in Rounding}:
            raise ConfigError(f"rounding={self.rounding!r}: expected 'rceil' or 'floor'")
        self.rounding = Rounding(self.rounding).value
        # eps / Q must stay a normal fp32 number, or all-zero blocks would get a zero scale
        if not (isinstance(self.eps, (int, float)) and not isinstance(self.eps, bool) and MIN_EPS <= self.eps <= MAX_EPS):
            raise ConfigError(f"eps must be a float in [{MIN_EPS:g}, {MAX_EPS:g}], got {self.eps!r}")
        self.eps = float(self.eps)
        if self.block_sizes is not None:
            if not isinstance(self.block_sizes, dict):
                raise ConfigError(f"block_sizes must be a dict such as {{-1: 128}} or None, got {self.block_sizes!r}")
            self.block_sizes = dict(self.block_sizes)
        self._spec = self._build_spec()
        self.bias = _as_bias(self.bias)
        if self.bias is not None and (self._spec.block is not None or self.is_dynamic):
            what = f"block_sizes={self.block_sizes}" if self.block_sizes is not None else "type='dynamic'"
            raise ConfigError(f"bias={self.bias} with {what}: affine quantization needs a static per-tensor or per-channel amax (FP8 or "
                              "INT without blocks)")

    @property
    def bias_axes(self) -> Optional[tuple[int, ...]]:
        """The axes the bias is averaged over (the int keys of ``bias``), None without a bias."""
        return None if self.bias is None else tuple(k for k in self.bias if isinstance(k, int))

    @classmethod
    def from_dict(cls, d: dict) -> "QuantizerAttributeConfig":
        """Build from a config dict, rejecting unknown keys by name."""
        if not isinstance(d, dict):
            raise ConfigError(f"a quantizer attribute config must be a dict, got {d!r}")
        # __post_init__ checks every value (a directly built config too), with the messages of its own rules
        return cls(**parse_fields(cls, d, "", "quantizer attribute", _IGNORED_ATTR_KEYS, check_types=False))

    def to_dict(self) -> dict:
        """Plain, ``torch.load(weights_only=True)``-safe dict of the fields."""
        return {f.name: copy.deepcopy(getattr(self, f.name)) for f in fields(self)}

    def format_spec(self) -> FormatSpec:
        """The typed format this config means."""
        return self._spec

    @property
    def is_dynamic(self) -> bool:
        """True where no calibrated amax is used at all (MX, dynamic blocks, per-token, ``type="dynamic"``)."""
        return self.type == "dynamic" or not self._spec.calibrated_amax

    # ------------------------------------------------------------------ validation -> FormatSpec
    def _parse_blocks(self) -> tuple[Optional[tuple[int, ...]], bool, Optional[tuple[int, int]], bool]:
        """(block, dynamic, scale_bits, per_token) from ``block_sizes``."""
        bs = self.block_sizes
        if bs is None:
            return None, False, None, False
        for k in bs:
            if k not in _BLOCK_META_KEYS and not (isinstance(k, int) and not isinstance(k, bool)):
                raise ConfigError(f"block_sizes: unknown key {k!r} (value {bs[k]!r})")
        kind = bs.get("type", "static")
        if kind not in ("static", "dynamic"):
            raise ConfigError(f"block_sizes['type']={kind!r}: expected 'static' or 'dynamic'")
        if self.type == "dynamic":  # as in ModelOpt, a dynamic quantizer computes every block's amax
            kind = "dynamic"
        scale_bits = bs.get("scale_bits")
        if scale_bits is not None:
            scale_bits = _as_bits(scale_bits, "block_sizes['scale_bits']")
            if scale_bits not in ((4, 3), (8, 0)):
                raise ConfigError(f"block_sizes['scale_bits']={scale_bits}: expected (4, 3) or (8, 0)")
        if bs.get("scale_block_sizes") is not None:
            raise ConfigError(f"block_sizes['scale_block_sizes']={bs['scale_block_sizes']!r}: double quantization of scales is not "
                              "supported")
        dims = {k: v for k, v in bs.items() if k not in _BLOCK_META_KEYS}
        if any(k >= 0 for k in dims):
            raise ConfigError(f"block_sizes axes must be negative (-1, -2), got {sorted(dims)}")
        if set(dims) == {-1} and dims[-1] is None:
            if kind != "dynamic" or scale_bits is not None:
                raise ConfigError(
                    f"block_sizes={bs} (one scale per row) needs type 'dynamic' (in block_sizes or as the attribute 'type') and no "
                    "scale_bits"
                )
            return None, True, None, True
        for k, v in dims.items():
            if not (isinstance(v, int) and not isinstance(v, bool) and v > 0):
                raise ConfigError(f"block_sizes[{k}]={v!r}: block sizes must be positive ints")
        if set(dims) == {-1}:
            block: tuple[int, ...] = (dims[-1],)
        elif set(dims) == {-1, -2}:
            block = (dims[-2], dims[-1])
        else:
            raise ConfigError(f"block_sizes must block axis -1 or axes -2 and -1, got axes {sorted(dims)}")
        return block, kind == "dynamic", scale_bits, False

    def _mxint_spec(self, block: Optional[tuple[int, ...]], dynamic: bool, common: dict) -> FormatSpec:
        """MXINT8: integer num_bits with E8M0 (scale_bits (8, 0)) block scales, as ModelOpt reads them."""
        if self.num_bits != 8 or self.unsigned:
            raise ConfigError(f"num_bits={self.num_bits} (unsigned={self.unsigned}) with block_sizes['scale_bits']=(8, 0): the only MX "
                              "integer format is MXINT8, num_bits=8 signed")
        if block != (32,) or not dynamic:
            raise ConfigError("MXINT8 (num_bits=8, scale_bits (8, 0)) needs block_sizes {-1: 32, 'type': 'dynamic'}, got "
                              f"{self.block_sizes}")
        return FormatSpec(Kind.MX, num_bits=8, block=block, dynamic=True, **common)

    def _build_spec(self) -> FormatSpec:
        block, dynamic, scale_bits, per_token = self._parse_blocks()
        if block is not None and self.axis is not None:
            raise ConfigError(f"axis={self.axis} together with block_sizes={self.block_sizes}: a quantizer is either per channel or per "
                              "block")
        if per_token and self.axis is not None:
            raise ConfigError(f"axis={self.axis} together with per-row dynamic block_sizes {{-1: None}}")
        common = dict(eps=self.eps, pow2=self.pow2_scale, rounding=Rounding(self.rounding))
        if isinstance(self.num_bits, int):
            if scale_bits == (8, 0):
                return self._mxint_spec(block, dynamic, common)
            if scale_bits is not None:
                raise ConfigError(f"block_sizes['scale_bits']={scale_bits} with integer num_bits={self.num_bits}: scale formats apply to "
                                  "float elements")
            if self.num_bits < 2 and not self.unsigned:
                raise ConfigError(
                    f"num_bits={self.num_bits} signed: the largest code 2^(b-1)-1 is 0 (no scale exists); use num_bits >= 2 or "
                    "unsigned=True"
                )
            return FormatSpec(Kind.INT, num_bits=self.num_bits, unsigned=self.unsigned, narrow_range=self.narrow_range, block=block,
                              dynamic=dynamic, **common)
        element = self.num_bits
        if element not in FLOAT_FORMATS:
            raise ConfigError(f"num_bits={element}: float formats are (4, 3), (5, 2), (2, 1), and (3, 2) / (2, 3) (FP6, MX only)")
        if self.unsigned:
            raise ConfigError(f"unsigned=True with float num_bits={element}")
        if scale_bits == (8, 0):
            if block != (32,) or not dynamic:
                raise ConfigError(f"MX format (scale_bits (8, 0)) needs block_sizes {{-1: 32, 'type': 'dynamic'}}, got {self.block_sizes}")
            if element == (5, 2):
                raise ConfigError(f"num_bits={element} (E5M2) with MX block_sizes is not supported: use num_bits (4, 3), (3, 2), (2, 3) or "
                                  "(2, 1), or 8 (MXINT8)")
            return FormatSpec(Kind.MX, element=element, block=block, dynamic=True, **common)
        if element in FP6_FORMATS:
            raise ConfigError(f"num_bits={element} (FP6) needs MX block_sizes {{-1: 32, 'type': 'dynamic', 'scale_bits': (8, 0)}}, got "
                              f"block_sizes={self.block_sizes}")
        if element == (2, 1):
            # NVFP4: the global amax is calibrated either way; "static" also stores the block amax
            if scale_bits != (4, 3) or block not in ((16,), (32,)):
                raise ConfigError(
                    f"num_bits={element} (FP4 E2M1) needs NVFP4 blocks {{-1: 16 (or 32), 'type': 'dynamic' (or 'static'), 'scale_bits': "
                    "(4, 3)} "
                    f"or MXFP4 blocks {{-1: 32, 'type': 'dynamic', 'scale_bits': (8, 0)}}, got block_sizes={self.block_sizes}"
                )
            return FormatSpec(Kind.NVFP4, element=element, block=block, dynamic=dynamic, **common)
        if scale_bits is not None:
            raise ConfigError(f"block_sizes['scale_bits']={scale_bits} with num_bits={element}: E4M3 block scales go with E2M1 elements "
                              "(NVFP4)")
        if block is None:
            return FormatSpec(Kind.FP8, element=element, dynamic=per_token, **common)
        return FormatSpec(Kind.FP8_BLOCK, element=element, block=block, dynamic=dynamic, **common)


def make_attribute_config(cfg: Union[dict, "QuantizerAttributeConfig"]) -> QuantizerAttributeConfig:
    return cfg if isinstance(cfg, QuantizerAttributeConfig) else QuantizerAttributeConfig.from_dict(cfg)


# ---------------------------------------------------------------------------------- QuantizeConfig


@dataclass
class QuantCfgEntry:
    """One rule: quantizers matching ``pattern`` (inside modules of class ``module_class``, if set) get
    ``attrs`` (one config, or a list: a SequentialQuantizer) and/or ``enable``."""

    pattern: str
    attrs: Optional[Union[QuantizerAttributeConfig, list[QuantizerAttributeConfig]]] = None
    enable: Optional[bool] = None
    module_class: Optional[str] = None

    def matches(self, name: str, module_class_names: tuple[str, ...] = ()) -> bool:
        if self.module_class is not None and self.module_class not in module_class_names:
            return False
        leaf = name.rsplit(".", 1)[-1]
        return fnmatch.fnmatchcase(name, self.pattern) or (self.module_class is not None and fnmatch.fnmatchcase(leaf, self.pattern))

    def to_dict(self) -> dict:
        attrs = self.attrs
        if isinstance(attrs, list):
            attrs = [a.to_dict() for a in attrs]
        elif attrs is not None:
            attrs = attrs.to_dict()
        return {"quantizer_name": self.pattern, "cfg": attrs, "enable": self.enable, "module_class": self.module_class}


def turns_on(attrs: Any, enable: Optional[bool]) -> bool:
    """Whether a rule's ``attrs`` / ``enable`` leave a quantizer on: an explicit ``enable`` wins; else
    the config's own switch, for a list (a chain) any member's, since a chain quantizes with its
    enabled members. The one test of "this rule enables" for every check that asks."""
    if enable is not None:
        return enable
    if attrs is None:
        return False
    return any(a.enable for a in attrs) if isinstance(attrs, list) else bool(attrs.enable)


def algorithm_config(value: Union[str, dict, AlgorithmConfig, None]) -> Optional[AlgorithmConfig]:
    """The typed config of an ``algorithm`` value; invalid ones raise ConfigError naming the key."""
    return parse_algorithm(value)


EXPERT_INPUT_POLICIES = ("error", "max_of_peers", "skip")

#: The version of :meth:`QuantizeConfig.to_dict`'s form (its ``"version"`` key). A dict without one
#: (ModelOpt's configs, quantlib's before versions, the configs inside older checkpoints) reads as 1.
CONFIG_VERSION = 1

#: CONFIG_MIGRATIONS[v](cfg) turns a version-v config dict into a version-(v + 1) one, as
#: ``quantlib.checkpoint.MIGRATIONS`` does for checkpoint schemas; version 1 is the first, so none yet.
CONFIG_MIGRATIONS: dict[int, Callable[[dict], dict]] = {}


def migrate_config(cfg: dict) -> dict:
    """``cfg`` (a config dict) brought to :data:`CONFIG_VERSION` through :data:`CONFIG_MIGRATIONS`, without
    its ``"version"`` key; a version this quantlib cannot read raises ConfigError naming it."""
    version = cfg.get("version", 1)
    if not isinstance(version, int) or isinstance(version, bool) or version < 1:
        raise ConfigError(f"version={version!r}: a config version is an int >= 1")
    if version > CONFIG_VERSION:
        newer = f"the config was written by a newer quantlib (this one reads config versions up to {CONFIG_VERSION})"
        raise ConfigError(f"version={version}: {newer}; upgrade quantlib")
    out = {k: v for k, v in cfg.items() if k != "version"}
    for v in range(version, CONFIG_VERSION):
        out = CONFIG_MIGRATIONS[v](out)
    return out


@dataclass
class QuantizeConfig:
    """A whole quantization recipe: ordered rules (later win) and the calibration algorithm."""

    quant_cfg: list[QuantCfgEntry] = field(default_factory=list)
    algorithm: Union[str, dict, AlgorithmConfig, None] = "max"
    expert_input_policy: str = "max_of_peers"
    sync_expert_weight_amax: bool = False

    def __post_init__(self) -> None:
        self._algorithm = algorithm_config(self.algorithm)
        if not isinstance(self.expert_input_policy, str) or self.expert_input_policy not in EXPERT_INPUT_POLICIES:
            raise ConfigError(f"expert_input_policy={self.expert_input_policy!r}: expected one of {EXPERT_INPUT_POLICIES}")
        if not isinstance(self.sync_expert_weight_amax, bool):  # bool("no") would be True
            raise ConfigError(f"sync_expert_weight_amax must be a bool, got {self.sync_expert_weight_amax!r}")

    @property
    def algorithm_name(self) -> Optional[str]:
        return None if self._algorithm is None else self._algorithm.method

    @property
    def algorithm_config(self) -> Optional[AlgorithmConfig]:
        """The typed algorithm (see ``quantlib.calib_config``), None for no calibration."""
        return self._algorithm

    @classmethod
    def from_any(cls, cfg: Union[dict, "QuantizeConfig"]) -> "QuantizeConfig":
        """Parse a ModelOpt-style config: ``{"quant_cfg": dict-form or list-form, "algorithm": ...}``."""
        if isinstance(cfg, QuantizeConfig):
            return cfg
        if not isinstance(cfg, dict):
            raise ConfigError(f"a quantize config must be a dict, got {type(cfg).__name__}")
        kwargs = parse_fields(cls, migrate_config(cfg), "", "quantize config key", check_types=False)  # __post_init__ checks the values
        if "quant_cfg" not in kwargs:
            raise ConfigError("a quantize config needs a 'quant_cfg' key")
        raw = kwargs["quant_cfg"]
        kwargs["quant_cfg"] = _parse_list_form(raw) if isinstance(raw, (list, tuple)) else _parse_dict_form(raw)
        return cls(**kwargs)

    def to_dict(self) -> dict:
        """Plain list-form dict (what :func:`from_any` reads back), safe for ``weights_only`` loads, with
        its :data:`CONFIG_VERSION`."""
        return {
            "version": CONFIG_VERSION,
            "quant_cfg": [e.to_dict() for e in self.quant_cfg],
            "algorithm": self.algorithm.to_dict() if isinstance(self.algorithm, AlgorithmConfig) else copy.deepcopy(self.algorithm),
            "expert_input_policy": self.expert_input_policy,
            "sync_expert_weight_amax": self.sync_expert_weight_amax,
        }

    def resolve(self, name: str, module_class_names: tuple[str, ...] = ()) -> tuple[Any, Optional[bool]]:
        """(attrs or None, enable or None) for quantizer ``name``: the last rule that sets each wins."""
        attrs, enable = None, None
        for e in self.quant_cfg:
            if e.matches(name, module_class_names):
                if e.attrs is not None:
                    attrs = e.attrs
                    enable = None  # a new attribute config brings its own 'enable'
                if e.enable is not None:
                    enable = e.enable
        return attrs, enable


def _entry_from_value(pattern: str, value: Any, module_class: Optional[str] = None) -> QuantCfgEntry:
    """Dict-form value: {"enable": b} toggles; any other attribute replaces the whole config."""
    where = f"quant_cfg[{pattern!r}]"
    if isinstance(value, (list, tuple)):
        if not value:
            raise ConfigError(f"{where} = []: an empty list configures no quantizer; give an attribute dict, or a list of them")
        try:
            return QuantCfgEntry(pattern, [make_attribute_config(v) for v in value], None, module_class)
        except ConfigError as exc:
            raise ConfigError(f"{where}: {exc}") from None
    if not isinstance(value, dict):
        raise ConfigError(f"{where} must be a dict or a list of dicts, got {value!r}")
    if set(value) <= {"enable"}:
        enable = value.get("enable")
        if enable is not None and not isinstance(enable, bool):
            raise ConfigError(f"{where}['enable'] must be a bool, got {enable!r}")
        return QuantCfgEntry(pattern, None, enable, module_class)
    try:
        return QuantCfgEntry(pattern, make_attribute_config(value), None, module_class)
    except ConfigError as exc:
        raise ConfigError(f"{where}: {exc}") from None


def _is_rule_value(v: Any) -> bool:
    """A dict-form rule value: an attribute dict, or a list of them (a SequentialQuantizer)."""
    return isinstance(v, dict) or (isinstance(v, (list, tuple)) and len(v) > 0 and all(isinstance(i, dict) for i in v))


def _parse_dict_form(raw: Any) -> list[QuantCfgEntry]:
    if not isinstance(raw, dict):
        raise ConfigError(f"quant_cfg must be a dict or a list, got {type(raw).__name__}")
    first, rest = [], []
    for key, value in raw.items():
        if not isinstance(key, str):
            raise ConfigError(f"quant_cfg keys must be strings, got {key!r}")
        if key == "default":  # ModelOpt's dict-form releases apply "default" before every pattern
            first.append(_entry_from_value("*", value))
        elif key.startswith("nn.") and isinstance(value, dict) and all(_is_rule_value(v) for v in value.values()):
            rest.extend(_entry_from_value(p, v, key[3:]) for p, v in value.items())
        else:
            rest.append(_entry_from_value(key, value))
    return first + rest


def _parse_list_form(raw: Any) -> list[QuantCfgEntry]:
    entries = []
    for i, item in enumerate(raw):
        if not isinstance(item, dict) or "quantizer_name" not in item:
            raise ConfigError(f"quant_cfg[{i}] must be a dict with a 'quantizer_name', got {item!r}")
        unknown = set(item) - {"quantizer_name", "cfg", "enable", "module_class", "parent_class"}
        if unknown:
            raise ConfigError(f"quant_cfg[{i}]: unknown keys {sorted(unknown)}")
        pattern, cfg, enable = item["quantizer_name"], item.get("cfg"), item.get("enable")
        module_class = item.get("module_class", item.get("parent_class"))
        for key, value in (("quantizer_name", pattern), ("module_class", module_class)):
            if not isinstance(value, str) and (key == "quantizer_name" or value is not None):
                raise ConfigError(f"quant_cfg[{i}]: '{key}' must be a string, got {value!r}")
        if isinstance(cfg, (list, tuple)) and not cfg:
            raise ConfigError(f"quant_cfg[{i}] ({pattern!r}): 'cfg' = []: an empty list configures no quantizer")
        if isinstance(module_class, str) and module_class.startswith("nn."):
            module_class = module_class[3:]
        if enable is not None and not isinstance(enable, bool):
            raise ConfigError(f"quant_cfg[{i}] ({pattern!r}): 'enable' must be a bool, got {enable!r}")
        try:
            attrs = None
            if isinstance(cfg, (list, tuple)):
                attrs = [make_attribute_config(c) for c in cfg]
            elif cfg is not None:
                attrs = make_attribute_config(cfg)
        except ConfigError as exc:
            raise ConfigError(f"quant_cfg[{i}] ({pattern!r}): {exc}") from None
        entries.append(QuantCfgEntry(pattern, attrs, enable, module_class))
    return entries


# ---------------------------------------------------------------------------------- presets
# The presets live in quantlib/presets.py (plain dicts, no dependency on this module); re-exported here
# because ModelOpt users import them from the config module.
