"""The calibration algorithms' typed configs (ModelOpt's ``algorithm`` forms) and their parser.

``algorithm`` is ``None``, a method name (``"awq_lite"``) or a dict ``{"method": "awq_lite",
"alpha_step": 0.1}`` as in ModelOpt. :func:`parse_algorithm` turns it into one frozen dataclass per
method whose fields are typed and range-checked here, so a config is refused before any model is
touched. This module is the config layer (beside ``config.py``, which uses it) and imports nothing of
quantlib; the runners live in ``calib/`` (:mod:`quantlib.calib.registry`).
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import ClassVar, Optional, Union

from .fields import ConfigError, parse_fields


class AlgorithmConfigError(ConfigError):
    """An invalid ``algorithm`` value: a ConfigError naming the method, the key and the value."""


@dataclass(frozen=True)
class AlgorithmConfig:
    """Base of the typed algorithm configs; ``method`` is the registered name."""

    method: ClassVar[str] = ""
    #: True where the runner rewrites weights (not only quantizer state): layer-by-layer calibration
    #: then refuses what would lose them (an offload folder, a resume file)
    mutates_weights: ClassVar[bool] = False
    #: other libraries' names of fields (``{"dampening_frac": "perc_damp"}``), read as the field
    ALIASES: ClassVar[dict[str, str]] = {}
    #: ModelOpt's ``distributed_sync``: MAX-reduce the amax over the ranks after calibration
    distributed_sync: bool = True

    def check(self) -> None:
        """Range checks of the fields (types are checked by :func:`parse_algorithm`)."""

    @classmethod
    def normalize(cls, value: dict) -> dict:
        """``value`` (an ``algorithm`` dict) with :attr:`ALIASES` renamed to their fields; an alias given
        next to its field raises."""
        out = dict(value)
        for alias, field in cls.ALIASES.items():
            if alias in out:
                if field in out:
                    raise AlgorithmConfigError(
                        f"algorithm {cls.method!r}: {alias!r} (value {out[alias]!r}) is another name of {field!r}; give one of them"
                    )
                out[field] = out.pop(alias)
        return out

    def to_dict(self) -> dict:
        """``{"method": ..., fields}``: what :func:`parse_algorithm` reads back."""
        return {"method": self.method, **{f.name: getattr(self, f.name) for f in fields(self)}}


def _in_range(cfg: AlgorithmConfig, key: str, lo: float, hi: float, lo_open: bool, hi_open: bool) -> None:
    v = getattr(cfg, key)
    ok = (v > lo if lo_open else v >= lo) and (v < hi if hi_open else v <= hi)
    if not ok:
        interval = ("(" if lo_open else "[") + f"{lo:g}, {hi:g}" + (")" if hi_open else "]")
        raise AlgorithmConfigError(f"algorithm {cfg.method!r}: {key}={v!r} must lie in {interval}")


@dataclass(frozen=True)
class MaxConfig(AlgorithmConfig):
    """``max``: amax = the running max |x| (weights from the weights, activations from forward_loop)."""

    method: ClassVar[str] = "max"


@dataclass(frozen=True)
class MseConfig(AlgorithmConfig):
    """``mse``: per group, the amax among ``max amax x [start, start + step, ..., stop]`` (ModelOpt's
    grid) that minimises the weight's quantization MSE; ``fp8_scale_sweep`` tries every E4M3 block
    scale of NVFP4 weights with static blocks instead (and searches only those)."""

    method: ClassVar[str] = "mse"
    step_size: float = 0.1
    start_multiplier: float = 0.25
    stop_multiplier: float = 4.0
    fp8_scale_sweep: bool = False

    def check(self) -> None:
        for key in ("step_size", "start_multiplier", "stop_multiplier"):
            _in_range(self, key, 0.0, float("inf"), True, True)
        if self.stop_multiplier < self.start_multiplier:
            raise AlgorithmConfigError(f"algorithm 'mse': stop_multiplier={self.stop_multiplier!r} is below "
                                       f"start_multiplier={self.start_multiplier!r}")


@dataclass(frozen=True)
class SmoothQuantConfig(AlgorithmConfig):
    """``smoothquant``: per input channel s = amax_x^alpha / amax_w^(1-alpha)."""

    method: ClassVar[str] = "smoothquant"
    alpha: float = 1.0

    def check(self) -> None:
        _in_range(self, "alpha", 0.0, 1.0, False, False)


@dataclass(frozen=True)
class AwqLiteConfig(AlgorithmConfig):
    """``awq_lite``: per linear, the alpha of the grid ``0, alpha_step, ..., 1`` whose scales
    s = amax_x^alpha minimise the quantized linear's output error on its own inputs."""

    method: ClassVar[str] = "awq_lite"
    alpha_step: float = 0.1
    debug: bool = False

    def check(self) -> None:
        _in_range(self, "alpha_step", 0.0, 1.0, True, False)


@dataclass(frozen=True)
class AwqClipConfig(AlgorithmConfig):
    """``awq_clip``: per weight group, the clip ratio of ``min_clip_ratio, + shrink_step, ..., 1`` of
    its max amax that minimises the quantized linear's output error on (up to
    ``max_tokens_per_batch`` tokens a call of) its own inputs; ``max_co_batch_size`` output channels
    are searched at a time."""

    method: ClassVar[str] = "awq_clip"
    max_co_batch_size: int = 1024
    max_tokens_per_batch: int = 64
    min_clip_ratio: float = 0.5
    shrink_step: float = 0.05
    debug: bool = False

    def check(self) -> None:
        for key in ("max_co_batch_size", "max_tokens_per_batch"):
            if getattr(self, key) < 1:
                raise AlgorithmConfigError(f"algorithm {self.method!r}: {key}={getattr(self, key)!r} must be >= 1")
        _in_range(self, "min_clip_ratio", 0.0, 1.0, True, True)
        _in_range(self, "shrink_step", 0.0, 1.0, True, False)


@dataclass(frozen=True)
class AwqFullConfig(AwqClipConfig):
    """``awq_full``: ``awq_lite`` (``alpha_step``), then ``awq_clip`` on the scaled weights."""

    method: ClassVar[str] = "awq_full"
    alpha_step: float = 0.1

    def check(self) -> None:
        super().check()
        _in_range(self, "alpha_step", 0.0, 1.0, True, False)

    def lite(self) -> AwqLiteConfig:
        """The awq_lite half."""
        return AwqLiteConfig(self.distributed_sync, self.alpha_step, self.debug)

    def clip(self) -> AwqClipConfig:
        """The awq_clip half."""
        return AwqClipConfig(self.distributed_sync, self.max_co_batch_size, self.max_tokens_per_batch, self.min_clip_ratio,
                             self.shrink_step, self.debug)


@dataclass(frozen=True)
class GptqConfig(AlgorithmConfig):
    """``gptq``: per linear, each weight column quantized in turn (fixed scales from max calibration),
    its error spread over the later columns through the inverse Hessian ``H = 2 X^T X / n`` of the
    linear's inputs, damped by ``perc_damp`` times its mean diagonal; lazy updates every ``block_size``
    columns; ``act_order`` takes columns by decreasing ``H_jj``. ``fused`` is ModelOpt's switch to its
    Triton kernel: accepted, the same loop runs either way. Also read: llm-compressor's
    ``dampening_frac`` and ``actorder`` (None or "static"), AutoGPTQ's ``damp_percent`` and ``desc_act``."""

    method: ClassVar[str] = "gptq"
    mutates_weights: ClassVar[bool] = True
    ALIASES: ClassVar[dict[str, str]] = {
        "dampening_frac": "perc_damp",
        "damp_percent": "perc_damp",
        "desc_act": "act_order",
        "actorder": "act_order",
    }
    perc_damp: float = 0.01
    block_size: int = 128
    act_order: bool = False
    fused: bool = False

    @classmethod
    def normalize(cls, value: dict) -> dict:
        out = {k: v for k, v in value.items() if not (k in ("perc_damp", "block_size") and v is None)}  # ModelOpt's None: the default
        if "actorder" in out:  # llm-compressor's enum: "static" keeps each group's scale, as this runner does
            v = out["actorder"]
            if v not in (None, False, True, "static"):
                why = "groups formed in activation order need a g_idx"
                raise AlgorithmConfigError(f"algorithm 'gptq': actorder={v!r} is not supported ({why}); use None or 'static'")
            out["actorder"] = v in (True, "static")
        return super().normalize(out)

    def check(self) -> None:
        _in_range(self, "perc_damp", 0.0, 1.0, True, False)
        if self.block_size < 1:
            raise AlgorithmConfigError(f"algorithm 'gptq': block_size={self.block_size!r} must be >= 1")


#: method name -> its config class; a name is here only where a runner implements it
ALGORITHMS: dict[str, type[AlgorithmConfig]] = {
    c.method: c for c in (MaxConfig, MseConfig, SmoothQuantConfig, AwqLiteConfig, AwqClipConfig, AwqFullConfig, GptqConfig)
}

def parse_algorithm(value: Union[str, dict, AlgorithmConfig, None]) -> Optional[AlgorithmConfig]:
    """The typed config of an ``algorithm`` value (None: no calibration); unknown methods, unknown
    fields and ill-typed or out-of-range values raise AlgorithmConfigError naming the key."""
    if value is None:
        return None
    if isinstance(value, AlgorithmConfig):  # built directly: its ranges are checked as a parsed one's
        value.check()
        return value
    if isinstance(value, str):
        value = {"method": value}
    if not isinstance(value, dict):
        raise AlgorithmConfigError(f"algorithm must be None, a method name or a dict with a 'method', got {value!r}")
    if "method" not in value:
        raise AlgorithmConfigError(f"algorithm dict needs a 'method' key, got {value!r}")
    method = value["method"]
    if method is None:
        return None
    cls = ALGORITHMS.get(method) if isinstance(method, str) else None
    if cls is None:
        raise AlgorithmConfigError(f"algorithm={method!r}: available methods are {sorted(ALGORITHMS)} and None")
    value = cls.normalize(value)
    cfg = cls(**parse_fields(cls, {k: v for k, v in value.items() if k != "method"}, f"algorithm {method!r}: ", "field"))
    cfg.check()
    return cfg
