"""Writes the frozen schema-4 golden checkpoint of tests/test_kv/test_probs_checkpoint.py (an old
checkpoint, written before attention modules had a ``p_bmm_quantizer``, must still restore). Kept for the
record: ``v4_llama.pt`` and ``v4_llama_weights.pt`` were produced once by running it with quantlib at
schema 4 (the main checkout at commit b19d9e0, torch 2.13, transformers 5.25, CPU):
``PYTHONPATH=<quantlib at schema 4> python tests/data/write_v4_golden.py``. Do not regenerate them for a
new schema; add new golden files instead.

The model (``build()``): a one-layer transformers Llama (hidden 32, 2 query heads, 1 key/value head,
head dim 16, vocabulary 32) whose weights are stored in ``v4_llama_weights.pt``, so that the model does
not depend on transformers' initialisation; ``CONFIG``: FP8 weights and inputs with FP8 keys and values.
"""

from __future__ import annotations

import os

import torch

HERE = os.path.dirname(os.path.abspath(__file__))


def config() -> dict:
    """FP8_DEFAULT_CFG with FP8_KV_CFG merged in (ModelOpt's combination)."""
    import quantlib as ql

    return ql.merge_kv_config(ql.FP8_DEFAULT_CFG, ql.FP8_KV_CFG)


def build(weights: bool = True) -> torch.nn.Module:
    """The golden Llama (eager attention), with the stored weights unless ``weights=False``."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        vocab_size=32, hidden_size=32, intermediate_size=16, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1, head_dim=16,
        max_position_embeddings=32
    )
    cfg._attn_implementation = "eager"
    model = LlamaForCausalLM(cfg).eval()
    if weights:
        model.load_state_dict(torch.load(os.path.join(HERE, "v4_llama_weights.pt"), weights_only=True))
    return model


def calibration_data() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(20261204)
    return [torch.randint(0, 32, (2, 8), generator=g) for _ in range(3)]


def main() -> None:
    import quantlib as ql
    from quantlib.checkpoint import SCHEMA_VERSION

    assert SCHEMA_VERSION == 4, f"run with quantlib at schema 4, got {SCHEMA_VERSION}"
    torch.manual_seed(4)
    model = build(weights=False)
    torch.save(model.state_dict(), os.path.join(HERE, "v4_llama_weights.pt"))
    data = calibration_data()
    with torch.no_grad():
        ql.quantize(model, config(), lambda m: [m(x) for x in data])
    ql.save(model, os.path.join(HERE, "v4_llama.pt"))


if __name__ == "__main__":
    main()
