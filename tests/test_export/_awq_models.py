"""AWQ / SmoothQuant-calibrated tiny models (Llama with GQA or MHA, Qwen3, OPT) that the fold and ModelOpt AWQ export
tests share; no consumer imported here, so a test of one consumer does not skip with another's absence."""

from __future__ import annotations

import torch

import quantlib as ql
from quantlib.export import share_pre_quant_scale, share_sibling_amax
from tests.test_export._export_models import tokens


def _llama(kv_heads: int = 2):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=kv_heads,
                      max_position_embeddings=64, tie_word_embeddings=False)  # fmt: skip
    return LlamaForCausalLM(cfg).eval()


def _qwen3():
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(1)
    cfg = Qwen3Config(vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=32,
                      max_position_embeddings=64, tie_word_embeddings=False)  # fmt: skip
    return Qwen3ForCausalLM(cfg).eval()


def _opt():
    from transformers import OPTConfig, OPTForCausalLM

    torch.manual_seed(2)
    cfg = OPTConfig(vocab_size=256, hidden_size=128, ffn_dim=256, num_hidden_layers=2, num_attention_heads=4, max_position_embeddings=64,
                    word_embed_proj_dim=128)
    return OPTForCausalLM(cfg).eval()


FAMILIES = {"llama": _llama, "llama_mha": lambda: _llama(4), "qwen3": _qwen3, "opt": _opt}


def _loop(model):
    model(tokens(5))


def _calibrated(family: str, cfg: dict, share: bool = True):
    model = FAMILIES[family]()
    ql.quantize(model, cfg, _loop)
    ql.disable_quantizer(model, "*lm_head*")
    if share:
        share_pre_quant_scale(model, _loop)
        share_sibling_amax(model)
    return model
