"""The in-memory Megatron-Core sync (quantlib.export.megatron_sync) on 4 gloo ranks: the parts every rank yields
at TP2, EP2 and TP2xEP2, gathered and put together here, equal the TP1 stream tensor for tensor, bit for bit,
for a dense GPT with biases on every linear and a MoE GPT with q/k/v biases, a gated shared expert and stacked
experts; output layer quantized. Weight-only configs: activation amax differ in last bits between layouts."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("psutil")
pytest.importorskip("megatron.core")
import quantlib as ql  # noqa: E402
from quantlib.export.megatron_whole import join_tp  # noqa: E402
from tests.test_export._export_models import bit_equal  # noqa: E402
from tests.test_plugins import megatron_shims as shims  # noqa: E402

pytestmark = [pytest.mark.megatron, pytest.mark.distributed]


def weight_only(preset: dict) -> dict:
    """``preset``'s weight quantizer alone (router off, output layer on)."""
    return {
        "quant_cfg": {
            "*weight_quantizer": preset["quant_cfg"]["*weight_quantizer"],
            "*router*": {"enable": False},
            "default": {"enable": False},
        },
        "algorithm": "max",
    }


#: NVFP4 (a global amax MAX-reduced over TP and shared by q/k/v and gate/up) and INT8 per channel (row amax of
#: row-parallel weights reduced over TP)
CASES = {"modelopt_nvfp4": weight_only(ql.NVFP4_DEFAULT_CFG), "ct_int8": weight_only(ql.INT8_WEIGHT_ONLY_CFG)}
MOE = dict(gated_linear_unit=True, normalization="RMSNorm", activation_func=torch.nn.functional.silu, add_qkv_bias=True,
           moe_shared_expert_intermediate_size=32, moe_shared_expert_gate=True)  # fmt: skip
DENSE = dict(num_moe_experts=None, moe_ffn_hidden_size=None, gated_linear_unit=True, normalization="RMSNorm",
             activation_func=torch.nn.functional.silu, add_bias_linear=True)  # fmt: skip


def build(tp: int, ep: int, overrides: dict):
    """The 2-layer GPT of ``overrides`` at the current layout, weights independent of the layout (``tied``: the
    output layer tied to the embedding)."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    moe = overrides.get("num_moe_experts", 4) is not None
    spec = get_gpt_layer_local_spec(num_experts=4 if moe else None, moe_grouped_gemm=False, normalization="RMSNorm",
                                    qk_layernorm=overrides.get("qk_layernorm", False))  # fmt: skip
    overrides = dict(overrides)
    tied = overrides.pop("tied", False)
    config = shims.gpt_config(tp, ep, **overrides)
    model = GPTModel(config=config, transformer_layer_spec=spec, vocab_size=shims.VOCAB, max_sequence_length=shims.SEQ,
                     position_embedding_type="rope", share_embeddings_and_output_weights=tied).eval()  # fmt: skip
    shims.init_global_weights(model, 0)
    return model


def quantized(tp: int, ep: int, overrides: dict, cfg: dict):
    from megatron.core import parallel_state as mpu

    model = build(tp, ep, overrides)
    dp, dp_rank = mpu.get_data_parallel_world_size(), mpu.get_data_parallel_rank()
    ql.quantize(model, cfg, shims.forward_loop(shims.token_batches(4, 1)[dp_rank::dp]), parallel_state=ql.ParallelState.from_megatron())
    return model


def _streams(rank: int, world: int, layouts: tuple, overrides: dict, kwargs: dict, cases: dict = CASES, whole: bool = False) -> dict:
    """Per (layout, format): this rank's parts with replica 0, as (name, tensor, splits); ``whole``: through
    :func:`~quantlib.export.megatron_whole.whole_tensors`."""
    from quantlib.export.megatron_sync import megatron_sync_tensors
    from quantlib.export.megatron_whole import whole_tensors

    out = {}
    for layout in layouts:
        tp, ep = shims.LAYOUTS[layout]
        shims.set_layout(tp, ep)
        for fmt, cfg in cases.items():
            model = quantized(tp, ep, overrides, cfg)
            parts = megatron_sync_tensors(model, fmt, **kwargs)
            parts = list(whole_tensors(parts) if whole else parts)
            out[(layout, fmt)] = [(p.name, p.tensor.clone(), p.splits) for p in parts if p.replica == 0]
    return out


def _join(name: str, parts: list) -> torch.Tensor:
    """The whole tensor from its parts: tensor-parallel pieces along their axis (stacked w13: the gate pieces,
    then the up pieces, as vLLM narrows them), then the expert-parallel pieces of stacked experts (axis 0)."""
    leaf = name.rpartition(".")[2]
    stacked = leaf.startswith(("w13_", "w2_"))
    outer: dict[int, list] = {}
    for t, splits in parts:
        ep = [s for s in splits if stacked and s.axis == 0]
        tp = [s for s in splits if not (stacked and s.axis == 0)]
        outer.setdefault(ep[0].part if ep else 0, []).append((t, tp))
    pieces = []
    for key in sorted(outer):
        inner = sorted(outer[key], key=lambda ts: ts[1][0].part if ts[1] else 0)
        if not inner[0][1]:
            assert len(inner) == 1, name
            pieces.append(inner[0][0])
            continue
        pieces.append(join_tp(name, [t for t, _ in inner], inner[0][1][0].axis))
    return pieces[0] if len(pieces) == 1 else torch.cat(pieces, 0)


def joined(per_rank: list[list]) -> dict[str, torch.Tensor]:
    """name -> whole tensor from every rank's replica-0 parts (each part held once)."""
    by_name: dict[str, list] = {}
    for parts in per_rank:
        for name, t, splits in parts:
            by_name.setdefault(name, []).append((t, splits))
    for name, parts in by_name.items():
        places = [tuple((s.axis, s.part) for s in splits) for _, splits in parts]
        assert len(set(places)) == len(places), f"{name}: a part held twice with replica 0: {places}"
    return {name: _join(name, parts) for name, parts in by_name.items()}


def check_layouts(results: list[dict], layouts: tuple, cases: dict = CASES) -> list[str]:
    bad = []
    for fmt in cases:
        ref = joined([r[("tp1", fmt)] for r in results[:1]])
        for layout in layouts[1:]:
            got = joined([r[(layout, fmt)] for r in results])
            if set(got) != set(ref):
                bad.append(f"{layout} {fmt}: names differ: {sorted(set(got) ^ set(ref))[:6]}")
            bad += [f"{layout} {fmt} {k}" for k in sorted(ref) if k in got and not bit_equal(got[k], ref[k])]
    return bad


def _moe_streams(rank: int, world: int) -> dict:
    return _streams(rank, world, ("tp1", "tp2", "ep2", "tp2ep2"), MOE, {})


def test_moe_stream_at_tp2_ep2_tp2ep2_equals_tp1():
    results = shims.run_distributed(_moe_streams, 4, timeout=400)
    ref = joined([results[0][("tp1", "modelopt_nvfp4")]])
    # the names of what vLLM loads: q/k/v split with biases, stacked experts, Qwen2-MoE's shared expert, lm_head
    for key in ("model.layers.0.self_attn.q_proj.weight", "model.layers.0.self_attn.k_proj.bias", "model.layers.1.mlp.experts.w13_weight",
                "model.layers.1.mlp.experts.w2_weight_scale", "model.layers.0.mlp.shared_expert.gate_proj.weight",
                "model.layers.0.mlp.shared_expert.down_proj.weight_scale_2", "model.layers.0.mlp.shared_expert_gate.weight",
                "model.layers.0.mlp.gate.weight", "lm_head.weight", "lm_head.weight_scale", "model.embed_tokens.weight",
                "model.norm.weight"):  # fmt: skip
        assert key in ref, key
    assert ref["model.layers.1.mlp.experts.w13_weight"].shape == (4, 64, 16)  # [E, 2I, H/2] packed
    assert check_layouts(results, ("tp1", "tp2", "ep2", "tp2ep2")) == []


def _dense_streams(rank: int, world: int) -> dict:
    return _streams(rank, world, ("tp1", "tp2"), DENSE, {})


def test_dense_stream_with_biases_at_tp2_equals_tp1():
    results = shims.run_distributed(_dense_streams, 4, timeout=300)
    ref = joined([results[0][("tp1", "ct_int8")]])
    for key in ("model.layers.0.self_attn.q_proj.bias", "model.layers.0.self_attn.o_proj.bias", "model.layers.0.mlp.gate_proj.bias",
                "model.layers.0.mlp.up_proj.bias", "model.layers.0.mlp.down_proj.bias", "lm_head.weight_scale"):  # fmt: skip
        assert key in ref, key
    assert not any("linear_" in k for k in ref)
    assert check_layouts(results, ("tp1", "tp2")) == []


def _grow(model, factor: float = 3.0) -> None:
    """An optimizer step that moved every weight past its calibrated amax (the same on every layout)."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("weight") and "norm" not in name:
                p.mul_(factor)


def _grown(rank: int, world: int) -> dict:
    """Dynamic scales after the weights grew: the TP2xEP2 parts against TP1; static scales refused on every
    rank, and a refusal on one rank's shard alone raised on all (no rank left in a collective)."""
    from quantlib.export import ExportError
    from quantlib.export.megatron_sync import megatron_sync_tensors

    out: dict = {}
    for layout in ("tp1", "tp2ep2"):
        tp, ep = shims.LAYOUTS[layout]
        shims.set_layout(tp, ep)
        model = quantized(tp, ep, MOE, CASES["modelopt_nvfp4"])
        trained = {n: p.detach().clone() for n, p in model.named_parameters()}
        _grow(model)
        out[(layout, "dynamic")] = [
            (p.name, p.tensor.clone(), p.splits) for p in megatron_sync_tensors(model, "modelopt_nvfp4") if p.replica == 0
        ]
        for which in ("static", "one rank"):
            if which == "one rank":
                with torch.no_grad():
                    for n, p in model.named_parameters():
                        p.copy_(trained[n])
                if rank == 0:
                    _grow(model.decoder.layers[1].self_attention.linear_proj, 3.0)
            try:
                list(megatron_sync_tensors(model, "modelopt_nvfp4", scales="static"))
                out[(layout, which)] = "not refused"
            except ExportError as exc:
                out[(layout, which)] = str(exc)
    return out


def test_dynamic_scales_after_growth_and_static_refusal_on_every_rank():
    results = shims.run_distributed(_grown, 4, timeout=300)
    ref = joined([results[0][("tp1", "dynamic")]])
    got = joined([r[("tp2ep2", "dynamic")] for r in results])
    assert sorted(got) == sorted(ref) and [k for k in ref if not bit_equal(got[k], ref[k])] == []
    # the weights grew 3x: the packed global scale follows them (ModelOpt's weight_scale_2 = amax / 2688)
    w = results[0][("tp1", "dynamic")]
    assert any(n == "lm_head.weight_scale_2" for n, _, _ in w)
    for r in results:
        assert "outgrown its calibrated scale" in r[("tp2ep2", "static")]
        assert "outgrown" in r[("tp1", "one rank")]
    assert "decoder.layers.1.self_attention.linear_proj.weight_quantizer" in results[0][("tp2ep2", "one rank")]
    assert "refused on rank 0" in results[1][("tp2ep2", "one rank")], results[1][("tp2ep2", "one rank")]


#: one global amax for all experts of a layer (per projection), MAX-reduced over the expert and expert-tensor groups
SHARED_AMAX = {"modelopt_nvfp4": {**CASES["modelopt_nvfp4"], "sync_expert_weight_amax": True}}


def _per_expert_streams(rank: int, world: int) -> dict:
    return _streams(rank, world, ("tp1", "tp2ep2", "ep4"), MOE, {"experts": "per_expert"}, SHARED_AMAX)


def test_per_expert_stream_with_shared_expert_amax_at_tp2ep2_and_ep4_equals_tp1():
    results = shims.run_distributed(_per_expert_streams, 4, timeout=300)
    assert check_layouts(results, ("tp1", "tp2ep2", "ep4"), SHARED_AMAX) == []
    ref = joined([results[0][("tp1", "modelopt_nvfp4")]])
    scales = [ref[f"model.layers.0.mlp.experts.{e}.{leaf}.weight_scale_2"] for e in range(4) for leaf in ("gate_proj", "up_proj")]
    assert all(bit_equal(s, scales[0]) for s in scales)  # gate and up of every expert: one global scale
    assert not any(".w13_" in k for k in ref)


def _tied(rank: int, world: int) -> dict:
    from quantlib.export import ExportError
    from quantlib.export.megatron_sync import megatron_sync_tensors

    shims.set_layout(2, 1)
    out = {}
    try:  # (a sigmoid router with an expert bias: DeepSeek-V3 style routing, no Qwen-MoE name)
        model = quantized(2, 1, {**MOE, "moe_router_score_function": "sigmoid", "moe_router_enable_expert_bias": True}, CASES["ct_int8"])
        out["expert bias"] = str(len(list(megatron_sync_tensors(model, "ct_int8"))))
    except ExportError as exc:
        out["expert bias"] = str(exc)
    for name in ("output off", "output on"):
        model = quantized(2, 1, {**DENSE, "tied": True}, ql.INT8_WEIGHT_ONLY_CFG)
        if name == "output on":  # (calibration refuses it: the tied output layer holds no weight of its own)
            ql.enable_quantizer(model, "*output_layer.weight_quantizer")
        try:
            out[name] = sorted({p.name for p in megatron_sync_tensors(model, "ct_int8")})
        except ExportError as exc:
            out[name] = str(exc)
    return out


def test_tied_output_layer_is_the_embedding_and_refused_quantized_and_router_expert_bias_refused():
    """HF ties lm_head to the embedding: nothing sent for it; quantized, the Megatron model would compute with a
    quantized copy that the receiver never gets, so that is refused on every rank."""
    for out in shims.run_distributed(_tied, 2, timeout=200):
        assert "output_layer.weight_quantizer: enabled on an output layer tied" in out["output on"]
        assert "decoder.layers.0.mlp.router.expert_bias: " in out["expert bias"], out["expert bias"]
        assert "model.embed_tokens.weight" in out["output off"] and not any(k.startswith("lm_head") for k in out["output off"])


def _whole_streams(rank: int, world: int) -> dict:
    return _streams(rank, world, ("tp1", "tp2", "tp2ep2"), MOE, {}, whole=True)


def test_whole_tensors_at_tp2_and_tp2ep2_equal_tp1():
    """For a receiver of another TP degree: the TP parts gathered into whole tensors, experts still one part per
    expert-parallel rank."""
    results = shims.run_distributed(_whole_streams, 4, timeout=400)
    assert check_layouts(results, ("tp1", "tp2", "tp2ep2")) == []
    for layout in ("tp2", "tp2ep2"):
        splits = {s.group for r in results for _, _, ss in r[(layout, "modelopt_nvfp4")] for s in ss}
        assert splits == (set() if layout == "tp2" else {"expert"}), (layout, splits)
