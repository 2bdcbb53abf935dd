"""Max calibration of a converted model: weight amax from the weights, activation amax from a forward
loop, experts that no token reached filled by ``expert_input_policy``; shared by ``calibrate()`` and the
layer-by-layer driver (quantlib.calib.sequential), below both."""

from __future__ import annotations

import logging
import sys
from typing import Any, Callable, Optional

import torch
from torch import nn

from ..nn.containers import GroupedQuantizer
from ..nn.tensor_quantizer import CalibrationError, TensorQuantizer
from ..traversal import expert_group_key, iter_leaf_quantizers, leaves_of, quant_modules, weight_quantizer_ids
from .shared_global_amax import share_static_block_global_amax

ForwardLoop = Callable[[nn.Module], Any]
_log = logging.getLogger("quantlib")


def max_calibrate(model: nn.Module, forward_loop: Optional[ForwardLoop], expert_policy: str) -> None:
    """The ``max`` algorithm: weight amax from the weights (siblings with NVFP4 static blocks then share
    their global amax, as in ModelOpt), activation amax from ``forward_loop`` (None: activations keep no
    amax and use each tensor's own)."""
    for _, m in quant_modules(model):
        m.calibrate_weights()
    share_static_block_global_amax(model)
    if forward_loop is not None:
        calibrate_activations(model, forward_loop, expert_policy)
    else:
        drop_activation_amax(model)


def drop_activation_amax(model: nn.Module) -> None:
    """Without a forward loop, activation quantizers use the amax of each tensor they see: an amax
    left by an earlier calibration (another config) would otherwise stay in use."""
    weight_ids = weight_quantizer_ids(model)
    for _, q in iter_leaf_quantizers(model):
        if id(q) not in weight_ids:
            q.reset_amax()


def activation_leaves(model: nn.Module) -> list[tuple[str, TensorQuantizer]]:
    """(name, quantizer) of every enabled leaf quantizer of an activation (not a weight) that calibrates an amax."""
    weight_ids = weight_quantizer_ids(model)
    return [(n, q) for n, q in iter_leaf_quantizers(model) if id(q) not in weight_ids and q.is_enabled and q.needs_calibration]


def finish_activations(model: nn.Module, active: list[tuple[str, TensorQuantizer]], expert_policy: str) -> None:
    """After the forward loop: log the tokens per expert, and give the ``active`` quantizers that no data
    reached an amax as ``expert_policy`` says (or raise)."""
    tokens_per_expert_report(model)
    missing = [(n, q) for n, q in active if q.amax is None]
    if missing:
        fill_missing(model, missing, expert_policy)


def calibrate_activations(model: nn.Module, forward_loop: ForwardLoop, expert_policy: str) -> None:
    """Activation amax from one ``forward_loop(model)`` pass over the unquantized model."""
    active = activation_leaves(model)
    enabled = [q for _, q in iter_leaf_quantizers(model) if q.is_enabled]
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
    finish_activations(model, active, expert_policy)


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


def fill_missing(model: nn.Module, missing: list[tuple[str, TensorQuantizer]], policy: str) -> None:
    """Quantizers the forward loop never reached: experts follow the policy, anything else raises."""
    experts = {id(leaf) for _, m in quant_modules(model) if m.is_expert for qn in m.quantizer_names
               for _, leaf in leaves_of(qn, getattr(m, qn))}
    # a module with grouped weights holds all local experts of its layer: its quantizers have no local
    # peers (expert_group_key of their names would replace the layer index instead)
    alone = {id(getattr(m, qn)) for _, m in quant_modules(model) if m.is_expert and any(isinstance(getattr(m, w, None), GroupedQuantizer)
                                                                                        for w in m.weight_quantizer_names)
                                                                                        for qn in m.quantizer_names}
    not_experts = [n for n, q in missing if id(q) not in experts]
    if not_experts:
        raise CalibrationError(f"calibration data never reached {len(not_experts)} quantizer(s): {not_experts[:5]}; feed data that reaches "
                               "them or disable them in the config")
    if policy == "skip":
        for n, _ in missing:
            _log.warning("%s: no tokens reached this expert; its input quantizer uses a dynamic amax", n)
        return
    if policy == "error":
        raise CalibrationError(f"no tokens reached {len(missing)} expert input quantizer(s): {[n for n, _ in missing][:5]} "
                               "(expert_input_policy='error')")
    peers: dict[str, list[torch.Tensor]] = {}
    for n, q in iter_leaf_quantizers(model):
        if id(q) in experts and id(q) not in alone and q.amax is not None:
            peers.setdefault(expert_group_key(n), []).append(q.amax)
    for n, q in missing:
        found = None if id(q) in alone else peers.get(expert_group_key(n))
        if found:
            q.amax = torch.stack([a.reshape(found[0].shape) for a in found]).amax(dim=0)
            _log.info("%s: no tokens reached this expert; input amax set to the max of %d peers", n, len(found))


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
