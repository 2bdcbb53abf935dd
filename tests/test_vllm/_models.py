"""The quantize configs each export format takes in the vLLM tests, and more families next to tests/test_export's tiny
Llama and Qwen3-MoE: Qwen2 (q / k / v biases), Phi-3 and GLM-4 (q/k/v or gate/up fused in their checkpoints),
Qwen2-MoE (a shared expert beside the routed ones, q/k/v biases), Mixtral (experts w1 / w3 / w2 under
block_sparse_moe), OLMoE (q/k norms over all heads), GLM-4 MoE (shared experts, a router bias, grouped top-k) and
ERNIE 4.5 MoE (a shared expert, the router bias under moe_statics)."""

from __future__ import annotations

import copy

import torch
from torch import nn

import quantlib as ql
from quantlib.presets import preset
from tests.test_export._export_models import INTER, MOE_INTER, E, H, llama, qwen3_moe, scale_experts, weight_only

#: W8A8 INT8 with dynamic per-token activations: the INT8 scheme vLLM's compressed-tensors MoE takes
INT8_DYNAMIC = copy.deepcopy(ql.INT8_DEFAULT_CFG)
INT8_DYNAMIC["quant_cfg"]["*input_quantizer"] = {"num_bits": 8, "block_sizes": {-1: None, "type": "dynamic"}}
FP8_POW2 = preset({"num_bits": (4, 3), "block_sizes": {-1: 128, -2: 128}, "pow2_scale": True})
#: export format -> the quantize config whose quantizers it carries (with activations where vLLM's scheme needs them)
CONFIGS = {
    "hf_fp8_block": weight_only(ql.FP8_2D_BLOCKWISE_WEIGHT_ONLY_CFG),
    "hf_fp8_block_ue8m0": FP8_POW2,
    "hf_mxfp8": weight_only(ql.MXFP8_DEFAULT_CFG),
    "ct_fp8_block": ql.FP8_BLOCKWISE_CFG,
    "ct_mxfp8": weight_only(ql.MXFP8_DEFAULT_CFG),
    "ct_mxfp4": weight_only(ql.MXFP4_DEFAULT_CFG),
    "ct_nvfp4": ql.NVFP4_DEFAULT_CFG,
    "ct_int_pack": ql.INT4_BLOCKWISE_WEIGHT_ONLY_CFG,
    "ct_int8": INT8_DYNAMIC,
    "modelopt_fp8": ql.FP8_DEFAULT_CFG,
    "modelopt_fp8_pb": weight_only(ql.FP8_2D_BLOCKWISE_WEIGHT_ONLY_CFG),
    "modelopt_nvfp4": ql.NVFP4_DEFAULT_CFG,
    "modelopt_mxfp8": weight_only(ql.MXFP8_DEFAULT_CFG),
}


def _tiny(config: str, model: str, seed: int, **kwargs) -> nn.Module:
    """A 2-layer transformers model of hidden 256 from its class names; a MoE's 4 experts scaled by 2**e (expert e)."""
    import transformers

    torch.manual_seed(seed)
    cfg = getattr(transformers, config)(vocab_size=256, hidden_size=H, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                        max_position_embeddings=64, tie_word_embeddings=False, pad_token_id=None, eos_token_id=None,
                                        experts_implementation="eager", **kwargs)  # fmt: skip  (no family's special ids fit 256)
    out = getattr(transformers, model)(cfg).eval()
    return scale_experts(out) if hasattr(getattr(out.model.layers[0], "mlp", None), "experts") else out


def qwen2_moe(seed: int = 0) -> nn.Module:
    """Qwen2-MoE: 4 experts of 128 and a shared expert of 256."""
    return _tiny("Qwen2MoeConfig", "Qwen2MoeForCausalLM", seed, intermediate_size=INTER, moe_intermediate_size=MOE_INTER,
                 shared_expert_intermediate_size=INTER, num_experts=E, num_experts_per_tok=2)


def mixtral(seed: int = 0) -> nn.Module:
    return _tiny("MixtralConfig", "MixtralForCausalLM", seed, intermediate_size=MOE_INTER, num_local_experts=E, num_experts_per_tok=2)


def olmoe(seed: int = 0) -> nn.Module:
    return _tiny("OlmoeConfig", "OlmoeForCausalLM", seed, intermediate_size=MOE_INTER, num_experts=E, num_experts_per_tok=2)


def glm4_moe(seed: int = 0) -> nn.Module:
    return _tiny("Glm4MoeConfig", "Glm4MoeForCausalLM", seed, intermediate_size=INTER, moe_intermediate_size=MOE_INTER, head_dim=64,
                 n_routed_experts=E, n_shared_experts=1, num_experts_per_tok=2, first_k_dense_replace=0, n_group=1, topk_group=1)


def ernie4_5_moe(seed: int = 0) -> nn.Module:
    return _tiny("Ernie4_5_MoeConfig", "Ernie4_5_MoeForCausalLM", seed, intermediate_size=INTER, moe_intermediate_size=MOE_INTER,
                 moe_num_experts=E, moe_k=2, moe_layer_start_index=0, moe_num_shared_experts=1)


def phi3(seed: int = 0) -> nn.Module:
    """Phi-3: its checkpoint holds q/k/v fused in qkv_proj and gate/up in gate_up_proj."""
    return _tiny("Phi3Config", "Phi3ForCausalLM", seed, intermediate_size=INTER)


def glm4(seed: int = 0) -> nn.Module:
    """GLM-4: gate/up fused in the checkpoint's gate_up_proj, four norms a layer, partial rotary."""
    return _tiny("Glm4Config", "Glm4ForCausalLM", seed, intermediate_size=INTER, head_dim=64)


def qwen2(seed: int = 0) -> nn.Module:
    """Qwen2: q / k / v with biases (random here: transformers initialises them to zero)."""
    model = _tiny("Qwen2Config", "Qwen2ForCausalLM", seed, intermediate_size=INTER)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("_proj.bias"):
                p.normal_(0, 0.5)
    return model


def granitemoe(seed: int = 0) -> nn.Module:
    """GraniteMoE: its checkpoint holds the experts 3-D, rearranged (``input_linear`` / ``output_linear``)."""
    return _tiny("GraniteMoeConfig", "GraniteMoeForCausalLM", seed, intermediate_size=MOE_INTER, num_local_experts=E, num_experts_per_tok=2)


def granitemoeshared(seed: int = 0) -> nn.Module:
    return _tiny("GraniteMoeSharedConfig", "GraniteMoeSharedForCausalLM", seed, intermediate_size=MOE_INTER, num_local_experts=E,
                 num_experts_per_tok=2, shared_intermediate_size=INTER)


def llama4(seed: int = 0) -> nn.Module:
    """Llama-4 text: experts 3-D (E, in, out) in the model and its checkpoint, a shared expert beside them."""
    return _tiny("Llama4TextConfig", "Llama4ForCausalLM", seed, intermediate_size=MOE_INTER, intermediate_size_mlp=INTER,
                 num_local_experts=E, num_experts_per_tok=1, head_dim=64)


def gpt_oss(seed: int = 0) -> nn.Module:
    """GPT-OSS: experts 3-D with biases, gate / up interleaved, kept so in its checkpoint."""
    return _tiny("GptOssConfig", "GptOssForCausalLM", seed, intermediate_size=MOE_INTER, num_local_experts=E, num_experts_per_tok=2,
                 layer_types=["full_attention"] * 2, head_dim=64)


#: families whose checkpoints hold their experts whole (3-D), not per expert
WHOLE_EXPERTS = {"granitemoe": granitemoe, "granitemoeshared": granitemoeshared, "llama4": llama4, "gpt_oss": gpt_oss}
FAMILIES = {"llama": llama, "qwen2": qwen2, "phi3": phi3, "glm4": glm4, "qwen3_moe": qwen3_moe, "qwen2_moe": qwen2_moe, "mixtral": mixtral,
            "olmoe": olmoe, "glm4_moe": glm4_moe, "ernie4_5_moe": ernie4_5_moe}
