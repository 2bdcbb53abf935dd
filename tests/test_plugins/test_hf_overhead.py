"""With every quantizer off, a quantized model runs its original forward: no quantizer is called, no
weight-cache key is computed and no tokens are counted (functional, not timing: see
benchmarks/bench_overhead.py for the times). Real tiny Qwen3-MoE and Llama models."""

from __future__ import annotations

import pytest
import torch

T = pytest.importorskip("transformers", reason="needs transformers (pip install quantlib[transformers])")

import quantlib as ql  # noqa: E402
from quantlib.nn import quant_module  # noqa: E402
from quantlib.nn.tensor_quantizer import TensorQuantizer  # noqa: E402
from quantlib.plugins import expert_tokens, huggingface as hf  # noqa: E402


@pytest.fixture(autouse=True)
def _plugin_sees_the_modeling_modules():
    hf.refresh()


def qwen3_moe() -> torch.nn.Module:
    cfg = T.Qwen3MoeConfig(vocab_size=64, hidden_size=32, intermediate_size=48, moe_intermediate_size=16, num_hidden_layers=2,
                           num_attention_heads=4,
                           num_key_value_heads=2, head_dim=8, num_experts=4, num_experts_per_tok=2,
                           experts_implementation="eager")  # fmt: skip
    torch.manual_seed(0)
    return T.Qwen3MoeForCausalLM(cfg).eval()


def llama() -> torch.nn.Module:
    cfg = T.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                        num_key_value_heads=2, head_dim=8)
    torch.manual_seed(0)
    return T.LlamaForCausalLM(cfg).eval()


def ids(seed: int) -> torch.Tensor:
    return torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(seed))


@pytest.fixture
def calls(monkeypatch):
    """Counts of calls into quantizers, the weight-cache key and token counting."""
    counts = {"quantizer": 0, "cache_key": 0, "tokens": 0}

    def counted(name, fn):
        def wrapper(*args, **kwargs):
            counts[name] += 1
            return fn(*args, **kwargs)

        return wrapper

    monkeypatch.setattr(TensorQuantizer, "forward", counted("quantizer", TensorQuantizer.forward))
    monkeypatch.setattr(quant_module, "_quantizer_token", counted("cache_key", quant_module._quantizer_token))
    monkeypatch.setattr(expert_tokens, "add_tokens", counted("tokens", expert_tokens.add_tokens))
    return counts


@pytest.mark.parametrize("build", [qwen3_moe, llama], ids=["qwen3-moe", "llama"])
def test_every_quantizer_disabled_calls_no_quantizer(build, calls):
    original = build()
    model = ql.quantize(build(), ql.FP8_DEFAULT_CFG, lambda m: m(ids(1)))
    assert ql.disable_quantizer(model, "*") > 0
    for k in calls:
        calls[k] = 0
    with torch.no_grad():
        out = model(ids(2)).logits
        assert torch.equal(out, original(ids(2)).logits)
    assert calls == {"quantizer": 0, "cache_key": 0, "tokens": 0}


def test_tokens_are_counted_only_while_calibrating(calls):
    model = ql.quantize(qwen3_moe(), ql.FP8_DEFAULT_CFG, lambda m: m(ids(1)))
    assert calls["tokens"] == 2  # one calibration forward, two MoE layers
    before = [m.tokens_per_expert.clone() for _, m in model.named_modules() if hasattr(m, "tokens_per_expert")]
    with torch.no_grad():
        model(ids(2))
    assert calls["tokens"] == 2 and calls["quantizer"] > 0
    after = [m.tokens_per_expert for _, m in model.named_modules() if hasattr(m, "tokens_per_expert")]
    assert all(torch.equal(a, b) for a, b in zip(before, after))
