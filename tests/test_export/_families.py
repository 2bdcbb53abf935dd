"""Tiny transformers models of many families (hidden 64, 1 layer, 4 experts, random init, no downloads)."""

from __future__ import annotations

import torch
from torch import nn

H, I, V, E = 64, 64, 128, 4  # noqa: E741  (I: the intermediate size, as in the model configs)
_COMMON = dict(vocab_size=V, hidden_size=H, intermediate_size=I, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
               head_dim=32, max_position_embeddings=64)
_MOE = dict(num_experts_per_tok=2, moe_intermediate_size=I)
#: family -> (config class, model class, config kwargs); names as in ``transformers``
FAMILIES = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", {}),
    "mistral": ("MistralConfig", "MistralForCausalLM", {}),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {}),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", {}),
    "gemma": ("GemmaConfig", "GemmaForCausalLM", {}),
    "qwen2_moe": ("Qwen2MoeConfig", "Qwen2MoeForCausalLM", dict(_MOE, num_experts=E, shared_expert_intermediate_size=I)),
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", dict(_MOE, num_experts=E)),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM", dict(num_local_experts=E, num_experts_per_tok=2)),
    "phimoe": ("PhimoeConfig", "PhimoeForCausalLM", dict(num_local_experts=E, num_experts_per_tok=2)),
    "gpt_oss": ("GptOssConfig", "GptOssForCausalLM", dict(num_local_experts=E, num_experts_per_tok=2, layer_types=["full_attention"])),
    "deepseek_v3": ("DeepseekV3Config", "DeepseekV3ForCausalLM", dict(_MOE, n_routed_experts=E, n_shared_experts=1, first_k_dense_replace=0,
                                                                      n_group=1, topk_group=1,
                                                                      head_dim=16, q_lora_rank=32, kv_lora_rank=32, qk_rope_head_dim=16,
                                                                      qk_nope_head_dim=16, v_head_dim=32)),
}  # fmt: skip


def build(family: str, tie: bool = False, seed: int = 0, **overrides) -> nn.Module:
    """A tiny ``family`` causal LM in eval mode (experts run eager, as the quantized model computes them);
    ``overrides`` replace config fields (e.g. ``hidden_size=128`` for formats with blocks of 128)."""
    import transformers

    cfg_cls, model_cls, extra = FAMILIES[family]
    kwargs = {**_COMMON, **extra, "tie_word_embeddings": tie, **overrides}
    if family in FAMILIES and any(k in extra for k in ("num_experts", "num_local_experts", "n_routed_experts")):
        kwargs["experts_implementation"] = "eager"
    torch.manual_seed(seed)
    model = getattr(transformers, model_cls)(getattr(transformers, cfg_cls)(**kwargs)).eval()
    with torch.no_grad():  # parameters of different magnitudes: a shared or a neighbour's scale shows
        for i, p in enumerate(model.parameters()):
            if p.dim() >= 2:
                p.mul_(1.0 + 0.37 * (i % 5))
    return model


def gpt2(tie: bool = True, seed: int = 0) -> nn.Module:
    """A tiny GPT-2 (``Conv1D`` linears, fused ``c_attn``)."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(seed)
    return GPT2LMHeadModel(GPT2Config(vocab_size=V, n_embd=H, n_layer=1, n_head=2, n_positions=64, tie_word_embeddings=tie)).eval()


def tokens(seed: int = 3) -> torch.Tensor:
    return torch.randint(0, V, (2, 8), generator=torch.Generator().manual_seed(seed))
