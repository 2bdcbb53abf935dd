"""torch.compile(fullgraph=True) of whole quantized MoE models (Qwen3-MoE, Mixtral, GPT-OSS; FP8, NVFP4,
INT4 block): one graph, no recompile when the next batch routes its tokens elsewhere, the outputs of eager
bit for bit. Graph capture with the "aot_eager" backend (which runs the fake kernels of every op); the
experts of one case compiled for real with inductor."""

from __future__ import annotations

import pytest
import torch

T = pytest.importorskip("transformers", reason="needs transformers (pip install quantlib[transformers])")

import quantlib as ql  # noqa: E402
from quantlib.plugins import huggingface as hf  # noqa: E402

from .test_hf_experts_layouts import _COMMON, FAMILIES, input_ids  # noqa: E402

pytestmark = pytest.mark.slow

MODELS = {
    "qwen3_moe": FAMILIES["qwen3_moe"],
    "gpt_oss": FAMILIES["gpt_oss"],
    "mixtral": (T.MixtralConfig, T.MixtralForCausalLM, dict(_COMMON, intermediate_size=16, num_local_experts=4, num_experts_per_tok=2)),
}
PRESETS = ["FP8_DEFAULT_CFG", "NVFP4_DEFAULT_CFG", "INT4_BLOCKWISE_WEIGHT_ONLY_CFG"]


@pytest.fixture(autouse=True)
def fresh_dynamo():
    hf.refresh()
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def quantized(family: str, preset: str) -> torch.nn.Module:
    """A one-layer model of ``family``, calibrated on one batch."""
    cfg_cls, model_cls, fields = MODELS[family]
    fields = dict(fields, num_hidden_layers=1, experts_implementation="eager")
    if "layer_types" in fields:
        fields["layer_types"] = fields["layer_types"][:1]
    torch.manual_seed(0)
    model = model_cls(cfg_cls(**fields)).eval()
    return ql.quantize(model, ql.PRESETS[preset], lambda m: m(input_ids(seed=5)))


def _check(model: torch.nn.Module, backend: str) -> None:
    with torch.no_grad():
        compiled = torch.compile(model, fullgraph=True, backend=backend)
        first = compiled(input_ids(seed=1)).logits
        with torch.compiler.set_stance("fail_on_recompile"):  # another routing: same graph
            second = compiled(input_ids(seed=2)).logits
        assert torch.equal(first, model(input_ids(seed=1)).logits)
        assert torch.equal(second, model(input_ids(seed=2)).logits)


@pytest.mark.parametrize("preset", PRESETS)
@pytest.mark.parametrize("family", list(MODELS))
def test_fullgraph_compile_serves_every_routing_and_equals_eager(family, preset):
    _check(quantized(family, preset), "aot_eager")


def test_inductor_compile_of_quantized_experts_equals_eager():
    """Inductor's code for the whole model rounds attention and norms its own way; the experts module
    (routing, fake quant, grouped GEMMs, activation, combine) keeps eager's bits."""
    experts = [m for m in quantized("qwen3_moe", "FP8_DEFAULT_CFG").modules() if hasattr(m, "_grouped_forward")]
    m = experts[0]
    g = torch.Generator().manual_seed(0)
    compiled = torch.compile(m, fullgraph=True)
    with torch.no_grad():
        for step in range(2):
            idx = torch.stack([torch.randperm(m.num_experts, generator=g)[:2] for _ in range(16)])
            w, h = torch.rand(16, 2, generator=g), torch.randn(16, m.down_proj.shape[1], generator=g)
            with torch.compiler.set_stance("fail_on_recompile" if step else "default"):
                assert torch.equal(compiled(h, idx, w), m(h, idx, w))
