"""The RL weight sync of one model, planned once and replayed after every optimizer step.

:func:`~quantlib.export.sync_pairs` plans the export (names, checks, sibling groups, folds) on every call:
on a GPU that host time is as long as packing a few GB (docs/design.md §8). A trainer syncs the same model
after every step, so :class:`WeightSync` keeps the plan while nothing it was made from has changed, and
says so by a state token compared on each call: the identity of every module, every parameter's identity,
shape, dtype and device, and every quantizer's attributes with the versions of its tensors (an in-place
recalibration bumps them). Any difference plans again, so a kept plan is never stale; weight values are
not in the token (they change every step, and dynamic scales come from them).
"""

from __future__ import annotations

from typing import Iterator, Optional, Union

import torch
from torch import nn

from ..nn.containers import QuantizerContainer
from ..nn.tensor_quantizer import TensorQuantizer
from .formats import as_format
from .iterate import iter_scaled, plan_for_scales
from .layouts import ModelLayout
from .plan import Plan
from .sync_scales import Scales, as_scales
from .types import ExportError, ExportFormat
from .vllm_names import ExpertNames, named_pairs

_PLAIN = (bool, int, float, str, type(None))


class _Token:
    """The parts of a state token, and the objects named in it by identity, held so that no other object
    can take a freed one's id while the token is kept."""

    def __init__(self) -> None:
        self.parts: list = []
        self.held: list = []

    def ref(self, obj: object) -> int:
        self.held.append(obj)
        return id(obj)

    def tensor(self, t: Optional[torch.Tensor], version: bool) -> tuple:
        if t is None:
            return ()
        return (self.ref(t), t._version if version else 0, tuple(t.shape), t.dtype, t.device)

    def value(self, v: object) -> object:
        """A plain value (or a tuple of them) as itself, a tensor by identity and version, a dict by its
        items, anything else by identity (a quantizer's spec and attribute config are set anew, never edited)."""
        if isinstance(v, _PLAIN) or (isinstance(v, tuple) and all(isinstance(x, _PLAIN) for x in v)):
            return v
        if isinstance(v, torch.Tensor):
            return self.tensor(v, True)
        if isinstance(v, dict):
            return tuple((k, self.value(x)) for k, x in v.items())
        return self.ref(v)


def state_token(model: nn.Module) -> tuple[tuple, list]:
    """What an export plan of ``model`` is made from, as one comparable value (see the module docstring),
    and the objects it names by identity (keep them as long as the token)."""
    tok = _Token()
    tok.parts += [tok.ref(getattr(model, "_quantlib_config", None)), tok.ref(getattr(model, "config", None))]
    for m in model.modules():
        tok.parts.append(tok.ref(m))
        quantizer = isinstance(m, (TensorQuantizer, QuantizerContainer))
        for k, p in m._parameters.items():
            tok.parts.append((k, tok.tensor(p, False)))
        for k, b in m._buffers.items():  # a quantizer's amax / scales by version: recalibrating in place changes the plan
            tok.parts.append((k, tok.tensor(b, quantizer)))
        if quantizer:
            tok.parts.extend((k, tok.value(v)) for k, v in m.__dict__.items() if k not in ("_parameters", "_buffers", "_modules"))
    return tuple(tok.parts), tok.held


class WeightSync:
    """``sync = WeightSync(model, "hf_fp8_block")``, then after every optimizer step ``for key, t in
    sync.pairs(): send(key, t)``: the pairs of :func:`~quantlib.export.sync_pairs` (same arguments, same
    tensors), with the export plan kept between calls while :func:`state_token` is unchanged. ``replans``
    counts the plans made."""

    def __init__(
        self,
        model: nn.Module,
        format: Union[ExportFormat, str],
        *,
        scales: Union[Scales, str] = Scales.DYNAMIC,
        experts: str = "stacked",
        expert_names: Union[ExpertNames, str] = ExpertNames.FLAT,
        layout: Optional[ModelLayout] = None,
        tp: int = 1,
        tp_rank: Optional[int] = None,
    ) -> None:
        if experts not in ("per_expert", "stacked"):
            raise ExportError(f"experts={experts!r}: expected 'per_expert' or 'stacked'")
        if experts == "stacked" and tp > 1 and (tp_rank is None or not 0 <= tp_rank < tp):
            raise ExportError(f"tp_rank={tp_rank!r}: experts='stacked' at tp={tp} yields one rank's shard; pass tp_rank in [0, {tp})")
        self.model, self.format, self.scales = model, as_format(format), as_scales(scales)
        self.experts, self.expert_names, self.layout, self.tp, self.tp_rank = experts, expert_names, layout, tp, tp_rank
        self.replans = 0
        self._plan: Optional[Plan] = None
        self._token: Optional[tuple] = None
        self._held: list = []

    def plan(self) -> Plan:
        """The export plan for the model as it is now: the kept one, or a new one if anything changed."""
        token, held = state_token(self.model)
        if self._plan is None or token != self._token:
            self._plan = plan_for_scales(self.model, self.format, self.scales, layout=self.layout, tp=self.tp)
            self._token, self._held = token, held
            self.replans += 1
        return self._plan

    def pairs(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Every tensor to send, ``(key, tensor)`` on the model's device, scales as ``scales`` says."""
        stream = iter_scaled(self.model, self.plan(), self.format, self.scales, stacked=self.experts == "stacked", tp=(self.tp_rank or 0, self.tp))
        return named_pairs(stream, self.expert_names)


__all__ = ["WeightSync", "state_token"]
