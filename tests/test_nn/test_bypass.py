"""A module whose training forward reads a quantized child's weight without calling the child (transformers' Mamba
mixers: a direct product, or mamba_ssm's fused kernels) raises, naming the child, instead of training it unquantized."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import quantlib as ql
from quantlib.nn import bypass

W8 = {"quant_cfg": {"*weight_quantizer": {"num_bits": 8, "axis": 0}, "*input_quantizer": {"enable": False}}, "algorithm": "max"}


class Mamba2Mixer(nn.Module):
    """Stands in for transformers' Mamba2Mixer (the guard goes by class name): in training, out_proj's weight goes to a
    'fused kernel' (here F.linear on the weight), as mamba_ssm's path does; in eval, out_proj is called."""

    def __init__(self):
        super().__init__()
        self.in_proj = nn.Linear(16, 16)
        self.out_proj = nn.Linear(16, 16)

    def forward(self, x):
        h = self.in_proj(x)
        return F.linear(h, self.out_proj.weight, self.out_proj.bias) if self.training else self.out_proj(h)


def model():
    torch.manual_seed(0)
    return nn.Sequential(Mamba2Mixer(), nn.Linear(16, 16))


def test_training_forward_that_skips_a_quantized_child_raises_naming_it():
    m = ql.quantize(model(), W8, lambda m: m(torch.randn(4, 16)))
    m.eval()(torch.randn(4, 16))  # eval calls out_proj: fine
    with pytest.raises(RuntimeError, match=r"Mamba2Mixer: its training forward read the weights of \['out_proj'\] without calling"):
        m.train()(torch.randn(4, 16))
    twin = copy.deepcopy(m)  # the hooks hold names, so a copy checks its own children
    with pytest.raises(RuntimeError, match="out_proj"):
        twin(torch.randn(4, 16))
    ql.disable_quantizer(m, "*out_proj*")
    m(torch.randn(4, 16)).sum().backward()  # nothing quantized is skipped now


def test_guard_hooks_once():
    m = ql.quantize(model(), W8, lambda m: m(torch.randn(4, 16)))
    assert bypass.guard(m) == 0  # convert hooked it already
    ql.quantize(m, W8, lambda m: m(torch.randn(4, 16)))  # quantize again: still one set of hooks
    assert len(m[0]._forward_hooks) == 1 and len(m[0].out_proj._forward_pre_hooks) == 1


def _quantized_lm(model: nn.Module) -> tuple[nn.Module, torch.Tensor]:
    """``model`` (a tiny transformers LM of vocabulary 64) quantized W8 and in training mode, and token ids to run it on."""
    torch.manual_seed(0)
    ids = torch.randint(0, 64, (2, 8))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return ql.quantize(model, W8, lambda m: m(ids)).train(), ids


def test_transformers_mamba_trains_only_without_a_quantized_dt_proj():
    transformers = pytest.importorskip("transformers")
    if not hasattr(transformers, "MambaConfig"):
        pytest.skip("this transformers has no Mamba")
    cfg = transformers.MambaConfig(vocab_size=64, hidden_size=32, num_hidden_layers=1, state_size=8, expand=1, time_step_rank=32,
                                   use_mambapy=False)
    m, ids = _quantized_lm(transformers.MambaForCausalLM(cfg))
    with pytest.raises(RuntimeError, match=r"MambaMixer: its training forward read the weights of \['dt_proj'\]"):
        m(ids)
    ql.disable_quantizer(m, "*dt_proj*")
    m(ids).logits.sum().backward()


@pytest.mark.parametrize("sliced", [False, True])
def test_transformers_bloom_with_sliced_tensor_parallel_reads_its_output_projections(sliced):
    """BLOOM with pretraining_tp > 1 and slow_but_exact multiplies by slices of dense / dense_4h_to_h's weights: guarded
    then (a QAT step raises naming dense), not otherwise."""
    transformers = pytest.importorskip("transformers")
    cfg = transformers.BloomConfig(vocab_size=64, hidden_size=32, n_layer=1, n_head=2, pretraining_tp=2 if sliced else 1,
                                   slow_but_exact=sliced)
    m, ids = _quantized_lm(transformers.BloomForCausalLM(cfg))
    if not sliced:
        m(ids).logits.sum().backward()
        return
    with pytest.raises(RuntimeError, match=r"BloomAttention: its training forward read the weights of \['dense'\]"):
        m(ids)
    ql.disable_quantizer(m, "*self_attention.dense*")
    with pytest.raises(RuntimeError, match=r"BloomMLP: its training forward read the weights of \['dense_4h_to_h'\]"):
        m(ids)
    ql.disable_quantizer(m, "*dense_4h_to_h*")
    m(ids).logits.sum().backward()
