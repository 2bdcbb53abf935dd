"""The calibration algorithms' runners by name, and the context each runner gets.

Each algorithm module (``calib/mse.py``, ...) registers the function that runs it with
:func:`register_runner`; the typed configs it runs live in the config layer
(:mod:`quantlib.calib_config`), so a config is parsed without importing any algorithm.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Callable, Optional

from ..calib_config import ALGORITHMS, AlgorithmConfigError

_log = logging.getLogger("quantlib")


@dataclass
class CalibContext:
    """What a runner gets besides the model and its config: the user's ``forward_loop`` (None: weights
    only), ``max_calibrate(model)`` (weights from the weights, activations from one forward_loop pass:
    the max algorithm) and ``sync``, the routine through which quantlib's searches reduce their
    statistics and losses over the whole layout (data, tensor and expert parallel), so every rank makes
    the same choice."""

    forward_loop: Optional[Callable[[Any], Any]]
    max_calibrate: Callable[[Any], None]
    expert_input_policy: str = "max_of_peers"
    #: True when linears are split over several ranks (tensor parallelism)
    tensor_parallel: bool = False
    #: the searches' sync routine over the whole layout (a ``quantlib.collectives.StatSync``:
    #: replicas of dense linears and of each expert, tensor-parallel shards); None: one rank
    sync: Any = None
    #: the parsed QuantizeConfig being calibrated with (None: none applied); layer-by-layer calibration
    #: fingerprints its resume file with it
    config: Any = None

    def max_only_without_loop(self, method: str, model: Any, why: str) -> bool:
        """True where there is no ``forward_loop``: then ``method`` is skipped with a warning saying ``why`` it
        needs one, and ``model`` gets max calibration (as ModelOpt, which skips the algorithm with a warning)."""
        if self.forward_loop is not None:
            return False
        _log.warning("%s needs a forward_loop (%s): without one, weights get max calibration only", method, why)
        self.max_calibrate(model)
        return True


_RUNNERS: dict[str, Callable[..., Any]] = {}

#: what runners leave on a quantized module besides quantizer state (their choices, for inspection):
#: layer-by-layer calibration's resume file keeps them with the amax and pre_quant_scale
RESULT_ATTRIBUTES = ("awq_lite_alpha", "awq_lite_losses", "awq_clip_ratio")


def register_runner(method: str) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Decorator: the function that runs ``method`` (signature of :func:`runner`)."""
    if method not in ALGORITHMS:
        raise KeyError(f"register_runner: {method!r} has no config class in ALGORITHMS")

    def deco(fn: Callable[..., Any]) -> Callable[..., Any]:
        _RUNNERS[method] = fn
        return fn

    return deco


def runner(method: str) -> Callable[..., Any]:
    """The registered runner of ``method``: ``fn(model, config, context) -> None``."""
    try:
        return _RUNNERS[method]
    except KeyError:
        raise AlgorithmConfigError(f"algorithm {method!r} has no runner registered (import quantlib.model_quant)") from None
