"""Megatron-Core's Transformer Engine wrappers and a TE-spec MoE GPT (TEGroupedMLP experts) quantized on
one GPU (TP = EP = 1) with real TE: outputs equal the fake-quant reference through the same TE GEMM,
per-GEMM amax from each expert's own weight, calibration through a real forward loop, the dist
checkpoint round trip (which loads through the load-state-dict hooks Megatron registers on its grouped
linears: conversion must rebind them) and QAT. Skipped without a GPU, TE's binding or Megatron-Core."""

from __future__ import annotations

import functools

import pytest
import torch

import quantlib as ql
from quantlib.model_quant import iter_leaf_quantizers
from tests.test_plugins import te_gpu

pytestmark = [pytest.mark.gpu, pytest.mark.te, pytest.mark.megatron]
te_gpu.require_megatron_te()

from megatron.core import dist_checkpointing  # noqa: E402
from megatron.core.extensions import transformer_engine as mte  # noqa: E402
from megatron.core.transformer import TransformerConfig  # noqa: E402

from quantlib.plugins import megatron as qm  # noqa: E402

IN, OUT, GEMMS = 256, 128, 4
SPLITS = [96, 32, 0, 128]
DTYPE = torch.bfloat16
ROLES = {
    "TELinear": "replicated",
    "TEColumnParallelLinear": "column",
    "TERowParallelLinear": "row",
    "TELayerNormColumnParallelLinear": "column",
    "TEColumnParallelGroupedLinear": "column",
    "TERowParallelGroupedLinear": "row",
}


@pytest.fixture(scope="module", autouse=True)
def tp1():
    created = te_gpu.init_megatron_tp1()
    yield
    te_gpu.release_megatron(created)


def _config(**overrides) -> TransformerConfig:
    kwargs = dict(num_layers=1, hidden_size=IN, num_attention_heads=4, bf16=True, params_dtype=DTYPE, use_cpu_initialization=False,
                  add_bias_linear=True, hidden_dropout=0.0, attention_dropout=0.0)  # fmt: skip
    kwargs.update(overrides)
    return TransformerConfig(**kwargs)


def build(name: str, seed: int = 0) -> torch.nn.Module:
    """Megatron's TE wrapper ``name`` at TP=1, seeded; grouped GEMM i's weight scaled by 2**i."""
    torch.manual_seed(seed)
    cfg = _config()
    init = functools.partial(torch.nn.init.normal_, std=0.05)
    common = dict(config=cfg, init_method=init, skip_bias_add=False)
    cls = getattr(mte, name)
    if name == "TELinear":
        m = cls(IN, OUT, parallel_mode="duplicated", bias=True, skip_weight_param_allocation=False, **common)
    elif name in ("TEColumnParallelLinear", "TELayerNormColumnParallelLinear"):
        m = cls(IN, OUT, gather_output=False, bias=True, is_expert=False, **common)
    elif name == "TERowParallelLinear":
        m = cls(IN, OUT, bias=True, input_is_parallel=True, is_expert=False, **common)
    else:
        m = cls(GEMMS, IN, OUT, bias=False, is_expert=True, **common)
        with torch.no_grad():
            for i in range(GEMMS):
                getattr(m, f"weight{i}").mul_(2.0**i)
    return m.cuda()


def batches(name: str, n: int, seed: int = 1) -> list[tuple]:
    g = torch.Generator(device="cuda").manual_seed(seed)
    xs = [torch.randn(sum(SPLITS), IN, device="cuda", dtype=DTYPE, generator=g) * (1 + k) for k in range(n)]
    return [(x, SPLITS) if "Grouped" in name else (x,) for x in xs]


def loop(data):
    def forward_loop(model):
        for args in data:
            model(*args)

    return forward_loop


@pytest.mark.parametrize("preset", sorted(te_gpu.PRESETS))
@pytest.mark.parametrize("name", sorted(ROLES))
def test_wrapper_output_equals_fake_quant_reference_through_the_same_gemm(name, preset):
    model = ql.quantize(build(name), te_gpu.PRESETS[preset], loop(batches(name, 2)))
    assert type(model).__name__ == f"Quant{name}" and model.parallel_role == ROLES[name]
    enabled = [q for _, q in iter_leaf_quantizers(model) if q.is_enabled]
    assert enabled
    for args in batches(name, 2, seed=9):
        with torch.no_grad():
            out = te_gpu.first(model(*args))
        ref = te_gpu.reference_output(model, lambda: build(name, seed=4), name == "TELayerNormColumnParallelLinear", *args)
        assert torch.equal(out, ref), f"{name} {preset}: max diff {(out.float() - ref.float()).abs().max().item()}"


@pytest.mark.parametrize("name", ["TEColumnParallelGroupedLinear", "TERowParallelGroupedLinear", "TELayerNormColumnParallelLinear"])
def test_wrapper_dist_checkpoint_round_trip(name, tmp_path):
    """Save and load through Megatron's dist checkpointing: the grouped linears' load hooks (registered
    with ``with_module=True``) run on the converted module."""
    data = batches(name, 2)
    model = ql.quantize(build(name), ql.NVFP4_DEFAULT_CFG, loop(data))
    dist_checkpointing.save(model.sharded_state_dict(), str(tmp_path))
    fresh = qm.restore_quantizer_config(build(name, seed=8), str(tmp_path))
    fresh.load_state_dict(dist_checkpointing.load(fresh.sharded_state_dict(), str(tmp_path)))
    for (n, a), (_, b) in zip(iter_leaf_quantizers(model), iter_leaf_quantizers(fresh)):
        assert (a.amax is None and b.amax is None) or torch.equal(a.amax, b.amax), n
    with torch.no_grad():
        assert torch.equal(te_gpu.first(fresh(*data[0])), te_gpu.first(model(*data[0])))


# ------------------------------------------------------------------------------------ GPT with TEGroupedMLP

VOCAB, SEQ = 64, 16


def build_gpt(seed: int = 0):
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_with_transformer_engine_spec
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
    from megatron.core.transformer.module import Float16Module

    torch.manual_seed(seed)
    model_parallel_cuda_manual_seed(seed)
    cfg = _config(
        num_layers=2, hidden_size=64, ffn_hidden_size=128, num_attention_heads=4, num_moe_experts=4, moe_router_topk=2,
        moe_ffn_hidden_size=64, add_bias_linear=False, moe_grouped_gemm=True, moe_token_dispatcher_type="allgather",
        transformer_impl="transformer_engine",
    )  # fmt: skip
    spec = get_gpt_layer_with_transformer_engine_spec(num_experts=4, moe_grouped_gemm=True)
    gpt = GPTModel(config=cfg, transformer_layer_spec=spec, vocab_size=VOCAB, max_sequence_length=SEQ)
    # as Megatron trains a bf16 model: the wrapper casts every parameter and floating input to bf16 (the bare
    # GPTModel fed TE's LayerNormLinear fp32 activations against bf16 norm weights on the H200, 2026-12-03)
    return Float16Module(cfg, gpt).cuda().eval()


def _tokens(n: int, seed: int) -> list[torch.Tensor]:
    g = torch.Generator(device="cuda").manual_seed(seed)
    return [torch.randint(0, VOCAB, (2, SEQ), device="cuda", generator=g) for _ in range(n)]


def _run(model, tokens, **kwargs):
    b, s = tokens.shape
    return model(tokens, torch.arange(s, device="cuda").expand(b, s), attention_mask=None, **kwargs)


def gpt_loop(tokens):
    def forward_loop(model):
        for t in tokens:
            _run(model, t)

    return forward_loop


@pytest.mark.parametrize("preset", ["fp8", "nvfp4", "int4_block", "w4a8"])
def test_te_gpt_moe_quantizes_calibrates_and_round_trips(preset, tmp_path):
    model = ql.quantize(build_gpt(), te_gpu.PRESETS[preset], gpt_loop(_tokens(3, 1)))
    kinds = {type(m).__name__ for m in model.modules() if isinstance(m, ql.QuantModule)}
    assert {"QuantTELayerNormColumnParallelLinear", "QuantTERowParallelLinear", "QuantTEColumnParallelGroupedLinear",
            "QuantTERowParallelGroupedLinear"} <= kinds
    assert any(type(m).__name__ == "TEGroupedMLP" for m in model.modules())
    enabled = [(n, q) for n, q in iter_leaf_quantizers(model) if q.is_enabled and q.needs_calibration]
    assert enabled
    for n, q in enabled:
        assert q.amax is None or bool(torch.isfinite(q.amax).all()), n
    # every expert's weight quantizer calibrated from its own weight, whether tokens reached it or not
    for name, m in model.named_modules():
        if type(m).__name__.endswith("GroupedLinear") and isinstance(m, ql.QuantModule):
            for i, member in enumerate(m.weight_quantizer):
                alone = torch.nn.Linear(m.in_features, m.out_features, bias=False, device="cuda", dtype=DTYPE)
                with torch.no_grad():
                    alone.weight.copy_(getattr(m, f"weight{i}"))
                # max calibration (grouped experts keep max under AWQ) through one batch: static input
                # quantizers need one; only the weight amax is compared
                x = torch.randn(4, m.in_features, device="cuda", dtype=DTYPE)
                alone = ql.quantize(alone, {**te_gpu.PRESETS[preset], "algorithm": "max"}, lambda lin, x=x: lin(x))
                got, expected = te_gpu.leaf_amaxes(member), te_gpu.leaf_amaxes(alone.weight_quantizer)
                assert got and len(got) == len(expected)
                for a, b in zip(got, expected):
                    assert (a is None and b is None) or torch.equal(a, b), (name, i)
    dist_checkpointing.save(model.sharded_state_dict(), str(tmp_path))
    fresh = qm.restore_quantizer_config(build_gpt(seed=5), str(tmp_path))
    fresh.load_state_dict(dist_checkpointing.load(fresh.sharded_state_dict(), str(tmp_path)))
    for (n, a), (_, b) in zip(iter_leaf_quantizers(model), iter_leaf_quantizers(fresh)):
        assert (a.amax is None and b.amax is None) or torch.equal(a.amax, b.amax), n
    t = _tokens(1, 2)[0]
    with torch.no_grad():
        assert torch.equal(_run(model, t), _run(fresh, t))


def test_te_gpt_moe_qat_steps_reduce_the_loss():
    model = ql.quantize(build_gpt(), ql.FP8_DEFAULT_CFG, gpt_loop(_tokens(2, 1)))
    t = _tokens(1, 3)[0]
    labels = torch.roll(t, -1, dims=1)
    losses = te_gpu.qat_losses(model, lambda m: _run(m, t, labels=labels).float().mean(), steps=8, lr=3e-3)
    assert losses[-1] < 0.9 * losses[0], losses
    experts = [m for m in model.modules() if type(m).__name__ == "QuantTEColumnParallelGroupedLinear"]
    assert experts and any(getattr(experts[0], f"weight{i}").grad is not None for i in range(experts[0].num_gemms))


def test_te_gpt_moe_export_writes_each_grouped_gemm_as_its_expert(tmp_path):
    """TEGroupedMLP's GEMM i is global expert i under Llama / Qwen3-MoE names, as SequentialMLP's."""
    from safetensors.torch import load_file

    from quantlib.export.megatron_export import export_megatron_checkpoint
    from quantlib.formats.nvfp4 import nvfp4_dequantize

    cfg = {"quant_cfg": {"*weight_quantizer": ql.NVFP4_DEFAULT_CFG["quant_cfg"]["*weight_quantizer"], "*router*": {"enable": False},
                         "default": {"enable": False}}, "algorithm": "max"}
    model = ql.quantize(build_gpt(), cfg, gpt_loop(_tokens(2, 1)))
    export_megatron_checkpoint(model, str(tmp_path / "out"), "modelopt_nvfp4", hf_config={})
    sd = load_file(str(tmp_path / "out" / "model.safetensors"))
    checked = 0
    for i, layer in enumerate(model.module.decoder.layers):
        fc1 = ("gate_proj", "up_proj") if model.module.config.gated_linear_unit else ("up_proj",)
        for which, leaves in (("linear_fc1", fc1), ("linear_fc2", ("down_proj",))):
            lin = getattr(layer.mlp.experts, which)
            for j in range(lin.num_gemms):
                with torch.no_grad():
                    fq = lin.weight_quantizer[j](getattr(lin, f"weight{j}"))
                for leaf, part in zip(leaves, fq.chunk(len(leaves))):
                    name = f"model.layers.{i}.mlp.experts.{j}.{leaf}"
                    got = nvfp4_dequantize(sd[f"{name}.weight"], sd[f"{name}.weight_scale"], sd[f"{name}.weight_scale_2"], part.shape[1])
                    assert torch.equal(got.to(part.dtype).cpu(), part.cpu()), name
                    checked += 1
    assert checked == 2 * 4 * (len(fc1) + 1)
    for key in ("model.embed_tokens.weight", "model.layers.0.input_layernorm.weight", "model.layers.1.mlp.gate.weight",
                "model.layers.0.self_attn.q_proj.weight"):
        assert key in sd, key
