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

from typing import Optional

import torch
from torch import nn

from ..kernels.grouped_mm import grouped_mm
from .expert_dispatch import group_rows
from .expert_inputs import quantize_rows, rows_refusal
from .expert_weights import stacked_fake_quant

try:
    from megatron.core.transformer.mlp import MLP
except ImportError:  # pragma: no cover - this module is only imported by the Megatron plugin
    MLP = None


def grouped_refusal(mlp: nn.Module, fc1s: Optional[list], fc2s: Optional[list], x: torch.Tensor, probs) -> str:
    """Why ``mlp`` (a quantized SequentialMLP with local linears ``fc1s`` / ``fc2s``, None where they are
    not Megatron's local ColumnParallelLinear / RowParallelLinear) runs Megatron's loop ('' where it need not)."""
    config = mlp.config
    if mlp.num_local_experts == 1:
        return "one local expert (Megatron's forward reads nothing back)"
    if fc1s is None or fc2s is None:
        return "experts' linears are not Megatron's local parallel linears"
    hooked = _hooked(mlp)
    if hooked:
        return f"{hooked}: forward hooks would not see the experts' calls"
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


def _hooked(mlp: nn.Module) -> str:
    """The name of a module under ``mlp``'s experts with forward (pre-)hooks, or of the global ones ('' if none)."""
    if torch.nn.modules.module._global_forward_hooks or torch.nn.modules.module._global_forward_pre_hooks:
        return "global module"
    for m in mlp.local_experts.modules():
        if m._forward_hooks or m._forward_pre_hooks:
            return next(f"local_experts.{n}" for n, sub in mlp.local_experts.named_modules() if sub is m)
    return ""


class _Experts:
    """What Megatron's ``MLP.forward`` reads of ``self``, for all local experts at once: expert 0's config
    and activation, and linears that are the grouped GEMMs over the rows of every expert."""

    def __init__(self, mlp: nn.Module, fc1s: list, fc2s: list, counts: torch.Tensor, probs: torch.Tensor, rows: int):
        self._first = mlp.local_experts[0]
        self.config = self._first.config
        self.activation_func = self._first.activation_func
        self._offs, self._expert = group_rows(counts, rows)
        self._mlp, self._counts, self._probs = mlp, counts, probs
        self._fc1s, self._fc2s = fc1s, fc2s

    def __getattr__(self, name: str):  # anything else MLP.forward reads (other releases): expert 0's
        return getattr(self.__dict__["_first"], name)

    def linear_fc1(self, x: torch.Tensor):
        return self._linear("fc1", self._fc1s, x), _bias_rows(self._fc1s, self._expert)

    def linear_fc2(self, x: torch.Tensor):
        out = self._linear("fc2", self._fc2s, x)
        bias = _bias_rows(self._fc2s, self._expert)
        if bias is not None:  # what MLP.forward does with an expert's fc2 bias and its per-token scale
            out += bias * self._probs.unsqueeze(-1)
        return out, None

    def _linear(self, key: str, linears: list, x: torch.Tensor) -> torch.Tensor:
        x = quantize_rows([lin.input_quantizer for lin in linears], x, self._expert, self._counts)
        params = tuple(lin.weight for lin in linears)
        w = stacked_fake_quant(self._mlp, ("stacked", key), [lin.weight_quantizer for lin in linears], params,
                               lambda: torch.stack(params), lambda e: linears[e].quantize_weight(params[e]))
        # (E, out, in) -> the (E, in, out) operand: x @ W^T per expert, as Megatron's matmul(x, weight.t())
        return grouped_mm(x, w.transpose(1, 2), self._offs)


def _bias_rows(linears: list, expert: torch.Tensor) -> Optional[torch.Tensor]:
    """Each row's expert's bias (rows, out), or None without biases."""
    if linears[0].bias is None:
        return None
    return torch.stack([lin.bias for lin in linears])[expert]


def grouped_forward(mlp: nn.Module, fc1s: list, fc2s: list, x: torch.Tensor, tokens_per_expert: torch.Tensor,
                    probs: torch.Tensor) -> tuple[torch.Tensor, None]:
    """SequentialMLP's ``(output, None)`` for ``x`` (rows sorted by local expert, ``tokens_per_expert`` rows
    each) through every expert's grouped GEMMs (after :func:`grouped_refusal` said it can)."""
    # Megatron's allgather dispatcher hands the counts on the host: copied without waiting for the stream
    counts = tokens_per_expert.to(x.device, non_blocking=True)
    output, _ = MLP.forward(_Experts(mlp, fc1s, fc2s, counts, probs, x.shape[0]), x, probs)
    return output, None


__all__ = ["grouped_forward", "grouped_refusal"]
