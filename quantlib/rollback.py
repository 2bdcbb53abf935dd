"""quantize() and calibrate() all or nothing: the check of every weight quantizer against its weight before
calibration, and the rollback that puts a model back exactly as it was when either fails part way (in the
conversion, the configuration, the calibration or the user's forward loop)."""

from __future__ import annotations

import functools
import logging
from typing import Any, Callable, TypeVar

from torch import nn

from .config import ConfigError
from .nn.containers import GroupedQuantizer
from .nn.quant_module import QuantModule
from .nn.tensor_quantizer import TensorQuantizer

F = TypeVar("F", bound=Callable[..., Any])
_log = logging.getLogger("quantlib")

#: the containers of an nn.Module's state, restored in place so that references to them stay valid
_CONTAINERS = ("_parameters", "_buffers", "_modules", "_non_persistent_buffers_set")


def check_weight_quantizers(model: nn.Module) -> None:
    """Raise ConfigError, naming the quantizer, the key and its value, where an enabled weight
    quantizer's ``axis`` / ``block_sizes`` cannot quantize its module's weight (found here rather
    than at the first forward, or half way through calibration)."""
    for module in model.modules():
        if not isinstance(module, QuantModule):
            continue
        for attr, tensors in module.weight_groups():
            q = getattr(module, attr)
            for member, weight in zip(q if isinstance(q, GroupedQuantizer) else [q], tensors):
                for leaf in [member] if isinstance(member, TensorQuantizer) else member.leaves():
                    if leaf.is_enabled:
                        try:
                            leaf.check_fits(tuple(weight.shape))
                        except ValueError as exc:
                            raise ConfigError(str(exc)) from None


def _snapshot(module: nn.Module) -> tuple[dict, dict]:
    """(attributes, copies of the contents of its state containers) of ``module``. A quantizer's
    buffers are cloned (the amax sync writes them in place) and its calibrator's attributes copied
    (calibrators replace their tensors, never write them). Parameters and other modules' buffers are
    not copied: quantize() never writes them."""
    attrs = dict(module.__dict__)
    contents = {k: attrs[k].copy() for k in _CONTAINERS if k in attrs}
    if isinstance(module, TensorQuantizer):
        contents["_buffers"] = {k: None if v is None else v.detach().clone() for k, v in module._buffers.items()}
        contents["_calibrator"] = dict(module._calibrator.__dict__)
    return attrs, contents


def _put_back(module: nn.Module, snapshot: tuple[dict, dict]) -> None:
    attrs, contents = snapshot
    for k, saved in contents.items():
        held = attrs[k].__dict__ if k == "_calibrator" else attrs[k]  # refilled in place: same objects
        held.clear()
        held.update(saved)
    module.__dict__.clear()
    module.__dict__.update(attrs)


def atomic(fn: F) -> F:
    """Decorate ``fn(model, ...)`` so that where it raises (anything, KeyboardInterrupt included),
    every module of ``model`` is put back as it was on entry: the same module classes in the same
    places, the same parameter objects, the same quantizers with the same configs and amax.

    Parameter values are not copied (that would double the model's memory): a step that writes weights
    in place must do so last, after everything that can fail; one that did not is logged as an error."""

    @functools.wraps(fn)
    def wrapper(model: nn.Module, *args: Any, **kwargs: Any) -> Any:
        saved = [(m, _snapshot(m)) for m in model.modules()]
        versions = [(n, p, p._version) for n, p in model.named_parameters()]
        try:
            return fn(model, *args, **kwargs)
        except BaseException:
            for m, snapshot in saved:
                _put_back(m, snapshot)
            written = [n for n, p, v in versions if p._version != v]
            if written:
                msg = "%s failed after writing %d parameter(s) in place, which cannot be put back: %s"
                _log.error(msg, fn.__name__, len(written), written[:5])
            raise

    return wrapper  # type: ignore[return-value]
