"""The Hugging Face ``config.json`` of a Megatron-Core ``GPTModel``: the transformers family whose modules compute
what the Megatron model computes (Llama, Qwen2, Qwen3, Qwen2-MoE, Qwen3-MoE), or a refusal naming the Megatron
setting no such family has (then pass ``hf_config=``)."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from .types import ExportError

_DTYPES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


def _require(ok: bool, what: str) -> None:
    if not ok:
        raise ExportError(
            f"Megatron config {what}: no transformers family computes this; pass hf_config= (the config.json entries) to export it"
        )


def _family(c: Any, shared: bool) -> str:
    qkv_bias, all_bias = bool(c.add_qkv_bias or c.add_bias_linear), bool(c.add_bias_linear)
    if c.num_moe_experts:
        if shared:
            _require(c.moe_shared_expert_gate, "moe_shared_expert_gate=False (Qwen2-MoE gates its shared expert)")
            _require(not all_bias and not c.qk_layernorm, "with shared experts and add_bias_linear / qk_layernorm (Qwen2-MoE has neither)")
            return "qwen2_moe"
        _require(c.qk_layernorm and not qkv_bias, "MoE without shared experts needs qk_layernorm and no biases (Qwen3-MoE)")
        return "qwen3_moe"
    if c.qk_layernorm:
        _require(not qkv_bias, "qk_layernorm with biases (Qwen3 has none)")
        return "qwen3"
    if qkv_bias and not all_bias:
        return "qwen2"
    return "llama"


_ARCH = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "qwen2_moe": "Qwen2MoeForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
}


def megatron_hf_config(model: nn.Module) -> dict:
    """config.json entries (without ``quantization_config``) of the transformers model that computes what
    Megatron ``model`` (an unwrapped GPTModel) computes; ExportError naming the setting it cannot carry."""
    import torch.nn.functional as F

    c = model.config
    shared = bool(c.num_moe_experts and c.moe_shared_expert_intermediate_size)
    _require(c.normalization == "RMSNorm", f"normalization={c.normalization!r}")
    _require(
        bool(c.gated_linear_unit) and c.activation_func is F.silu, "activation (SwiGLU: gated_linear_unit=True, activation_func=F.silu)"
    )
    _require(
        getattr(model, "position_embedding_type", "rope") == "rope" and not c.rotary_interleaved,
        "position embedding (rope, not interleaved)",
    )
    _require(float(getattr(model, "rotary_percent", 1.0)) == 1.0, f"rotary_percent={getattr(model, 'rotary_percent', None)}")
    family = _family(c, shared)
    heads = c.num_attention_heads
    out: dict = {
        "architectures": [_ARCH[family]], "model_type": family, "vocab_size": int(model.vocab_size), "hidden_size": c.hidden_size,
        "intermediate_size": c.ffn_hidden_size, "num_hidden_layers": c.num_layers, "num_attention_heads": heads,
        "num_key_value_heads": c.num_query_groups or heads, "head_dim": c.kv_channels or c.hidden_size // heads, "hidden_act": "silu",
        "max_position_embeddings": int(model.max_sequence_length), "rms_norm_eps": c.layernorm_epsilon,
        "tie_word_embeddings": bool(model.share_embeddings_and_output_weights),
        "rope_parameters": {"rope_type": "default", "rope_theta": float(getattr(model, "rotary_base", 10000))},
        "attention_dropout": 0.0, "dtype": _DTYPES.get(c.params_dtype, "float32"),
    }  # fmt: skip
    if family == "llama":
        out.update(attention_bias=bool(c.add_bias_linear), mlp_bias=bool(c.add_bias_linear))
    elif family == "qwen2_moe":
        out["qkv_bias"] = bool(c.add_qkv_bias)
    elif family in ("qwen3", "qwen3_moe"):
        out["attention_bias"] = False
    if c.num_moe_experts:
        _require(c.moe_router_score_function == "softmax", f"moe_router_score_function={c.moe_router_score_function!r}")
        freq = c.moe_layer_freq
        pattern = [1 if i % freq == 0 else 0 for i in range(c.num_layers)] if isinstance(freq, int) else list(freq)
        out.update(num_experts=c.num_moe_experts, num_experts_per_tok=c.moe_router_topk, moe_intermediate_size=c.moe_ffn_hidden_size,
                   norm_topk_prob=not c.moe_router_pre_softmax, decoder_sparse_step=1,
                   mlp_only_layers=[i for i, m in enumerate(pattern) if not m])  # fmt: skip
        if shared:
            out["shared_expert_intermediate_size"] = c.moe_shared_expert_intermediate_size
    return out
