"""Stacked experts planned whole for the RL weight sync (quantlib.export.expert_stacks): one plan item and one cast
per fused-experts projection, and a stream byte for byte the per-expert plan's (names, shard ids, keys, dtypes,
shapes, strides, bytes; TP shards; vLLM's flat and nested names)."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

import quantlib as ql  # noqa: E402
from quantlib import kernels  # noqa: E402
from quantlib.export import ExportError, iter_packed, layout_for, serialize_weight, sync_pairs  # noqa: E402
from quantlib.export.expert_stacks import stacked_items  # noqa: E402
from quantlib.export.iterate import iter_plan  # noqa: E402
from quantlib.export.modules import ModuleWalk  # noqa: E402
from quantlib.export.plan import make_plan  # noqa: E402
from quantlib.export.sync_scales import apply_scales, as_scales  # noqa: E402
from quantlib.export.vllm_names import named_pairs  # noqa: E402
from quantlib.export.writers import as_format, packer  # noqa: E402
from tests.test_export._byte_count import ByteCount  # noqa: E402
from tests.test_export._export_models import E, quantized, qwen3_moe, weight_only  # noqa: E402

FP8_BLOCK = weight_only(ql.FP8_2D_BLOCKWISE_WEIGHT_ONLY_CFG)
CFG = {"hf_fp8_block": FP8_BLOCK, "ct_fp8_block": FP8_BLOCK, "hf_mxfp8": ql.MXFP8_DEFAULT_CFG, "ct_mxfp8": ql.MXFP8_DEFAULT_CFG,
       "modelopt_nvfp4": weight_only(ql.NVFP4_DEFAULT_CFG)}


def mixtral(seed: int = 0) -> torch.nn.Module:
    """A one-layer Mixtral (checkpoint name ``block_sparse_moe.experts``) of 3 experts of 256: TP2 shards whole 128-blocks."""
    from transformers import MixtralConfig, MixtralForCausalLM

    torch.manual_seed(seed)
    cfg = MixtralConfig(vocab_size=256, hidden_size=256, intermediate_size=256, num_hidden_layers=1, num_attention_heads=2,
                        num_key_value_heads=2, num_local_experts=3, num_experts_per_tok=2, max_position_embeddings=64,
                        tie_word_embeddings=False)
    return MixtralForCausalLM(cfg).eval()


@pytest.fixture(scope="module")
def models():
    return {}


def model_of(models: dict, family: str, fmt: str) -> torch.nn.Module:
    key = (family, id(CFG[fmt]))
    if key not in models:
        models[key] = quantized(qwen3_moe() if family == "qwen3_moe" else mixtral(), CFG[fmt])
    return models[key]


def per_expert(model: torch.nn.Module, fmt: str, tp: int = 1, rank: int = 0, scales: str = "dynamic") -> list:
    """The stream the stacked plan replaces: every expert planned, cast and packed alone, then stacked per shard."""
    mw = ModuleWalk(model)
    source = as_scales(scales)
    plan = make_plan(model, packer(fmt), layout_for(model, mw), unify_siblings=source.value == "dynamic", tp=tp, modules=mw)
    assert sum(it.role == "expert" for it in plan.items) > 3  # per expert
    plan.items = apply_scales(plan.items, source)
    return list(iter_plan(plan, as_format(fmt), stacked=True, tp=(rank, tp)))


def assert_same(ours: list[tuple[str, torch.Tensor]], ref: list[tuple[str, torch.Tensor]]) -> None:
    assert [k for k, _ in ours] == [k for k, _ in ref]
    for (key, a), (_, b) in zip(ours, ref):
        assert (a.dtype, a.shape, a.stride(), a.device) == (b.dtype, b.shape, b.stride(), b.device), key
        assert torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8)), key


def flat(stream: list) -> list[tuple[str, torch.Tensor]]:
    return [(f"{pw.name}|{pw.role}|{pw.shard}|{k}", t) for pw in stream for k, t in pw.tensors.items()]


def test_stacked_plan_has_one_item_per_projection_and_casts_no_more_than_a_shard(monkeypatch):
    model = quantized(qwen3_moe(), FP8_BLOCK)
    mw = ModuleWalk(model)
    plan = make_plan(model, packer("hf_fp8_block"), layout_for(model, mw), modules=mw, stacks=stacked_items)
    experts = [(it.name, it.leaf, [p[1] for p in it.parts], it.experts) for it in plan.items if it.role == "expert"]
    assert experts == [(f"model.layers.{i}.mlp.experts", proj, shards, E) for i in range(2)
                       for proj, shards in (("gate_up_proj", ["w1", "w3"]), ("down_proj", ["w2"]))]
    casts = []
    real = kernels.fp8_blockwise_cast
    monkeypatch.setattr(kernels, "fp8_blockwise_cast", lambda x, *a, **k: casts.append(tuple(x.shape)) or real(x, *a, **k))
    pairs = dict(sync_pairs(model, "hf_fp8_block"))
    # the sync joins w1 and w3 into w13: gate_up_proj cast whole (its shards are whole 128-row blocks), down_proj whole
    assert [s for s in casts if len(s) == 3] == [(E, 256, 256), (E, 256, 128)] * 2
    assert len(casts) == 2 * 2 + 2 * 4  # and the four attention linears of each layer
    assert pairs["model.layers.1.mlp.experts.w13_weight"].shape == (E, 256, 256)
    casts.clear()
    list(iter_packed(model, "hf_fp8_block", experts="stacked", scales="dynamic"))
    # iter_packed yields w1 and w3 apart, each contiguous: their rows are strided in the stack (a group of experts a call, here one)
    assert [s for s in casts if len(s) == 3] == ([(1, 128, 256)] * 2 * E + [(E, 256, 128)]) * 2


def test_formats_without_stacked_packing_keep_per_expert_items():
    model = quantized(qwen3_moe(), weight_only(ql.NVFP4_DEFAULT_CFG))  # NVFP4's global amax is each expert's own
    mw = ModuleWalk(model)
    plan = make_plan(model, packer("modelopt_nvfp4"), layout_for(model, mw), modules=mw, stacks=stacked_items)
    assert sum(it.role == "expert" for it in plan.items) == 2 * E * 3 and not any(it.parts for it in plan.items)


@pytest.mark.parametrize("family, fmt, slack", [("qwen3_moe", "hf_fp8_block", 1.1), ("mixtral", "hf_mxfp8", 1.1),
                                                ("qwen3_moe", "modelopt_nvfp4", 2)])
def test_stacked_sync_holds_about_one_shard(models, family, fmt, slack):
    """Peak bytes the sync makes while it produces each expert shard, the consumer dropping each before the next: the
    shard's own tensors and one group of experts' (here one expert's) codes and cast temporaries, not the projection's
    codes (was 3-4x) nor, for the per-expert items of NVFP4, every expert's packed tensors besides their stack (2-3x)."""
    model, peaks = model_of(models, family, fmt), []
    with torch.no_grad(), ByteCount() as live:
        for pw in iter_packed(model, fmt, experts="stacked", scales="dynamic"):
            peaks.append((pw.shard, pw.nbytes, live.peak))
            del pw
            live.peak = live.now
    experts = model.model.layers[0].mlp.experts.num_experts
    shards = [(s, n, peak) for s, n, peak in peaks if s in ("w1", "w3", "w2")]
    assert [s for s, _, _ in shards] == ["w1", "w3", "w2"] * len(model.model.layers)
    for shard, n, peak in shards:
        assert n <= peak <= n * (1 + slack / experts), (shard, n, peak)  # + a group's packed tensors (and raw scales)


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral"])
@pytest.mark.parametrize("fmt", ["hf_fp8_block", "ct_fp8_block", "hf_mxfp8"])
@pytest.mark.parametrize("scales", ["dynamic", "calibrated"])
def test_stacked_stream_equals_the_per_expert_stream(models, family, fmt, scales):
    model = model_of(models, family, fmt)
    assert_same(flat(iter_packed(model, fmt, experts="stacked", scales=scales)), flat(per_expert(model, fmt, scales=scales)))


@pytest.mark.parametrize("fmt", ["hf_fp8_block", "ct_mxfp8"])
@pytest.mark.parametrize("rank", [0, 1])
def test_stacked_tp_shards_equal_the_per_expert_shards(models, fmt, rank):
    model = model_of(models, "mixtral", fmt)  # experts of 256: a TP2 shard is whole 128-row / 128-column blocks
    ours = flat(iter_packed(model, fmt, experts="stacked", tp=2, tp_rank=rank))
    assert_same(ours, flat(per_expert(model, fmt, tp=2, rank=rank)))


@pytest.mark.parametrize("style", ["flat", "nested"])
def test_sync_pairs_names_equal_the_per_expert_ones(models, style):
    model = model_of(models, "qwen3_moe", "hf_mxfp8")
    assert_same(list(sync_pairs(model, "hf_mxfp8", expert_names=style)), list(named_pairs(iter(per_expert(model, "hf_mxfp8")), style)))


def test_stacked_refusal_names_the_expert():
    model = quantized(qwen3_moe(), FP8_BLOCK)
    model.model.layers[1].mlp.experts.down_proj_weight_quantizer[2].amax.fill_(float("nan"))
    with pytest.raises(ExportError, match=r"model\.layers\.1\.mlp\.experts\.down_proj_weight_quantizer\[2\]: amax holds NaN") as info:
        list(sync_pairs(model, "hf_fp8_block", scales="calibrated"))
    assert info.value.__context__ is None  # the per-expert plan's message alone


@pytest.mark.parametrize("fmt", ["hf_fp8_block", "hf_mxfp8"])
@pytest.mark.parametrize("scales", ["dynamic", "static", "calibrated"])
def test_serialize_weight_casts_a_batch_of_experts_once(models, fmt, scales, monkeypatch):
    model = model_of(models, "qwen3_moe", fmt)
    experts = model.model.layers[1].mlp.experts
    name, w, wq = "model.layers.1.mlp.experts.down_proj", experts.down_proj, experts.down_proj_weight_quantizer
    ref: dict[str, list] = {}
    for e in range(E):  # each expert alone, then stacked: what the batched call returned before
        for k, t in serialize_weight(name, w[e], wq[e], fmt, input_quantizer=experts.down_proj_input_quantizer, scales=scales):
            ref.setdefault(k, []).append(t)
    cast = "mx_cast" if fmt == "hf_mxfp8" else "fp8_blockwise_cast"
    calls, real = [], getattr(kernels, cast)
    monkeypatch.setattr(kernels, cast, lambda x, *a, **k: calls.append(tuple(x.shape)) or real(x, *a, **k))
    ours = list(serialize_weight(name, w, experts, fmt, batched_experts=True, scales=scales))
    assert calls == [(E, 256, 128)]
    assert_same(ours, [(k, torch.stack(v)) for k, v in ref.items()])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("fmt", ["hf_fp8_block", "hf_mxfp8"])
def test_stacked_stream_on_the_gpu_equals_the_per_expert_stream(models, fmt):
    """The CUDA casts of a 3-D stack: the same bytes as per expert, on the device, and the CPU's."""
    import copy

    model = copy.deepcopy(model_of(models, "mixtral", fmt)).cuda()
    ours = flat(iter_packed(model, fmt, experts="stacked", scales="dynamic"))
    assert_same(ours, flat(per_expert(model, fmt)))
    cpu = flat(iter_packed(model_of(models, "mixtral", fmt), fmt, experts="stacked", scales="dynamic"))
    assert_same([(k, t.cpu()) for k, t in ours], cpu)


def test_a_shared_expert_amax_keeps_per_expert_items():
    """sync_expert_weight_amax: one-block experts share their layer's max amax, which only the per-expert items carry."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(0)
    cfg = Qwen3MoeConfig(vocab_size=256, hidden_size=128, intermediate_size=128, moe_intermediate_size=128, num_hidden_layers=1,
                         num_attention_heads=1, num_key_value_heads=1, head_dim=128, num_experts=3, num_experts_per_tok=2,
                         max_position_embeddings=64, tie_word_embeddings=False)
    model = quantized(Qwen3MoeForCausalLM(cfg).eval(), {**FP8_BLOCK, "sync_expert_weight_amax": True})
    w2 = dict(sync_pairs(model, "hf_fp8_block"))["model.layers.0.mlp.experts.w2_weight_scale_inv"]
    assert w2.shape == (3, 1, 1) and torch.unique(w2).numel() == 1  # one scale: the max over the experts


def test_a_static_block_amax_split_inside_a_block_is_refused():
    """A shard boundary inside a 128-row block of a static per-block amax cannot take its rows of the amax: refused by name."""
    import dataclasses

    from quantlib.export.expert_stacks import shard_tensors

    model = quantized(qwen3_moe(), FP8_BLOCK)
    mw = ModuleWalk(model)
    plan = make_plan(model, packer("hf_fp8_block"), layout_for(model, mw), modules=mw, stacks=stacked_items)
    item = next(it for it in plan.items if it.leaf == "gate_up_proj")
    assert item.amax is not None and item.amax.shape[1] == 2 and not item.spec.dynamic  # one amax per 128 rows
    bad = dataclasses.replace(item, parts=(("gate_up_proj", "w1", 0, 64), ("gate_up_proj", "w3", 64, 256)))
    with pytest.raises(ExportError, match=r"model\.layers\.0\.mlp\.experts\.gate_up_proj_weight_quantizer: static block amax \(4, 2, 2\) "
                                          r"of block \(128, 128\) does not split at the shard rows \[0, 64\) "
                                          r"of the stack \(4, 256, 256\)"):
        list(shard_tensors(bad, packer("hf_fp8_block")))


def test_per_expert_packs_that_do_not_stack_are_refused(monkeypatch):
    """An expert whose packed tensors differ from expert 0's (keys here) is refused naming it, as torch.stack refused."""
    import quantlib.export.iterate as iterate

    model = quantized(qwen3_moe(), weight_only(ql.NVFP4_DEFAULT_CFG))
    real = iterate.pack_item

    def odd(it, *args):
        pw = real(it, *args)
        if it.expert == 2:
            pw.tensors["extra"] = pw.tensors["weight"]
        return pw

    monkeypatch.setattr(iterate, "pack_item", odd)
    with pytest.raises(ExportError, match=r"model\.layers\.0\.mlp\.experts\.gate_up_proj_weight_quantizer\[2\]: packed keys "
                                          r"\['extra', 'weight', 'weight_scale', 'weight_scale_2'\] differ from expert 0's"):
        list(iter_packed(model, "modelopt_nvfp4", experts="stacked"))


def test_a_changed_expert_quantizer_is_seen_by_the_next_stacked_plan():
    """The stacked plan's per-expert check is kept per quantizer group until a member changes (its ``generation``): a
    member disabled, or given a new amax, after a plan shows in the next one."""
    model = quantized(qwen3_moe(), FP8_BLOCK)
    mw = ModuleWalk(model)

    def plan():
        return make_plan(model, packer("hf_fp8_block"), layout_for(model, mw), modules=mw, stacks=stacked_items).items

    group = model.model.layers[1].mlp.experts.down_proj_weight_quantizer
    assert sum(it.role == "expert" for it in plan()) == 4
    group[2].amax = group[2].amax * 2
    down = next(it for it in plan() if it.name == "model.layers.1.mlp.experts" and it.leaf == "down_proj")
    assert torch.equal(down.amax[2], group[2].amax)
    group[2].disable()
    layer1 = [it for it in plan() if it.role == "expert" and it.name.startswith("model.layers.1.")]
    assert len(layer1) == 2 * E + E - 1 and not any(it.parts for it in layer1)  # planned per expert, expert 2's down_proj unquantized
