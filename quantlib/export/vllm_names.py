"""vLLM parameter names of stacked experts in the two styles vLLM has used: ``<moe>.experts.w13_weight``
(FusedMoE holding its parameters) and ``<moe>.experts.routed_experts.w13_weight`` (FusedMoE a factory
whose routed experts are a submodule, vLLM 0.26 on). A sender naming one style fails on the other, so the
caller picks it and :func:`check_receiver` names both candidates of any parameter the receiver lacks."""

from __future__ import annotations

import enum
from typing import Collection, Iterable, Iterator, Union

import torch

from .types import ExportError, PackedWeight

#: the submodule that holds the routed experts' parameters in the nested style
ROUTED = "routed_experts"


class ExpertNames(str, enum.Enum):
    """How stacked experts' parameters are named for vLLM."""

    FLAT = "flat"  # <moe>.experts.w13_weight
    NESTED = "nested"  # <moe>.experts.routed_experts.w13_weight


def as_expert_names(value: Union[ExpertNames, str]) -> ExpertNames:
    """``value`` as :class:`ExpertNames`, or ExportError naming the choices."""
    try:
        return ExpertNames(value)
    except ValueError:
        raise ExportError(f"expert_names={value!r}: expected one of {[s.value for s in ExpertNames]}") from None


def _stacked(pw: PackedWeight) -> bool:
    return pw.role == "expert" and pw.expert is None  # one expert's 2-D tensors carry their id


#: NVFP4's global weight scale (ModelOpt's, compressed-tensors'): vLLM's NVFP4 MoE methods keep one input scale per
#: w1 / w3 shard ([E, 2]), its FP8 ones one per expert ([E])
_NVFP4_GLOBAL = ("weight_scale_2", "weight_global_scale")


def _per_expert(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A stacked shard's tensors with one value per expert as vLLM holds them, [E]: compressed-tensors stores a
    per-tensor scale as [1], stacked [E, 1]."""
    return {k: t[:, 0] if t.dim() == 2 and t.shape[1] == 1 else t for k, t in tensors.items()}


def _merge_w13(parts: list[PackedWeight]) -> dict[str, torch.Tensor]:
    """vLLM's ``w13_*`` parameters from the stacked gate (w1) and up (w3) shards: rows (and their
    block / row scales) concatenated, gate first; per-tensor weight scales side by side ([E, 2]);
    activation scales, one input quantizer's for both shards, once ([E]; NVFP4: per shard, [E, 2], as vLLM
    keeps them); CT's ``weight_shape`` rows added."""
    if len(parts) == 1:
        return _per_expert(parts[0].tensors)
    a, b = (_per_expert(p.tensors) for p in parts)
    per_shard_input = any(k.endswith(_NVFP4_GLOBAL) for k in a)
    out = {}
    for k, t in a.items():
        u = b[k]
        if "input" in k and not per_shard_input:
            out[k] = t
        elif k.endswith("weight_shape"):
            out[k] = torch.stack([t[:, 0] + u[:, 0], t[:, 1]], 1)
        else:
            out[k] = torch.stack([t, u], 1) if t.dim() == 1 else _join_rows(t, u)
    return out


def _join_rows(t: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """``torch.cat([t, u], 1)``: without a copy where ``u``'s rows follow ``t``'s in one contiguous tensor (the shards of
    one cast of the whole stack, :func:`~quantlib.export.expert_stacks.shard_tensors`), the same values and strides."""
    if (t.dtype, t.device, t.stride(), t.shape[:1], t.shape[2:]) == (u.dtype, u.device, u.stride(), u.shape[:1], u.shape[2:]) and \
            t.untyped_storage().data_ptr() == u.untyped_storage().data_ptr() and \
            u.storage_offset() == t.storage_offset() + t.shape[1] * t.stride(1):
        whole = t.as_strided((t.shape[0], t.shape[1] + u.shape[1], *t.shape[2:]), t.stride())
        if whole.is_contiguous():
            return whole
    return torch.cat([t, u], 1)


def named_pairs(stream: Iterable[PackedWeight], style: Union[ExpertNames, str] = ExpertNames.FLAT) -> Iterator[tuple[str, torch.Tensor]]:
    """``(key, tensor)`` of every packed weight; stacked experts (``experts="stacked"``) as vLLM's
    fused-MoE parameters, ``w13_*`` (gate and up shards merged) and ``w2_*``, named in ``style``."""
    sub = f".{ROUTED}." if as_expert_names(style) is ExpertNames.NESTED else "."
    pending: list[PackedWeight] = []

    def flush() -> Iterator[tuple[str, torch.Tensor]]:
        if pending:
            yield from ((f"{pending[0].name}{sub}{k}", t) for k, t in _merge_w13(pending).items())
            pending.clear()

    for pw in stream:
        if pending and (not _stacked(pw) or pw.name != pending[0].name or pw.shard not in ("w1", "w3")):
            yield from flush()
        if not _stacked(pw):
            yield from pw.items()
        elif pw.shard in ("w1", "w3"):
            pending.append(pw)
            if len(pending) == 2:  # gate and up: joined now, before the stream casts the next projection
                yield from flush()
        else:
            yield from ((f"{pw.name}{sub}{k}", t) for k, t in _per_expert(pw.tensors).items())
        del pw  # not held while the stream casts the next weight
    yield from flush()


def candidates(key: str) -> tuple[str, str]:
    """(flat, nested) names of a stacked-expert parameter key in either style."""
    head, _, leaf = key.rpartition(".")
    if head.endswith("." + ROUTED):
        flat = f"{head[: -len(ROUTED) - 1]}.{leaf}"
        return flat, key
    return key, f"{head}.{ROUTED}.{leaf}" if head else f"{ROUTED}.{leaf}"


def _expert_param(key: str) -> bool:
    leaf = key.rpartition(".")[2]
    return leaf.startswith(("w13_", "w2_"))


def check_receiver(keys: Iterable[str], receiver: Collection[str]) -> None:
    """Raise ExportError listing every stacked-expert key (``w13_*`` / ``w2_*``, named as vLLM's
    parameters) that the receiver's parameter names lack, with both candidate names and the one the
    receiver has (then the other style is needed). Other keys are checkpoint names that the receiver's
    ``load_weights`` maps onto its fused parameters, so they are not looked up."""
    names = set(receiver)
    missing = []
    for key in keys:
        if key in names or not _expert_param(key):
            continue
        flat, nested = candidates(key)
        has = [n for n in (flat, nested) if n in names]
        style = "nested" if has and has[0] == nested else "flat"
        hint = f"the receiver has {has[0]!r}: use expert_names={style!r}" if has else "the receiver has neither"
        missing.append(f"{key} (candidates: flat {flat!r}, nested {nested!r}; {hint})")
    if missing:
        shown = "; ".join(missing[:8]) + (f"; ... {len(missing) - 8} more" if len(missing) > 8 else "")
        raise ExportError(f"{len(missing)} synced parameter(s) missing on the receiver: {shown}")
