"""Transformer Engine without Transformer Engine: where the input and the weights sit among the args of
TE's autograd functions, one adapter per API generation, and the TE-free halves of the quantized TE
modules.

Nothing here imports ``transformer_engine``. ``plugins/transformer_engine.py`` picks the adapter for
the installed TE by version, checks it against the real ``inspect.signature`` and binds the mixins to
TE's classes; the tests check every adapter against the signatures read from TE's wheels.

How a quantized TE module works: during its forward, the module-level autograd function of TE's
module file (``_GroupedLinear``, ``_Linear``, ``_LayerNormLinear``) is replaced by a
:class:`FunctionProxy` whose ``apply`` / ``forward`` rewrite the args (input through the input
quantizer, weight i through ``weight_quantizer[i]``) and then call TE's function; everything else TE
does (splits, GEMMs, backward) is untouched. Eager mode only: TE runs its forward outside Dynamo.
"""

from __future__ import annotations

import contextlib
import inspect
import re
from dataclasses import dataclass
from typing import Any, Callable, ClassVar, Iterator, Optional, Sequence

import torch
from torch import nn

from ..config import QuantizerAttributeConfig
from ..nn.containers import GroupedQuantizer
from ..nn.quant_module import QuantModule
from ..nn.tensor_quantizer import TensorQuantizer
from .expert_tokens import count_tokens
from .te_training import check_fused_wgrad, check_recipe, to_main_grad

QuantizeInput = Callable[[torch.Tensor], torch.Tensor]
QuantizeWeight = Callable[[int, torch.Tensor], torch.Tensor]


class AdapterError(RuntimeError):
    """TE's autograd function does not have the layout an adapter expects (or a call breaks it)."""


def parse_version(version: str) -> tuple[int, int]:
    """(major, minor) of a TE version string such as ``"2.20.2"``, ``"2.9.0+cu12"``, ``"2.14.0.dev0"``."""
    m = re.match(r"\s*(\d+)\.(\d+)", version)
    if m is None:
        raise AdapterError(f"cannot parse Transformer Engine version {version!r}")
    return int(m.group(1)), int(m.group(2))


def _positional_names(sig: inspect.Signature) -> tuple[list[str], Optional[str]]:
    """(names of the positional parameters, name of ``*args`` or None)."""
    names, vararg = [], None
    for p in sig.parameters.values():
        if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD):
            names.append(p.name)
        elif p.kind == p.VAR_POSITIONAL:
            vararg = p.name
    return names, vararg


# ------------------------------------------------------------------------------ GroupedLinear


@dataclass(frozen=True)
class GroupedCall:
    """Positions (in the args after ``ctx``) of the input and of weight 0..num_gemms-1."""

    inp: int
    weights: range


@dataclass(frozen=True)
class GroupedLinearAdapter:
    """One API generation of ``_GroupedLinear.forward(ctx, <params>, *weights_and_biases)``.

    ``params`` are the positional parameters between ``ctx`` and ``*weights_and_biases``, by name. The
    weights come first in ``weights_and_biases`` (one per GEMM), then the biases. The number of GEMMs is
    ``len(m_splits)``; ``m_splits`` is the parameter of that name, or item ``splits_item`` of
    ``non_tensor_args`` where it is packed there (2.10–2.16).
    """

    generation: str
    first: tuple[int, int]  # first TE (major, minor) of this generation
    params: tuple[str, ...]
    splits_item: Optional[int] = None  # index of m_splits inside non_tensor_args

    def check_signature(self, sig: inspect.Signature) -> None:
        """Raise AdapterError unless ``sig`` (of ``_GroupedLinear.forward``) is this generation's."""
        names, vararg = _positional_names(sig)
        expected = ["ctx", *self.params]
        if names != expected or vararg is None:
            raise AdapterError(
                f"_GroupedLinear.forward{sig} does not match the TE {self.generation} layout "
                f"(ctx, {', '.join(self.params)}, *weights_and_biases)"
            )

    def m_splits(self, args: Sequence[Any]) -> Sequence:
        """The split sizes (a list of ints, or a 1-D tensor from 2.17 on)."""
        if self.splits_item is None:
            return args[self.params.index("m_splits")]
        return args[self.params.index("non_tensor_args")][self.splits_item]

    def locate(self, args: Sequence[Any]) -> GroupedCall:
        """Where the input and the weights are in ``args`` (the call's args after ``ctx``)."""
        if len(args) < len(self.params):
            raise AdapterError(f"TE {self.generation} _GroupedLinear takes at least {len(self.params)} args before the weights, got "
                               f"{len(args)}")
        num_gemms = len(self.m_splits(args))
        start = len(self.params)
        if len(args) < start + num_gemms:
            raise AdapterError(f"TE {self.generation} _GroupedLinear call has {len(args) - start} weight/bias args for {num_gemms} GEMMs")
        return GroupedCall(inp=self.params.index("inp"), weights=range(start, start + num_gemms))

    def quantize_args(self, args: Sequence[Any], quantize_input: QuantizeInput, quantize_weight: QuantizeWeight) -> tuple:
        """``args`` with the input replaced by ``quantize_input(inp)`` and weight i by
        ``quantize_weight(i, weight_i)``; every other arg is passed through as the same object."""
        call = self.locate(args)
        new = list(args)
        new[call.inp] = quantize_input(args[call.inp])
        for i, pos in enumerate(call.weights):
            w = args[pos]
            if not isinstance(w, torch.Tensor) or w.dim() != 2:
                raise AdapterError(
                    f"TE {self.generation} _GroupedLinear: weight {i} is a {type(w).__name__}"
                    f"{'' if not isinstance(w, torch.Tensor) else ' of shape ' + str(tuple(w.shape))}, expected a 2-D tensor "
                    "(single_grouped_weight and TE-quantized weights are not supported)"
                )
            new[pos] = quantize_weight(i, w)
        return tuple(new)


_TE1_PARAMS = ("inp", "m_splits", "use_bias", "is_first_microbatch", "fp8", "fp8_calibration", "fp8_meta", "fuse_wgrad_accumulation",
               "cpu_offloading", "sequence_parallel", "activation_dtype", "fp8_meta_offsets", "is_grad_enabled", "weights_fp8")  # fmt: skip
_TE2_8_PARAMS = ("inp", "m_splits", "use_bias", "is_first_microbatch", "fp8", "fp8_calibration", "wgrad_store", "input_quantizers",
                 "weight_quantizers", "output_quantizers", "grad_output_quantizers", "fuse_wgrad_accumulation", "cpu_offloading",
                 "sequence_parallel", "activation_dtype", "is_grad_enabled", "module", "skip_fp8_weight_update",
                 "save_original_input")  # fmt: skip

#: 1.12–1.13: 14 positional args, m_splits a list.
TE_1_13 = GroupedLinearAdapter("1.13", (1, 12), _TE1_PARAMS)
#: 2.8–2.9: 19 positional args (TE's quantizers passed as args).
TE_2_8 = GroupedLinearAdapter("2.8", (2, 8), _TE2_8_PARAMS)
#: 2.10–2.16: everything after inp packed into non_tensor_args, m_splits its first item.
TE_2_10 = GroupedLinearAdapter("2.10", (2, 10), ("inp", "non_tensor_args"), splits_item=0)
#: 2.17: inp, m_splits (a Tensor), non_tensor_args.
TE_2_17 = GroupedLinearAdapter("2.17", (2, 17), ("inp", "m_splits", "non_tensor_args"))
#: 2.18–2.20: adds out, dgrad_out.
TE_2_18 = GroupedLinearAdapter("2.18", (2, 18), ("inp", "m_splits", "non_tensor_args", "out", "dgrad_out"))

GROUPED_LINEAR_ADAPTERS: tuple[GroupedLinearAdapter, ...] = (TE_1_13, TE_2_8, TE_2_10, TE_2_17, TE_2_18)
#: Generations whose GroupedLinear has no adapter: [first, end) version ranges.
_UNSUPPORTED = (((2, 0), (2, 8)),)


def grouped_linear_adapter(version: str) -> GroupedLinearAdapter:
    """The adapter of the generation TE ``version`` belongs to (the newest one for newer releases; the
    signature check at registration says whether it still fits). Raises AdapterError for releases
    with no adapter (before 1.12, and 2.0–2.7)."""
    v = parse_version(version)
    for lo, hi in _UNSUPPORTED:
        if lo <= v < hi:
            break
    else:
        chosen = [a for a in GROUPED_LINEAR_ADAPTERS if a.first <= v]
        if chosen:
            return chosen[-1]
    raise AdapterError(f"Transformer Engine {version}: no GroupedLinear adapter (supported: 1.12–1.13, 2.8 and newer)")


# ------------------------------------------------------------------------------ Linear / LayerNormLinear


@dataclass(frozen=True)
class TensorArgs:
    """Positions (after ``ctx``) of ``inp`` and ``weight`` in ``_Linear.forward`` or
    ``_LayerNormLinear.forward``: both are named parameters in every TE release (1.13 to 2.20), only
    their positions move, so one adapter reads them from the signature."""

    inp: int
    weight: int

    @classmethod
    def from_signature(cls, sig: inspect.Signature) -> "TensorArgs":
        names, _ = _positional_names(sig)
        if not names or names[0] != "ctx" or "inp" not in names or "weight" not in names:
            raise AdapterError(f"autograd function forward{sig} has no (ctx, ..., inp, ..., weight, ...) parameters")
        return cls(inp=names.index("inp") - 1, weight=names.index("weight") - 1)

    def quantize_args(self, args: Sequence[Any], quantize_input: Optional[QuantizeInput], quantize_weight: QuantizeInput) -> tuple:
        """``args`` with ``weight`` (and ``inp``, unless ``quantize_input`` is None) quantized."""
        if len(args) <= max(self.inp, self.weight):
            raise AdapterError(f"expected at least {max(self.inp, self.weight) + 1} args, got {len(args)}")
        new = list(args)
        w = args[self.weight]
        if not isinstance(w, torch.Tensor):
            raise AdapterError(f"weight is a {type(w).__name__}, expected a tensor (TE-quantized weights are not supported)")
        new[self.weight] = quantize_weight(w)
        if quantize_input is not None:
            new[self.inp] = quantize_input(args[self.inp])
        return tuple(new)


# ------------------------------------------------------------------------------ function swap


class FunctionProxy:
    """Stands in for a TE autograd Function class during one forward: ``apply`` and ``forward`` pass
    their args through ``rewrite`` first; any other attribute (TE's static helpers, which its forward
    looks up through the same module global) is the original's."""

    def __init__(self, function: Any, rewrite: Callable[[tuple], tuple]) -> None:
        self._function = function
        self._rewrite = rewrite

    def apply(self, *args):
        return self._function.apply(*self._rewrite(args))

    def forward(self, ctx, *args):
        return self._function.forward(ctx, *self._rewrite(args))

    def __getattr__(self, name: str):
        return getattr(self._function, name)


@contextlib.contextmanager
def swapped(namespace: Any, name: str, replacement: Any) -> Iterator[Any]:
    """Set ``namespace.name = replacement`` for the duration of the block; yields the original."""
    original = getattr(namespace, name)
    setattr(namespace, name, replacement)
    try:
        yield original
    finally:
        setattr(namespace, name, original)


def _first_output(out: Any, quantizer: nn.Module) -> Any:
    """Apply ``quantizer`` to the output tensor (the first item where TE returns a tuple)."""
    if isinstance(out, tuple):
        return (quantizer(out[0]),) + out[1:]
    return quantizer(out)


def _parallel_role(module: nn.Module) -> str:
    mode = getattr(module, "parallel_mode", None)
    return mode if mode in ("column", "row") else "replicated"


# ------------------------------------------------------------------------------ mixins (TE-free)


class QuantTEModuleBase(QuantModule):
    """Shared by the quantized TE modules: the function swap and the checks TE's forward needs."""

    #: the Python module of TE that holds the autograd function as a global (bound at registration)
    te_namespace: ClassVar[Any] = None
    te_function_name: ClassVar[str] = ""

    @property
    def parallel_role(self) -> str:  # type: ignore[override]
        return _parallel_role(self)

    def _rewrite(self, args: tuple) -> tuple:
        raise NotImplementedError

    #: position of ``is_first_microbatch`` among the forward's positional args (the input first)
    first_microbatch_at: ClassVar[int] = 1

    def _check_call(self) -> None:
        store = getattr(self, "wgrad_store", None)
        if torch.is_grad_enabled() and store is not None and store.delay_wgrad_compute():
            # TE's backward_dw writes weight.grad itself, later, past quantlib's straight-through estimator
            raise RuntimeError(f"{type(self).__name__}: delay_wgrad_compute=True is not supported with quantlib's fake quant")

    def _check_rewrite(self) -> None:
        # Called inside TE's forward, after its prepare_forward has set self.fp8 and the recipe.
        if getattr(self, "fp8", False):
            check_recipe(type(self).__name__, self.fp8_meta.get("recipe"))

    def _weight_in(self, weight: torch.Tensor) -> torch.Tensor:
        """The weight as quantlib's weight quantizer takes it: routed to ``main_grad`` while the forward runs with
        TE's fuse_wgrad_accumulation turned off (see :func:`_fused_wgrad`)."""
        first = self.__dict__.get("_ql_main_grad")
        if first is None or not weight.requires_grad:
            return weight
        check_fused_wgrad(type(self).__name__, weight)
        return to_main_grad(weight, first[0])

    @contextlib.contextmanager
    def _fused_wgrad(self, args: tuple, kwargs: dict) -> Iterator[None]:
        """With ``fuse_wgrad_accumulation`` and autograd on: TE runs as without it (its wgrad GEMM would write the
        gradient of the fake-quantized copy into the copy's main_grad, past the straight-through estimator), and
        :meth:`_weight_in` sends the weight's gradient, after the estimator, into ``weight.main_grad`` as TE would."""
        if not (torch.is_grad_enabled() and getattr(self, "fuse_wgrad_accumulation", False)):
            yield
            return
        at = self.first_microbatch_at
        first = kwargs.get("is_first_microbatch", args[at] if len(args) > at else None)
        if first is None and "is_first_microbatch" in self.__dict__ and not getattr(self, "disable_parameter_transpose_cache", False):
            first = self.__dict__["is_first_microbatch"]  # Megatron's TE wrappers pass TE their own flag
        self.__dict__["_ql_main_grad"] = (first,)
        try:
            with swapped(self, "fuse_wgrad_accumulation", False):
                yield
        finally:
            del self.__dict__["_ql_main_grad"]

    @contextlib.contextmanager
    def _quantizing(self) -> Iterator[None]:
        function = getattr(self.te_namespace, self.te_function_name)

        def rewrite(args: tuple) -> tuple:
            self._check_rewrite()
            return self._rewrite(args)

        with swapped(self.te_namespace, self.te_function_name, FunctionProxy(function, rewrite)):
            yield

    def forward(self, *args, **kwargs):
        self._check_call()
        with self._fused_wgrad(args, kwargs), self._quantizing():
            out = super().forward(*args, **kwargs)
        return _first_output(out, self.output_quantizer)


def _te_weight(module: nn.Module) -> torch.Tensor:
    """The weight TE's Linear / LayerNormLinear pass to their GEMM (split parameters concatenated)."""
    names = list(getattr(module, "weight_names", None) or ["weight"])
    tensors = [getattr(module, n) for n in names]
    return tensors[0] if len(tensors) == 1 else torch.cat(tensors, dim=0)


class QuantTELinearBase(QuantTEModuleBase):
    """``te.pytorch.Linear``: input, weight and output quantizers."""

    te_function_name: ClassVar[str] = "_Linear"
    te_args: ClassVar[Optional[TensorArgs]] = None

    def weight_groups(self) -> Iterator[tuple[str, list[torch.Tensor]]]:
        yield "weight_quantizer", [_te_weight(self)]

    def _rewrite(self, args: tuple) -> tuple:
        return self.te_args.quantize_args(args, self.input_quantizer, lambda w: self.quantize_weight(self._weight_in(w)))


class QuantTELayerNormLinearBase(QuantTELinearBase):
    """``te.pytorch.LayerNormLinear``: the input quantizer acts on the normalized input (what the GEMM
    reads, also what ``return_layernorm_output`` returns); the gradient through it is straight-through
    without the clip mask, since it runs inside TE's autograd function."""

    te_function_name: ClassVar[str] = "_LayerNormLinear"
    te_norm_name: ClassVar[str] = "apply_normalization"
    # the forward's input is pre-norm; quantized_norm calls the input quantizer on every forward's
    # normalized input (enabled or not), so AWQ / SmoothQuant record it there
    gemm_input_at_input_quantizer = True

    def _rewrite(self, args: tuple) -> tuple:
        return self.te_args.quantize_args(args, None, lambda w: self.quantize_weight(self._weight_in(w)))

    def _check_rewrite(self) -> None:
        if getattr(self, "fp8", False) and self.te_norm_name != "apply_normalization":
            # TE 1.x's norm kernel writes raw FP8 bytes where quantlib would quantize the normalized input
            raise RuntimeError(f"{type(self).__name__}: quantlib fake quant under TE 1.x's fp8_autocast is not supported "
                               "(use Transformer Engine 2.8 or newer, or run without it)")  # fmt: skip
        super()._check_rewrite()

    @contextlib.contextmanager
    def _quantizing(self) -> Iterator[None]:
        norm = getattr(self.te_namespace, self.te_norm_name)
        wrapped = quantized_norm(norm, self.input_quantizer, te_quantizer_at=5 if self.te_norm_name == "apply_normalization" else None)
        with swapped(self.te_namespace, self.te_norm_name, wrapped), super()._quantizing():
            yield


def quantized_norm(norm: Callable, quantizer: Callable, te_quantizer_at: Optional[int] = 5) -> Callable:
    """TE's ``apply_normalization`` with ``quantizer`` applied to the normalized output (the GEMM input). Under TE's
    autocast, TE passes its own FP8 quantizer for the norm kernel to write FP8 directly (argument ``te_quantizer_at``,
    2.x's ``output_quantizer``): the norm then runs without it, and TE's quantizer casts quantlib's fake-quantized
    output instead, as TE does itself where it cannot fuse the cast."""

    def wrapped(*args, **kwargs):
        te_quantizer = None
        if te_quantizer_at is not None:
            if len(args) > te_quantizer_at:
                te_quantizer = args[te_quantizer_at]
                args = args[:te_quantizer_at] + (None,) + args[te_quantizer_at + 1 :]
            elif kwargs.get("output_quantizer") is not None:
                te_quantizer, kwargs = kwargs["output_quantizer"], {**kwargs, "output_quantizer": None}
        ln_out, *rest = norm(*args, **kwargs)
        if type(ln_out) is torch.Tensor:  # (TE 1.x without autocast: a plain tensor too)
            ln_out = quantizer(ln_out)
        if te_quantizer is not None:
            ln_out = te_quantizer(ln_out)
        return (ln_out, *rest)

    return wrapped


class QuantTEGroupedLinearBase(QuantTEModuleBase):
    """``te.pytorch.GroupedLinear`` (weights ``weight0..weight{n-1}``): one shared input quantizer, a
    :class:`GroupedQuantizer` of ``num_gemms`` weight quantizers (member i quantizes weight i, calibrated
    from weight i alone), an output quantizer. ``tokens_per_expert`` counts the rows each GEMM received
    during the last calibration."""

    te_function_name: ClassVar[str] = "_GroupedLinear"
    te_adapter: ClassVar[Optional[GroupedLinearAdapter]] = None
    first_microbatch_at: ClassVar[int] = 2  # forward(inp, m_splits, is_first_microbatch, ...)
    grouped_quantizer_names: ClassVar[tuple[str, ...]] = ("weight_quantizer",)
    is_expert = True

    def _setup(self) -> None:
        if getattr(self, "single_grouped_weight", False):
            raise NotImplementedError(f"{type(self).__name__}: single_grouped_weight=True is not supported; use per-GEMM weights")
        self.input_quantizer = TensorQuantizer(QuantizerAttributeConfig())
        self.weight_quantizer = GroupedQuantizer([TensorQuantizer(QuantizerAttributeConfig(axis=0)) for _ in range(self.num_gemms)])
        self.output_quantizer = TensorQuantizer(QuantizerAttributeConfig(enable=False))
        self.register_buffer("tokens_per_expert", torch.zeros(self.num_gemms, dtype=torch.int64), persistent=False)
        self._was_calibrating = False

    def weight_groups(self) -> Iterator[tuple[str, list[torch.Tensor]]]:
        yield "weight_quantizer", [getattr(self, f"weight{i}") for i in range(self.num_gemms)]

    def _rewrite(self, args: tuple) -> tuple:
        return self.te_adapter.quantize_args(args, self.input_quantizer,
                                             lambda i, w: self.quantize_weight(self._weight_in(w), "weight_quantizer", i))

    def forward(self, inp, m_splits, *args, **kwargs):
        record_tokens(self, m_splits, self.input_quantizer)
        return super().forward(inp, m_splits, *args, **kwargs)


# ------------------------------------------------------------------------------ tokens per expert


def _calibrating(module: nn.Module) -> bool:
    """Whether a calibration forward loop is running through ``module`` (quantlib.calibrate turns
    on collection in its activation quantizers, or turns off quantization of every enabled one)."""
    # every forward asks: a walk of the children by hand, stopping at the first calibrating quantizer
    # (named_modules' generators and memo set cost more than the check)
    stack = list(module._modules.values())
    while stack:
        m = stack.pop()
        if isinstance(m, TensorQuantizer):
            if not m._disabled and (m._if_calib or not m._if_quant):
                return True
        elif m is not None:
            stack.extend(m._modules.values())
    return False


def record_tokens(module: nn.Module, counts: Any, input_quantizer: TensorQuantizer) -> None:
    """Add ``counts`` (tokens per expert: a list or tensor) to ``module.tokens_per_expert`` while a
    calibration runs. Call it before ``input_quantizer`` sees the forward's input. Counting starts from
    zero with each calibration: where ``input_quantizer`` collects statistics, when it has collected
    none yet (calibrate resets it first); otherwise at the first calibrating forward after any other."""
    count_tokens(module, counts, input_quantizer, _calibrating(module))


__all__ = [
    "AdapterError",
    "FunctionProxy",
    "GROUPED_LINEAR_ADAPTERS",
    "GroupedCall",
    "GroupedLinearAdapter",
    "QuantTEGroupedLinearBase",
    "QuantTELayerNormLinearBase",
    "QuantTELinearBase",
    "TE_1_13",
    "TE_2_10",
    "TE_2_17",
    "TE_2_18",
    "TE_2_8",
    "TensorArgs",
    "grouped_linear_adapter",
    "parse_version",
    "quantized_norm",
    "record_tokens",
    "swapped",
]
