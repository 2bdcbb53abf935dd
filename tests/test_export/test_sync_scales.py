"""RL weight sync after optimizer steps: the synced tensors dequantize to the fake quantization of the
CURRENT weights with dynamic scales (FP8 128x128, MXFP8, NVFP4; dense Llama and stacked Qwen3-MoE
experts, bit for bit); the static mode refuses a weight that outgrew its calibrated amax by name."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

import quantlib as ql  # noqa: E402
from quantlib import kernels  # noqa: E402
from quantlib.export import ExportError, iter_packed, serialize_weight, sync_pairs  # noqa: E402
from quantlib.formats.fp8_blockwise import fp8_blockwise_fake_quant  # noqa: E402
from quantlib.formats.nvfp4 import nvfp4_fake_quant  # noqa: E402
from quantlib.formats.reference import fake_quant  # noqa: E402
from quantlib.nn.max_collector import abs_max  # noqa: E402
from quantlib.plugins import huggingface as hf  # noqa: E402
from tests.test_export._export_models import llama, quantized, qwen3_moe, tokens, weight_only  # noqa: E402

RECIPES = {  # format: (preset, synced format)
    "fp8_block": (ql.FP8_2D_BLOCKWISE_WEIGHT_ONLY_CFG, "hf_fp8_block"),
    "mxfp8": (ql.MXFP8_DEFAULT_CFG, "hf_mxfp8"),
    "nvfp4": (ql.NVFP4_DEFAULT_CFG, "modelopt_nvfp4"),
}
SIBLINGS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))


def train(model: torch.nn.Module, steps: int = 2, lr: float = 0.6) -> None:
    """SGD steps (language-model loss through the fake-quantized forward, plus a term that grows every
    element by a random factor) that leave the weights 3-5x beyond their calibrated amax."""
    params = [p for p in model.parameters() if p.requires_grad]
    g = torch.Generator().manual_seed(11)
    masks = [torch.rand(p.shape, generator=g) for p in params]
    opt = torch.optim.SGD(params, lr=lr)
    ids = tokens(7)
    with torch.enable_grad():
        for _ in range(steps):
            opt.zero_grad()
            grow = sum((p.pow(2) * m).sum() for p, m in zip(params, masks))
            (model(ids, labels=ids).loss - grow).backward()
            opt.step()


_CACHE: dict = {}


def trained(family: str, recipe: str) -> torch.nn.Module:
    key = (family, recipe)
    if key not in _CACHE:
        model = quantized(llama() if family == "llama" else qwen3_moe(), weight_only(RECIPES[recipe][0]))
        train(model)
        _CACHE[key] = model
    return _CACHE[key]


def current_weights(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Checkpoint name -> the weight now (experts split per expert and projection)."""
    out = {}
    for name, m in model.named_modules():
        if isinstance(m, hf.QuantFusedExperts):
            for e in range(m.num_experts):
                gu = hf.expert_weight(m, "gate_up_proj", e).detach()
                half = gu.shape[0] // 2
                out[f"{name}.{e}.gate_proj"], out[f"{name}.{e}.up_proj"] = gu[:half], gu[half:]
                out[f"{name}.{e}.down_proj"] = hf.expert_weight(m, "down_proj", e).detach()
        elif isinstance(m, ql.QuantModule) and hasattr(m, "weight") and m.weight_quantizer.is_enabled:
            out[name] = m.weight.detach()
    return out


def dynamic_reference(weights: dict[str, torch.Tensor], recipe: str, spec) -> dict[str, torch.Tensor]:
    """The fake quantization of each current weight with scales from itself (NVFP4: one global amax
    for the siblings a consumer fuses, q/k/v and each expert's gate/up)."""
    out = {}
    for name, w in weights.items():
        if recipe == "fp8_block":
            out[name] = fp8_blockwise_fake_quant(w, (128, 128), eps=1e-10)
        elif recipe == "mxfp8":
            out[name] = fake_quant(w, spec)
        else:
            parent, _, leaf = name.rpartition(".")
            group = next((g for g in SIBLINGS if leaf in g), (leaf,))
            top = torch.stack([abs_max(weights[f"{parent}.{s}"]) for s in group if f"{parent}.{s}" in weights]).amax()
            out[name] = nvfp4_fake_quant(w, top)
    return out


def decode(tensors: dict[str, torch.Tensor], recipe: str, n: int) -> torch.Tensor:
    codes = tensors["weight"]
    if recipe == "fp8_block":
        return kernels.dequantize(codes, tensors["weight_scale_inv"], "fp8_blockwise", block=(128, 128))
    if recipe == "mxfp8":
        return kernels.dequantize(codes, tensors["weight_scale_inv"], "mxfp8")
    return kernels.dequantize(codes, tensors["weight_scale"], "nvfp4", global_scale=tensors["weight_scale_2"], n=n)


def synced_weights(pairs: dict[str, torch.Tensor], recipe: str, weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Checkpoint name -> the dequantized synced weight; stacked ``w13_*`` / ``w2_*`` split back per expert."""
    out = {}
    for name in weights:
        parent, _, leaf = name.rpartition(".")
        moe, _, e = parent.rpartition(".")
        if moe.endswith(".experts"):
            prefix = "w2_" if leaf == "down_proj" else "w13_"
            t = {k[len(moe) + 1 + len(prefix):]: v[int(e)] for k, v in pairs.items() if k.startswith(f"{moe}.{prefix}")}
            if leaf != "down_proj":  # w13 rows: gate then up; per-tensor scales [gate, up]
                i = 0 if leaf == "gate_proj" else 1
                t = {k: (v.chunk(2, 0)[i].reshape(()) if v.dim() == 1 else v.chunk(2, 0)[i]) for k, v in t.items()}
            out[name] = decode(t, recipe, weights[name].shape[-1])
        else:
            out[name] = decode({k[len(name) + 1:]: v for k, v in pairs.items() if k.rpartition(".")[0] == name}, recipe,
                               weights[name].shape[-1])
    return out


@pytest.mark.parametrize("family", ["llama", "qwen3_moe"])
@pytest.mark.parametrize("recipe", sorted(RECIPES))
def test_sync_after_training_equals_dynamic_fake_quant(family, recipe):
    model = trained(family, recipe)
    weights = current_weights(model)
    spec = model.model.layers[0].self_attn.q_proj.weight_quantizer.spec
    calibrated = model.model.layers[0].self_attn.q_proj.weight_quantizer.amax
    if calibrated is not None:  # MX keeps none
        assert float(abs_max(weights["model.layers.0.self_attn.q_proj"])) > 2.5 * float(calibrated.max())  # the weights moved
    pairs = dict(sync_pairs(model, RECIPES[recipe][1]))
    got, ref = synced_weights(pairs, recipe, weights), dynamic_reference(weights, recipe, spec)
    assert sorted(got) == sorted(ref) and len(got) == (14 if family == "llama" else 2 * (4 + 3 * 4))
    for name in ref:
        assert torch.equal(got[name].float().view(torch.int32), ref[name].float().view(torch.int32)), name


def test_serialize_weight_packs_the_current_weight():
    """The calibrated FP8 128x128 block amax clipped a weight grown 3x to a third of its maximum."""
    model = trained("llama", "fp8_block")
    q = model.model.layers[1].self_attn.q_proj
    pairs = dict(serialize_weight("model.layers.1.self_attn.q_proj.weight", q.weight, q.weight_quantizer, "hf_fp8_block"))
    got = kernels.dequantize(pairs["model.layers.1.self_attn.q_proj.weight"], pairs["model.layers.1.self_attn.q_proj.weight_scale_inv"],
                             "fp8_blockwise", block=(128, 128))
    assert torch.equal(got, fp8_blockwise_fake_quant(q.weight.detach(), (128, 128), eps=1e-10))
    assert float(got.abs().max()) > 0.9 * float(q.weight.detach().abs().max())  # not clipped at the calibrated amax


def test_serialize_weight_batched_experts_after_training():
    model = trained("qwen3_moe", "nvfp4")
    experts = model.model.layers[1].mlp.experts
    pairs = dict(serialize_weight("model.layers.1.mlp.experts.down_proj", experts.down_proj, experts, "modelopt_nvfp4",
                                  batched_experts=True))
    for e in range(4):
        w = experts.down_proj[e].detach()
        t = {k.rpartition(".")[2]: v[e] for k, v in pairs.items()}
        assert torch.equal(decode(t, "nvfp4", w.shape[-1]), nvfp4_fake_quant(w, abs_max(w)))


@pytest.mark.parametrize("recipe", ["fp8_block", "nvfp4"])
def test_static_scales_refuse_a_weight_beyond_its_amax(recipe):
    model = trained("qwen3_moe", recipe)
    fmt = RECIPES[recipe][1]
    with pytest.raises(ExportError, match=r"^model\.layers\.0\.self_attn\.q_proj\.weight_quantizer: the weight "
                                          r"model\.layers\.0\.self_attn\.q_proj has outgrown its calibrated scale .*weight amax [0-9.e+-]+ "
                                          r"> stored amax [0-9.e+-]+"):
        list(iter_packed(model, fmt, scales="static"))
    q = model.model.layers[0].mlp.experts
    with pytest.raises(ExportError, match=r"^model\.layers\.0\.mlp\.experts\.down_proj_weight_quantizer\[0\]: the weight "
                                          r"model\.layers\.0\.mlp\.experts\.down_proj has outgrown"):
        list(serialize_weight("model.layers.0.mlp.experts.down_proj", q.down_proj, q, fmt, batched_experts=True, scales="static"))


def test_static_scales_pass_an_untrained_model_unchanged():
    model = quantized(llama(), weight_only(ql.NVFP4_DEFAULT_CFG))
    static = {p.name: p.tensors for p in iter_packed(model, "modelopt_nvfp4", scales="static")}
    calibrated = {p.name: p.tensors for p in iter_packed(model, "modelopt_nvfp4")}
    assert static.keys() == calibrated.keys()
    for name, tensors in calibrated.items():
        for k, t in tensors.items():
            assert torch.equal(static[name][k].view(torch.uint8) if t.element_size() == 1 else static[name][k], t.view(torch.uint8)
                               if t.element_size() == 1 else t), (name, k)


def test_unknown_scales_refused():
    model = quantized(llama(), weight_only(ql.FP8_2D_BLOCKWISE_WEIGHT_ONLY_CFG))
    with pytest.raises(ExportError, match=r"scales='live': expected one of \['calibrated', 'dynamic', 'static'\]"):
        list(iter_packed(model, "hf_fp8_block", scales="live"))
