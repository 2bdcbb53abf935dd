"""RL weight sync: serialize_weight (per tensor, also batched experts), iter_packed(experts="stacked")
in vLLM's fused-MoE layout (whole at TP1; at tp=2 each rank's shard, the two tiling the TP1 tensors),
chunking by a byte budget."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

import quantlib as ql  # noqa: E402
from quantlib.export import ExportError, chunk_by_bytes, iter_packed, serialize_weight  # noqa: E402
from quantlib.formats.fp8_blockwise import fp8_blockwise_dequantize  # noqa: E402
from quantlib.formats.reference import fake_quant  # noqa: E402
from tests.test_export._export_models import bit_equal, fake_quant_weights, llama, quantized, qwen3_moe, weight_only  # noqa: E402

FP8_BLOCK = weight_only(ql.FP8_2D_BLOCKWISE_WEIGHT_ONLY_CFG)


@pytest.fixture(scope="module")
def moe():
    return quantized(qwen3_moe(), FP8_BLOCK)


def test_serialize_weight_equals_iter_packed():
    model = quantized(llama(), FP8_BLOCK)
    packed = {p.name: p for p in iter_packed(model, "hf_fp8_block")}
    q_proj = model.model.layers[1].self_attn.q_proj
    pairs = dict(serialize_weight("model.layers.1.self_attn.q_proj.weight", q_proj.weight, q_proj.weight_quantizer, "hf_fp8_block"))
    ref = packed["model.layers.1.self_attn.q_proj"].tensors
    assert sorted(pairs) == ["model.layers.1.self_attn.q_proj.weight", "model.layers.1.self_attn.q_proj.weight_scale_inv"]
    assert torch.equal(pairs["model.layers.1.self_attn.q_proj.weight"].view(torch.uint8), ref["weight"].view(torch.uint8))
    assert torch.equal(pairs["model.layers.1.self_attn.q_proj.weight_scale_inv"], ref["weight_scale_inv"])


def test_serialize_weight_batched_experts(moe):
    experts = moe.model.layers[0].mlp.experts
    pairs = dict(serialize_weight("model.layers.0.mlp.experts.gate_up_proj", experts.gate_up_proj, experts.gate_up_proj_weight_quantizer,
                                  "hf_fp8_block", batched_experts=True))
    codes = pairs["model.layers.0.mlp.experts.gate_up_proj.weight"]
    scales = pairs["model.layers.0.mlp.experts.gate_up_proj.weight_scale_inv"]
    assert codes.shape == (4, 256, 256) and scales.shape == (4, 2, 2)
    fq = fake_quant_weights(moe)
    for e in range(4):
        ref = torch.cat([fq[f"model.layers.0.mlp.experts.{e}.gate_proj"], fq[f"model.layers.0.mlp.experts.{e}.up_proj"]])
        assert torch.equal(fp8_blockwise_dequantize(codes[e], scales[e], (128, 128)), ref)


def test_stacked_experts_in_vllm_layout(moe):
    stacked = [p for p in iter_packed(moe, "hf_fp8_block", experts="stacked") if p.role == "expert"]
    assert [(p.name, p.shard) for p in stacked[:3]] == [("model.layers.0.mlp.experts", "w1"), ("model.layers.0.mlp.experts", "w3"),
                                                        ("model.layers.0.mlp.experts", "w2")]
    w1, w3, w2 = (p.tensors for p in stacked[:3])
    assert sorted(w1) == ["w13_weight", "w13_weight_scale_inv"] and w1["w13_weight"].shape == (4, 128,
                                                                                               256) and w2["w2_weight"].shape == (4, 256,
                                                                                                                                  128)
    fq = fake_quant_weights(moe)
    for e in range(4):
        # what vLLM's w13 holds after loading shard w1 into rows [0, I) and w3 into [I, 2I)
        w13 = torch.cat([fp8_blockwise_dequantize(w1["w13_weight"][e], w1["w13_weight_scale_inv"][e], (128, 128)),
                         fp8_blockwise_dequantize(w3["w13_weight"][e], w3["w13_weight_scale_inv"][e], (128, 128))])
        assert torch.equal(w13, torch.cat([fq[f"model.layers.0.mlp.experts.{e}.gate_proj"], fq[f"model.layers.0.mlp.experts.{e}.up_proj"]]))
        assert torch.equal(fp8_blockwise_dequantize(w2["w2_weight"][e], w2["w2_weight_scale_inv"][e], (128, 128)),
                           fq[f"model.layers.0.mlp.experts.{e}.down_proj"])


def test_chunk_by_bytes():
    pairs = [(str(i), torch.zeros(n, dtype=torch.uint8)) for i, n in enumerate([40, 50, 20, 200, 10])]
    assert [[k for k, _ in c] for c in chunk_by_bytes(pairs, 100)] == [["0", "1"], ["2"], ["3"], ["4"]]
    with pytest.raises(ExportError, match="chunk_bytes must be positive"):
        list(chunk_by_bytes(pairs, 0))


def test_serialize_weight_refuses_disabled_quantizer():
    lin = ql.quantize(torch.nn.Sequential(torch.nn.Linear(256, 256)), FP8_BLOCK)[0]
    lin.weight_quantizer.disable()
    with pytest.raises(ExportError, match=r"^w.weight_quantizer: TensorQuantizer disabled"):
        list(serialize_weight("w", lin.weight, lin.weight_quantizer, "hf_fp8_block"))


INT4_G32 = {"quant_cfg": {"*weight_quantizer": {"num_bits": 4, "block_sizes": {-1: 32}}, "default": {"enable": False}}, "algorithm": "max"}


@pytest.mark.parametrize("fmt", ["ct_nvfp4", "modelopt_nvfp4", "ct_int8", "ct_int_pack"])
def test_stacked_experts_tp_shards_tile_the_tp1_tensors(fmt):
    cfg = {"ct_int8": weight_only(ql.INT8_WEIGHT_ONLY_CFG), "ct_int_pack": INT4_G32}.get(fmt, weight_only(ql.NVFP4_DEFAULT_CFG))
    model = quantized(qwen3_moe(), cfg)
    full = [p for p in iter_packed(model, fmt, experts="stacked") if p.role == "expert"]
    ranks = [[p for p in iter_packed(model, fmt, experts="stacked", tp=2, tp_rank=r) if p.role == "expert"] for r in range(2)]
    assert [(p.name, p.shard) for p in ranks[0]] == [(p.name, p.shard) for p in full] == [(p.name, p.shard) for p in ranks[1]]
    split = []
    for whole, p0, p1 in zip(full, *ranks):
        dim = 2 if whole.shard == "w2" else 1  # vLLM's w13 rows / w2 columns are what TP splits
        for k, t in whole.tensors.items():
            a, b = p0.tensors[k], p1.tensors[k]
            if k.endswith("weight_shape"):  # [E, 2]: each rank's shard shape
                half = t.clone()
                half[:, dim - 1] //= 2
                assert torch.equal(a, half) and torch.equal(b, half), (p0.name, p0.shard, k)
            elif t.dim() > dim and t.shape[dim] > 1:
                assert a.shape[dim] * 2 == t.shape[dim] and torch.equal(torch.cat([a, b], dim).view(torch.uint8),
                                                                        t.view(torch.uint8)), (p0.name, p0.shard, k)
                split.append((whole.shard, k))
            else:  # per-tensor scales: every rank holds them whole
                assert torch.equal(a, t) and torch.equal(b, t), (p0.name, p0.shard, k)
    codes = {"w13_weight", "w2_weight", "w13_weight_packed", "w2_weight_packed"}
    assert sorted(k for _, k in split if k in codes) == sorted(k for p in full for k in p.tensors
                                                               if k in codes)  # every stacked code tensor split
    assert any(k.startswith("w13_weight_scale") for _, k in split)  # and the rows' scales with them
    w1 = ranks[1][0].tensors
    assert w1[next(k for k in w1 if k in ("w13_weight", "w13_weight_packed"))].shape[:2] == (4, 64)


def test_stacked_experts_tp_needs_rank_and_whole_blocks(moe):
    with pytest.raises(ExportError, match=r"tp_rank=None: experts='stacked' at tp=2 yields one rank's shard"):
        list(iter_packed(moe, "hf_fp8_block", experts="stacked", tp=2))
    with pytest.raises(ExportError, match=r"at tensor parallel 2 the (rows|columns) \(128\) split into shards of 64, not a whole number of "
                                          r"blocks of 128"):
        list(iter_packed(moe, "hf_fp8_block", experts="stacked", tp=2, tp_rank=0))


W8A8_FP8 = ql.FP8_DEFAULT_CFG


def test_serialize_weight_w8a8_fp8_takes_the_module():
    """ModelOpt FP8 needs the static input scale: with only the weight quantizer it always failed."""
    model = quantized(llama(), W8A8_FP8)
    o_proj = model.model.layers[0].self_attn.o_proj
    pairs = dict(serialize_weight("model.layers.0.self_attn.o_proj.weight", o_proj.weight, o_proj, "modelopt_fp8"))
    ref = next(p for p in iter_packed(model, "modelopt_fp8", scales="dynamic") if p.name == "model.layers.0.self_attn.o_proj").tensors
    assert sorted(pairs) == [f"model.layers.0.self_attn.o_proj.{k}" for k in ("input_scale", "weight",
                                                                              "weight_scale")] == [f"model.layers.0.self_attn.o_proj.{k}"
                                                                                                   for k in sorted(ref)]
    assert all(bit_equal(pairs[f"model.layers.0.self_attn.o_proj.{k}"], t) for k, t in ref.items())
    w = o_proj.weight.detach()
    assert torch.equal(pairs["model.layers.0.self_attn.o_proj.weight"].float() * pairs["model.layers.0.self_attn.o_proj.weight_scale"],
                       fake_quant(w, o_proj.weight_quantizer.spec, w.abs().amax()))
    # the quantizer alone plus its input quantizer says the same
    alone = dict(serialize_weight("model.layers.0.self_attn.o_proj.weight", o_proj.weight, o_proj.weight_quantizer, "modelopt_fp8",
                                  input_quantizer=o_proj.input_quantizer))
    assert all(bit_equal(alone[k], v) for k, v in pairs.items())


def test_serialize_weight_nvfp4_w4a4_carries_the_input_global_scale(moe_nvfp4_w4a4):
    experts = moe_nvfp4_w4a4.model.layers[0].mlp.experts
    pairs = dict(serialize_weight("model.layers.0.mlp.experts.gate_up_proj", experts.gate_up_proj, experts, "ct_nvfp4",
                                  batched_experts=True))
    gs = pairs["model.layers.0.mlp.experts.gate_up_proj.input_global_scale"]
    assert gs.shape == (4, 1) and torch.equal(gs, (torch.full((4, 1), 448.0 * 6) / experts.gate_up_proj_input_quantizer.amax.float()))


def test_serialize_weight_nvfp4_w4a4_dense_carries_the_input_scale():
    """A dense linear's W4A4 activation scale in both NVFP4 formats (compressed-tensors: the divisor ``2688 / amax``,
    as its own ``generate_gparam``), as the whole model's sync sends it."""
    from quantlib.export import sync_pairs
    from quantlib.formats.nvfp4 import nvfp4_global_scale

    model = quantized(llama(), ql.NVFP4_DEFAULT_CFG)
    q, name = model.model.layers[0].self_attn.q_proj, "model.layers.0.self_attn.q_proj"
    amax = q.input_quantizer.amax.float()
    for fmt, key, want in (("ct_nvfp4", "input_global_scale", (torch.full_like(amax, 448.0 * 6) / amax).reshape(1)),
                           ("modelopt_nvfp4", "input_scale", nvfp4_global_scale(amax).reshape(()))):  # fmt: skip
        pairs = dict(serialize_weight(f"{name}.weight", q.weight, q, fmt))
        assert torch.equal(pairs[f"{name}.{key}"], want), fmt
        synced = dict(sync_pairs(model, fmt))
        assert all(bit_equal(synced[k], t) for k, t in pairs.items()), fmt


@pytest.fixture(scope="module")
def moe_nvfp4_w4a4():
    return quantized(qwen3_moe(), ql.NVFP4_DEFAULT_CFG)


def test_serialize_weight_shares_a_given_global_amax():
    model = quantized(llama(), weight_only(ql.NVFP4_DEFAULT_CFG))
    attn = model.model.layers[0].self_attn
    top = torch.stack([m.weight.detach().abs().amax() for m in (attn.q_proj, attn.k_proj, attn.v_proj)]).amax()
    k = dict(serialize_weight("model.layers.0.self_attn.k_proj.weight", attn.k_proj.weight, attn.k_proj, "modelopt_nvfp4", global_amax=top))
    assert torch.equal(k["model.layers.0.self_attn.k_proj.weight_scale_2"], (top / 2688).reshape(()))
    with pytest.raises(ExportError, match=r"global_amax has 3 values; expected one, or one per expert \(1\)"):
        list(serialize_weight("k.weight", attn.k_proj.weight, attn.k_proj, "modelopt_nvfp4", global_amax=torch.ones(3)))


class HostReads:
    """Counts reads of tensor values back to the host (``.item()``, ``.tolist()``, ``bool()``, ``float()``, ``int()``)."""

    NAMES = ("item", "tolist", "__bool__", "__float__", "__int__")

    def __init__(self, monkeypatch):
        self.count = 0
        for name in self.NAMES:
            real = getattr(torch.Tensor, name)

            def counted(t, *a, _real=real, **k):
                self.count += 1
                return _real(t, *a, **k)

            monkeypatch.setattr(torch.Tensor, name, counted)


def test_batched_expert_sync_reads_nothing_back(moe, monkeypatch):
    """Each expert's amax check was a host read: one per expert of a stack."""
    experts = moe.model.layers[0].mlp.experts
    reads = HostReads(monkeypatch)
    list(serialize_weight("model.layers.0.mlp.experts.gate_up_proj", experts.gate_up_proj, experts.gate_up_proj_weight_quantizer,
                          "hf_fp8_block", batched_experts=True))
    assert reads.count == 0
    list(serialize_weight("model.layers.0.mlp.experts.gate_up_proj", experts.gate_up_proj, experts, "hf_fp8_block", batched_experts=True,
                          scales="static"))
    assert reads.count == 2  # the finiteness of the stored amax, then the clipping check: one batched read each


def test_model_sync_reads_back_once(moe, monkeypatch):
    from quantlib.export import sync_pairs

    reads = HostReads(monkeypatch)
    list(sync_pairs(moe, "hf_fp8_block"))
    assert reads.count == 1  # the plan's one batched check of every amax


def test_serialize_weight_refuses_an_input_pre_quant_scale():
    model = quantized(llama(), W8A8_FP8)
    o_proj = model.model.layers[0].self_attn.o_proj
    o_proj.input_quantizer.pre_quant_scale = torch.full((256,), 0.5)
    with pytest.raises(ExportError, match=r"^model\.layers\.0\.self_attn\.o_proj\.input_quantizer: pre_quant_scale is set"):
        list(serialize_weight("model.layers.0.self_attn.o_proj.weight", o_proj.weight, o_proj, "modelopt_fp8"))
