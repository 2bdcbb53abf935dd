"""Megatron-Core's ``SequentialMLP`` quantized without its host loop: every local expert at once.

Megatron's own forward reads ``tokens_per_expert`` back to the host to split the permuted tokens and runs
each expert's MLP in turn. Here the tokens stay as the dispatcher permuted them (sorted by local expert);
the group of each row and the groups' end rows come from the counts on the device
(:func:`.expert_dispatch.group_rows`); each projection's weights are fake-quantized as one (E, out, in)
stack with per-expert amax (:func:`.expert_weights.stacked_fake_quant`), its inputs with each row's
expert's amax (:mod:`.expert_inputs`), and multiplied by one grouped GEMM. The activation, the gated
linear unit, the routing probabilities and the fc1 bias go through Megatron's own ``MLP.forward``, run
on a stand-in for the experts whose linears are these grouped GEMMs, so every activation setting of the
config (swiglu, geglu, clamps, fused bias kernels) is Megatron's; only the fc2 bias, which Megatron adds
times the probabilities, is added here with its formula. Bit for bit Megatron's loop of the quantized
experts, forward and backward; no host read, so ``torch.compile(fullgraph=True)`` takes it whole.

While max calibration collects, each expert's input statistics come from its own rows, reduced per expert
on the device (:mod:`.expert_inputs`). Where the grouped path cannot give the loop's bits, the layer runs
Megatron's forward (:func:`grouped_refusal` says why): forward hooks on the experts (AWQ / SmoothQuant
record each linear's input so), an enabled output quantizer, input quantizers that differ, depend on which
rows they see together or collect other statistics than a max, trainable expert biases (their gradients
would be summed in another order), one local expert (Megatron reads nothing back then), Transformer
Engine's FP8 padding, probabilities applied on the input, unaligned GEMM sizes.
"""

from __future__ import annotations

from typing import Callable, Optional

import torch
from torch import nn

from ..kernels.grouped_mm import grouped_mm
from ..nn.tensor_quantizer import TensorQuantizer
from .expert_dispatch import group_rows
from .expert_inputs import quantize_rows, rows_refusal
from .expert_weights import stacked_fake_quant

try:
    from megatron.core.transformer.mlp import MLP
except ImportError:  # pragma: no cover - this module is only imported by the Megatron plugin
    MLP = None


class Structure:
    """The local experts' linears (None where they are not all quantized local parallel linears), every
    TensorQuantizer under the SequentialMLP and every module under its experts, found once and reused while
    the experts hold the same linears and these the same quantizers."""

    def __init__(self, ids: tuple, mlp: nn.Module, fc1s: list, fc2s: list, local: bool):
        self.ids, self.fc1s, self.fc2s = ids, (fc1s if local else None), (fc2s if local else None)
        self.leaves = [m for m in mlp.modules() if isinstance(m, TensorQuantizer)]
        self.modules = list(mlp.local_experts.modules())
        #: per projection: its linears, their input quantizers, their weight quantizers
        self.projections = {
            key: (lins, [lin._modules["input_quantizer"] for lin in lins], [lin._modules["weight_quantizer"] for lin in lins])
            for key, lins in (("fc1", self.fc1s), ("fc2", self.fc2s)) if lins is not None
        }
        self.refusal: tuple = (None, "")  # (key, why) of the last check
        #: per projection: (key of the biases' identities and versions, their (E, out) stack)
        self.bias_stacks: dict = {}
        #: the two modules Megatron's MLP.forward calls as linear_fc1 / linear_fc2 in eager forwards (see _Experts)
        self.calls: Optional[tuple] = None


def structure(mlp: nn.Module, local: Callable[[list, list], bool]) -> Structure:
    """``mlp``'s :class:`Structure`; ``local(fc1s, fc2s)``: whether the linears are quantized local parallel linears."""
    experts = mlp.local_experts._modules.values()
    fc1s, fc2s = [e._modules.get("linear_fc1") for e in experts], [e._modules.get("linear_fc2") for e in experts]
    ids = tuple(id(m) for m in fc1s + fc2s) + tuple(id(q) for lin in fc1s + fc2s if lin is not None for q in lin._modules.values())
    hit = mlp.__dict__.get("_ql_structure")
    if hit is None or hit.ids != ids:
        hit = mlp.__dict__["_ql_structure"] = Structure(ids, mlp, fc1s, fc2s, local(fc1s, fc2s))
    return hit


def grouped_refusal(mlp: nn.Module, st: Structure, x: torch.Tensor, probs) -> str:
    """Why ``mlp`` (a quantized SequentialMLP of structure ``st``) runs Megatron's loop ('' where it need
    not); the answer is kept while the quantizers' states, the weights and the input's kind are the same."""
    hooked = _hooked(st)
    if hooked:
        return f"{hooked}: forward hooks would not see the experts' calls"
    if st.fc1s is None or torch.compiler.is_compiling():  # (a compiled graph checks once, guarded on what it read)
        return _refusal(mlp, st, x, probs)
    grad = torch.is_grad_enabled()
    linears = st.fc1s + st.fc2s
    weights = tuple(None if w is None else (id(w), w.dtype, w.shape) for w in (lin._parameters.get("weight") for lin in linears))
    biases = tuple(b is not None and grad and b.requires_grad for b in (lin._parameters.get("bias") for lin in linears))
    key = (x.dtype, x.dim(), probs is None, grad, tuple(q._gen for q in st.leaves), weights, biases)
    if st.refusal[0] != key:
        st.refusal = (key, _refusal(mlp, st, x, probs))
    return st.refusal[1]


def _refusal(mlp: nn.Module, st: Structure, x: torch.Tensor, probs) -> str:
    config = mlp.config
    if mlp.num_local_experts == 1:
        return "one local expert (Megatron's forward reads nothing back)"
    fc1s, fc2s = st.fc1s, st.fc2s
    if fc1s is None or fc2s is None:
        return "experts' linears are not Megatron's local parallel linears"
    if any(type(e).forward is not MLP.forward for e in mlp.local_experts):
        return "experts are not Megatron's MLP"
    if getattr(config, "fp8", None) or getattr(config, "fp4", None) or getattr(config, "moe_apply_probs_on_input", False):
        return "Transformer Engine's FP8/FP4 padding or probabilities applied on the input"
    if x.dim() != 2 or probs is None:
        return f"input {tuple(x.shape)} with probabilities {probs is not None}: not (tokens, hidden) rows"
    train = torch.is_grad_enabled()
    for linears in (fc1s, fc2s):
        for lin in linears:
            name, w = lin.weight_quantizer._qname.rpartition(".")[0], lin.weight
            if w is None or w.dtype != x.dtype or w.shape != linears[0].weight.shape or any(n * w.element_size() % 16 for n in w.shape):
                return f"{name}.weight {None if w is None else (w.dtype, tuple(w.shape))}: not grouped-GEMM aligned"
            if not lin.output_quantizer._disabled:
                return f"{lin.output_quantizer._qname}: enabled"
            if lin.bias is not None and train and lin.bias.requires_grad:
                return f"{name}.bias: trainable (its gradient would be summed in another order)"
            if not lin.skip_bias_add:
                return f"{name}: skip_bias_add=False"
        why = rows_refusal([lin.input_quantizer for lin in linears], linears[0].weight.shape[1])
        if why:
            return why
    return ""


def _hooked(st: Structure) -> str:
    """The name of a module under the experts with forward (pre-)hooks, or of the global ones ('' if none)."""
    if torch.nn.modules.module._global_forward_hooks or torch.nn.modules.module._global_forward_pre_hooks:
        return "global module"
    for m in st.modules:
        if m._forward_hooks or m._forward_pre_hooks:
            return next(f"local_experts.{n}" for n, sub in st.modules[0].named_modules() if sub is m)
    return ""


class _Projection(nn.Module):
    """One of the grouped projections as the module Megatron's ``MLP.forward`` calls; ``fn`` is the forward's
    (set for the forward's duration: the modules are built once per :class:`Structure`)."""

    def __init__(self, fn: Optional[Callable] = None):
        super().__init__()
        self.__dict__["fn"] = fn

    def forward(self, x: torch.Tensor):
        return self.__dict__["fn"](x)


class _Experts:
    """What Megatron's ``MLP.forward`` reads of ``self``, for all local experts at once: expert 0's config
    and activation, and linears that are the grouped GEMMs over the rows of every expert."""

    def __init__(self, mlp: nn.Module, st: Structure, counts: torch.Tensor, probs: torch.Tensor, rows: int):
        self._first = mlp.local_experts[0]
        self.config = self._first.config
        self.activation_func = self._first.activation_func
        self._offs, self._expert = group_rows(counts, rows)
        self._mlp, self._st, self._counts, self._probs = mlp, st, counts, probs
        # Megatron >= 0.19 calls them through typed_torch.apply_module, which refuses what is not an nn.Module;
        # eager forwards reuse the structure's two (their __init__ costs more than the rest of this one)
        if torch.compiler.is_compiling():
            self.linear_fc1, self.linear_fc2 = _Projection(self._fc1), _Projection(self._fc2)
        else:
            if st.calls is None:  # (built in eager only: a structure may be made while torch.compile traces)
                st.calls = (_Projection(), _Projection())
            self.linear_fc1, self.linear_fc2 = st.calls
            self.linear_fc1.__dict__["fn"], self.linear_fc2.__dict__["fn"] = self._fc1, self._fc2

    def __getattr__(self, name: str):  # anything else MLP.forward reads (other releases): expert 0's
        return getattr(self.__dict__["_first"], name)

    def _fc1(self, x: torch.Tensor):
        return self._linear("fc1", x), _bias_rows(self._st, "fc1", self._expert)

    def _fc2(self, x: torch.Tensor):
        out = self._linear("fc2", x)
        bias = _bias_rows(self._st, "fc2", self._expert)
        if bias is not None:  # what MLP.forward does with an expert's fc2 bias and its per-token scale
            out += bias * self._probs.unsqueeze(-1)
        return out, None

    def _linear(self, key: str, x: torch.Tensor) -> torch.Tensor:
        linears, inputs, weight_quantizers = self._st.projections[key]
        cache = None if torch.compiler.is_compiling() else self._mlp.__dict__.setdefault("_weight_cache", {}).setdefault(("rows", key), {})
        x = quantize_rows(inputs, x, self._expert, self._counts, cache)
        params = tuple(lin._parameters["weight"] for lin in linears)
        w = stacked_fake_quant(self._mlp, ("stacked", key), weight_quantizers, params, lambda: torch.stack(params),
                               (len(params),) + tuple(params[0].shape), lambda e: linears[e].quantize_weight(params[e]))
        # (E, out, in) -> the (E, in, out) operand: x @ W^T per expert, as Megatron's matmul(x, weight.t())
        return grouped_mm(x, w.transpose(1, 2), self._offs)


def _bias_rows(st: Structure, key: str, expert: torch.Tensor) -> Optional[torch.Tensor]:
    """Each row's expert's bias (rows, out) in projection ``key``, or None without biases. The (E, out) stack
    is kept while every bias is the same tensor at the same version (eval: trainable biases take the loop)."""
    biases = [lin._parameters.get("bias") for lin in st.projections[key][0]]
    if biases[0] is None:
        return None
    if torch.compiler.is_compiling() or (torch.is_grad_enabled() and any(b.requires_grad for b in biases)):
        return torch.stack(biases)[expert]
    ident = tuple((id(b), b._version, b.data_ptr(), b.dtype, b.device) for b in biases)
    hit = st.bias_stacks.get(key)
    if hit is None or hit[0] != ident:
        # the entry keeps the biases alive, whose id() are in its key
        hit = st.bias_stacks[key] = (ident, torch.stack(biases), biases)
    return hit[1][expert]


def grouped_forward(mlp: nn.Module, st: Structure, x: torch.Tensor, tokens_per_expert: torch.Tensor,
                    probs: torch.Tensor) -> tuple[torch.Tensor, None]:
    """SequentialMLP's ``(output, None)`` for ``x`` (rows sorted by local expert, ``tokens_per_expert`` rows
    each) through every expert's grouped GEMMs (after :func:`grouped_refusal` said it can)."""
    # Megatron's allgather dispatcher hands the counts on the host: copied without waiting for the stream
    counts = tokens_per_expert.to(x.device, non_blocking=True)
    if torch.compiler.is_compiling():
        output, _ = MLP.forward(_Experts(mlp, st, counts, probs, x.shape[0]), x, probs)
        return output, None
    try:
        output, _ = MLP.forward(_Experts(mlp, st, counts, probs, x.shape[0]), x, probs)
    finally:  # the structure's projections keep no forward's tensors alive
        for call in st.calls or ():
            call.__dict__["fn"] = None
    return output, None


__all__ = ["Structure", "grouped_forward", "grouped_refusal", "structure"]
