"""A tiny GPT-OSS (transformers' own classes, no downloads) and its MXFP4-quantized experts, for format
``openai_mxfp4``'s transformers and vLLM tests."""

from __future__ import annotations

import copy
import warnings

import torch
from torch import nn

import quantlib as ql
from tests.test_export._families import tokens

E, H, INTER = 4, 64, 96  # I != H: a transposed or halved gate_up / down shows in the shapes and the logits


def gpt_oss(layers: int = 2, dtype: torch.dtype = torch.float32, seed: int = 0) -> nn.Module:
    """A tiny GPT-OSS (sliding and full attention, 4 experts with biases), weights of different magnitudes."""
    from transformers import GptOssConfig, GptOssForCausalLM

    torch.manual_seed(seed)
    cfg = GptOssConfig(
        vocab_size=128, hidden_size=H, intermediate_size=INTER, num_hidden_layers=layers, num_attention_heads=2, num_key_value_heads=1,
        head_dim=32, num_local_experts=E, num_experts_per_tok=2, max_position_embeddings=64, sliding_window=8, tie_word_embeddings=False,
        layer_types=["sliding_attention", "full_attention"][:layers], experts_implementation="eager",
    )  # fmt: skip
    model = GptOssForCausalLM(cfg).eval()
    with torch.no_grad():
        for i, p in enumerate(model.parameters()):
            p.mul_(1.0 + 0.37 * (i % 5))
    return model.to(dtype)


def quantized(model: nn.Module, cfg: dict = ql.MXFP4_MLP_WEIGHT_ONLY_CFG) -> nn.Module:
    """A quantized copy of ``model`` (default: MXFP4 weights of the MLP, here the experts), calibrated on a few tokens."""
    model = copy.deepcopy(model)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ql.quantize(model, cfg, lambda m: m(tokens(5)))
    return model
