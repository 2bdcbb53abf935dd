"""Tiny transformers models (hidden 256, 2 layers, no downloads), quantized, and the weights quantlib's
fake quantization gives them, keyed by checkpoint name."""

from __future__ import annotations

import copy

import torch
from torch import nn

import quantlib as ql
from quantlib.plugins import huggingface as hf

H, INTER, MOE_INTER, E = 256, 256, 128, 4


def weight_only(preset: dict) -> dict:
    """``preset`` with its input quantizers off (consumers on the CPU dequantize weights, never activations); its
    other rules (routers, gates, convolutions and lm_head left unquantized) kept."""
    cfg = copy.deepcopy(preset)
    cfg["quant_cfg"] = {k: ({"enable": False} if k == "*input_quantizer" else v) for k, v in cfg["quant_cfg"].items()}
    return cfg


def llama(seed: int = 0) -> nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=256, hidden_size=H, intermediate_size=INTER, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=False)
    return LlamaForCausalLM(cfg).eval()


def qwen3_moe(seed: int = 0, layers: int = 2) -> nn.Module:
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(seed)
    cfg = Qwen3MoeConfig(vocab_size=256, hidden_size=H, intermediate_size=INTER, moe_intermediate_size=MOE_INTER, num_hidden_layers=layers,
                         num_attention_heads=4, num_key_value_heads=2,
                         head_dim=64, num_experts=E, num_experts_per_tok=2, max_position_embeddings=64, tie_word_embeddings=False,
                         experts_implementation="eager")  # fmt: skip
    return scale_experts(Qwen3MoeForCausalLM(cfg).eval())


@torch.no_grad()
def scale_experts(model: nn.Module) -> nn.Module:
    """Expert e's weights times 2**e in every MoE layer: a shared or a neighbour's amax shows."""
    for layer in model.model.layers:
        for e in range(E):
            layer.mlp.experts.gate_up_proj[e].mul_(2.0**e)
            layer.mlp.experts.down_proj[e].mul_(2.0**e)
    hf.refresh()
    return model


def tokens(seed: int = 3) -> torch.Tensor:
    return torch.randint(0, 256, (2, 12), generator=torch.Generator().manual_seed(seed))


def quantized(model: nn.Module, cfg: dict, lm_head: bool = False, share_siblings: bool = True) -> nn.Module:
    """A quantized copy; siblings (q/k/v, gate/up) share their per-tensor amax unless ``share_siblings`` is False."""
    from quantlib.export import share_sibling_amax

    model = copy.deepcopy(model)
    ids = tokens(5) % model.config.vocab_size  # the same ids for the 256-token models, in range for smaller ones (GPT-2's 128)
    ql.quantize(model, cfg, lambda m: m(ids))
    if not lm_head:
        ql.disable_quantizer(model, "*lm_head*")
    if share_siblings:
        share_sibling_amax(model)
    return model


@torch.no_grad()
def fake_quant_weights(model: nn.Module) -> dict[str, torch.Tensor]:
    """Checkpoint name -> the weight quantlib's forward uses (fp32), for every quantized weight."""
    out = {}
    for name, m in model.named_modules():
        if isinstance(m, hf.QuantFusedExperts):
            for proj in m.projections:
                for e in range(m.num_experts):
                    w = m.quantize_weight(hf.expert_weight(m, proj, e), f"{proj}_weight_quantizer", e)
                    if proj == "gate_up_proj":
                        half = w.shape[0] // 2
                        out[f"{name}.{e}.gate_proj"], out[f"{name}.{e}.up_proj"] = w[:half], w[half:]
                    else:
                        out[f"{name}.{e}.{proj}"] = w
        elif isinstance(m, ql.QuantModule) and hasattr(m, "weight") and m.weight_quantizer.is_enabled:
            out[name] = m.quantize_weight(m.weight)
    return out


def loaded_weights(model: nn.Module, names) -> dict[str, torch.Tensor]:
    """The weights a loaded transformers model holds under our checkpoint names (experts from its fused tensors)."""
    out = {}
    for name in names:
        parts = name.split(".")
        if parts[-1] in ("gate_proj", "up_proj", "down_proj") and parts[-3] == "experts":
            experts = model.get_submodule(".".join(parts[:-2]))
            e = int(parts[-2])
            if parts[-1] == "down_proj":
                out[name] = experts.down_proj[e]
            else:
                gu = experts.gate_up_proj[e]
                half = gu.shape[0] // 2
                out[name] = gu[:half] if parts[-1] == "gate_proj" else gu[half:]
        else:
            out[name] = model.get_submodule(name).weight
    return out


@torch.no_grad()
def reference_codes(model: nn.Module, name: str) -> torch.Tensor:
    """Codes of checkpoint module ``name`` by quantlib's reference formulas (quantlib.formats.quantize)."""
    from quantlib.formats import quantize

    parts = name.split(".")
    if len(parts) > 3 and parts[-3] == "experts":
        experts, e, leaf = model.get_submodule(".".join(parts[:-2])), int(parts[-2]), parts[-1]
        proj = "down_proj" if leaf == "down_proj" else "gate_up_proj"
        q = getattr(experts, f"{proj}_weight_quantizer")[e]
        codes = quantize(hf.expert_weight(experts, proj, e), q.spec, q.amax).codes
        if proj == "gate_up_proj":
            half = codes.shape[0] // 2
            codes = codes[:half] if leaf == "gate_proj" else codes[half:]
        return codes
    m = model.get_submodule(name)
    return quantize(m.weight, m.weight_quantizer.spec, m.weight_quantizer.amax).codes


def bit_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit-equal tensors of one dtype and shape (signed zeros and NaN payloads told apart)."""
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))
