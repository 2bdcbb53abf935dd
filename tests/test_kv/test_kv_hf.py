"""KV-cache quantizers in transformers attention (Llama, Qwen3, Qwen3-MoE from tiny configs, no downloads).

The reference never goes through quantlib's attention classes: an unquantized copy of the model runs
with the attention function replaced by one that records max|k|, max|v| per layer (the hand amax) and
then fake-quantizes k and v by hand with those amax (FP8: the numerics contract written out in torch;
NVFP4: the pure-torch reference of quantlib.formats). Logits must be equal bit for bit.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

transformers = pytest.importorskip("transformers", reason="needs transformers (pip install quantlib[transformers])")
from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM  # noqa: E402
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS, AttentionInterface  # noqa: E402

import quantlib as ql  # noqa: E402
from quantlib.formats.nvfp4 import nvfp4_fake_quant  # noqa: E402
from quantlib.plugins import hf_attention  # noqa: E402

COMMON = dict(vocab_size=64, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
              max_position_embeddings=64)
MODELS = {
    "llama": lambda: LlamaForCausalLM(LlamaConfig(intermediate_size=48, **COMMON)),
    "qwen3": lambda: Qwen3ForCausalLM(Qwen3Config(intermediate_size=48, **COMMON)),
    "qwen3_moe": lambda: Qwen3MoeForCausalLM(Qwen3MoeConfig(intermediate_size=48, moe_intermediate_size=16, num_experts=4,
                                                            num_experts_per_tok=2, experts_implementation="eager", **COMMON)),
}
PRESETS = {"fp8": ql.FP8_KV_CFG, "nvfp4": ql.NVFP4_KV_CFG}


def build(name: str, impl: str, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    model = MODELS[name]().eval()
    model.config._attn_implementation = impl
    return model


def batches(n: int = 3, seed: int = 1) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 64, (2, 12), generator=g) for _ in range(n)]


def forward_loop(data):
    def loop(model):
        for x in data:
            model(x)

    return loop


def fp8_by_hand(x: torch.Tensor, amax: torch.Tensor) -> torch.Tensor:
    s = torch.tensor(448.0) / amax  # amax > 2^-24 here
    return (torch.clamp(x.float() * s, -448.0, 448.0).to(torch.float8_e4m3fn).float() * torch.reciprocal(s)).to(x.dtype)


def by_hand(preset: str, x: torch.Tensor, amax: torch.Tensor) -> torch.Tensor:
    return fp8_by_hand(x, amax) if preset == "fp8" else nvfp4_fake_quant(x.float(), amax).to(x.dtype)


class HandAttention:
    """Replaces the model's attention function: records (mode "amax") or fake-quantizes (mode "quant")."""

    def __init__(self, monkeypatch, model: nn.Module, impl: str, preset: str) -> None:
        self.amax: dict[tuple[int, str], torch.Tensor] = {}
        self.mode, self.preset = "amax", preset
        attn = model.model.layers[0].self_attn
        if impl == "eager":
            glb = hf_attention.inspect.unwrap(type(attn).forward).__globals__
            self.original = glb["eager_attention_forward"]
            monkeypatch.setitem(glb, "eager_attention_forward", self)
        else:
            # a local entry of the shared instance wins over the class-wide one (some libraries leave one)
            self.original = ALL_ATTENTION_FUNCTIONS[impl]
            monkeypatch.setitem(ALL_ATTENTION_FUNCTIONS._local_mapping, impl, self)

    def __call__(self, module, query, key, value, *args, **kwargs):
        assert not isinstance(module, hf_attention.QuantHFAttention)  # the reference is the plain model
        if self.mode == "amax":
            for tag, t in (("k", key), ("v", value)):
                a = t.detach().abs().amax().float()
                old = self.amax.get((module.layer_idx, tag))
                self.amax[(module.layer_idx, tag)] = a if old is None else torch.maximum(old, a)
        else:
            key = by_hand(self.preset, key, self.amax[(module.layer_idx, "k")])
            value = by_hand(self.preset, value, self.amax[(module.layer_idx, "v")])
        return self.original(module, query, key, value, *args, **kwargs)


@pytest.mark.parametrize("impl", ["sdpa", "eager"])
@pytest.mark.parametrize("preset", sorted(PRESETS))
@pytest.mark.parametrize("name", sorted(MODELS))
def test_kv_logits_equal_hand_fake_quant(monkeypatch, name, preset, impl):
    model = build(name, impl)
    ref = copy.deepcopy(model)
    data = batches()
    model = ql.quantize(model, ql.merge_kv_config(None, PRESETS[preset]), forward_loop(data))
    with monkeypatch.context() as mp:
        hand = HandAttention(mp, ref, impl, preset)
        with torch.no_grad():
            forward_loop(data)(ref)
        for i, layer in enumerate(model.model.layers):
            assert torch.equal(layer.self_attn.k_bmm_quantizer.amax, hand.amax[(i, "k")]), (i, "k")
            assert torch.equal(layer.self_attn.v_bmm_quantizer.amax, hand.amax[(i, "v")]), (i, "v")
            assert not layer.self_attn.q_bmm_quantizer.is_enabled
        hand.mode = "quant"
        x = batches(1, seed=7)[0]
        with torch.no_grad():
            expected = ref(x).logits
    with torch.no_grad():
        got = model(x).logits
    assert torch.equal(got, expected)
    with torch.no_grad():
        unquantized = ref(x).logits
    assert not torch.equal(got, unquantized)  # the quantizers changed something


_MODELOPT_SCRIPT = r"""
import sys, torch, warnings
warnings.filterwarnings("ignore")
sys.path.insert(0, sys.argv[2])
import test_kv_hf as t
import modelopt.torch.quantization as mtq
from modelopt.torch.quantization.utils.core_utils import update_quant_cfg_with_kv_cache_quant
out = {}
for name in sorted(t.MODELS):
    model = t.build(name, "sdpa")
    mtq.quantize(model, update_quant_cfg_with_kv_cache_quant({"quant_cfg": None}, mtq.FP8_KV_CFG["quant_cfg"]), t.forward_loop(t.batches()))
    for i, layer in enumerate(model.model.layers):
        for q in ("k_bmm_quantizer", "v_bmm_quantizer"):
            out[f"{name}.{i}.{q}"] = getattr(layer.self_attn, q).amax.float().clone()
torch.save(out, sys.argv[1])
"""


def run_modelopt(script: str, tmp_path) -> dict:
    """Run ``script`` (argv: output file, this folder) in a fresh process (skips without ModelOpt); its saved dict."""
    import importlib.util
    import os
    import subprocess
    import sys

    if importlib.util.find_spec("modelopt") is None:
        pytest.skip("needs nvidia-modelopt")
    out = tmp_path / "modelopt.pt"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([os.path.dirname(os.path.dirname(os.path.abspath(ql.__file__))),
                                                       os.environ.get("PYTHONPATH", "")]))
    subprocess.run([sys.executable, "-c", script, str(out), os.path.dirname(os.path.abspath(__file__))], check=True, env=env, timeout=600)
    return torch.load(out, weights_only=True)


def test_kv_amax_equal_modelopt(tmp_path):
    """ModelOpt 0.47's FP8 KV calibration of the same models and data gives the same amax. It runs in its
    own process: importing ModelOpt patches Megatron and transformers classes for the whole process."""
    theirs = run_modelopt(_MODELOPT_SCRIPT, tmp_path)
    for name in sorted(MODELS):
        model = ql.quantize(build(name, "sdpa"), ql.merge_kv_config(None, ql.FP8_KV_CFG), forward_loop(batches()))
        for i, layer in enumerate(model.model.layers):
            for q in ("k_bmm_quantizer", "v_bmm_quantizer"):
                assert torch.equal(getattr(layer.self_attn, q).amax, theirs[f"{name}.{i}.{q}"]), (name, i, q)


def test_kv_merge_keeps_weight_rules_and_appends_kv():
    merged = ql.merge_kv_config(ql.FP8_DEFAULT_CFG, ql.FP8_KV_CFG)
    model = build("llama", "sdpa")
    model = ql.quantize(model, merged, forward_loop(batches(1)))
    attn = model.model.layers[0].self_attn
    assert attn.q_proj.weight_quantizer.is_enabled and attn.q_proj.weight_quantizer.num_bits == (4, 3)
    assert attn.k_bmm_quantizer.is_enabled and attn.v_bmm_quantizer.amax is not None
    assert not model.lm_head.weight_quantizer.is_enabled  # the weight preset's disables survive
    assert ql.FP8_DEFAULT_CFG["quant_cfg"]["*weight_quantizer"] == {"num_bits": (4, 3), "axis": None}  # inputs untouched


@pytest.mark.parametrize("name", sorted(MODELS))
def test_kv_restore_round_trip(tmp_path, name):
    model = build(name, "sdpa")
    fresh = copy.deepcopy(model)
    data = batches()
    model = ql.quantize(model, ql.merge_kv_config(ql.FP8_DEFAULT_CFG, ql.NVFP4_KV_CFG), forward_loop(data))
    ql.save(model, tmp_path / "q.pt")
    fresh = ql.restore(fresh, tmp_path / "q.pt")
    for a, b in zip(model.model.layers, fresh.model.layers):
        for q in ("k_bmm_quantizer", "v_bmm_quantizer"):
            assert torch.equal(getattr(a.self_attn, q).amax, getattr(b.self_attn, q).amax)
            assert getattr(b.self_attn, q).spec == getattr(a.self_attn, q).spec
    x = batches(1, seed=9)[0]
    with torch.no_grad():
        assert torch.equal(model(x).logits, fresh(x).logits)


class MyAttention(nn.Module):
    """An attention that does its own matmuls (no transformers interface)."""

    def __init__(self) -> None:
        super().__init__()
        self.k_proj, self.v_proj, self.q_proj = nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x):
        w = torch.softmax(self.q_proj(x) @ self.k_proj(x).transpose(-1, -2), dim=-1)
        return w @ self.v_proj(x)


def test_kv_preset_refused_on_unreachable_attention():
    model = nn.Sequential(nn.Linear(8, 8), MyAttention())
    with pytest.raises(ql.ConfigError, match=r"1 \(MyAttention\)"):
        ql.quantize(model, ql.merge_kv_config(ql.FP8_DEFAULT_CFG, ql.FP8_KV_CFG), lambda m: m(torch.randn(2, 8)))
    ql.quantize(nn.Sequential(nn.Linear(8, 8), MyAttention()), ql.FP8_DEFAULT_CFG, lambda m: m(torch.randn(2, 8)))  # no KV rule: fine


def test_kv_chain_rule_with_one_enabled_member_is_refused_on_unreachable_attention():
    # a list config quantizes with its enabled members: a chain whose first member is off still enables
    chain = [{"num_bits": (4, 3), "axis": None, "enable": False}, {"num_bits": (4, 3), "axis": None}]
    cfg = ql.merge_kv_config(ql.FP8_DEFAULT_CFG, {"quant_cfg": [{"quantizer_name": "*[kv]_bmm_quantizer", "cfg": chain}],
                                                  "algorithm": "max"})
    with pytest.raises(ql.ConfigError, match=r"1 \(MyAttention\)"):
        ql.quantize(nn.Sequential(nn.Linear(8, 8), MyAttention()), cfg, lambda m: m(torch.randn(2, 8)))


def test_kv_preset_ignores_unreachable_attention_it_disables():
    """An attention module the config would not quantize (a vision tower, disabled by pattern) is no reason to refuse."""
    model = nn.Sequential()
    model.add_module("text", nn.Sequential(nn.Linear(8, 8)))
    model.add_module("visual", MyAttention())
    cfg = ql.merge_kv_config(ql.FP8_DEFAULT_CFG, ql.FP8_KV_CFG)
    cfg["quant_cfg"].append({"quantizer_name": "*visual*", "enable": False})
    with pytest.raises(ql.ConfigError, match="no attention module"):  # refused anyway: no k/v quantizer anywhere
        ql.quantize(model, cfg, lambda m: m.text(torch.randn(2, 8)))
    hf = build("llama", "sdpa")
    hf.model.add_module("visual", MyAttention())
    ql.quantize(hf, cfg, forward_loop(batches(1)))
    assert hf.model.layers[0].self_attn.k_bmm_quantizer.amax is not None


def test_kv_preset_refused_on_model_without_attention():
    with pytest.raises(ql.ConfigError, match="no attention module"):
        ql.quantize(nn.Sequential(nn.Linear(8, 8)), ql.merge_kv_config(None, ql.FP8_KV_CFG), lambda m: m(torch.randn(2, 8)))


def test_kv_unwrapped_attention_function_raises(monkeypatch):
    model = ql.quantize(build("llama", "sdpa"), ql.merge_kv_config(None, ql.FP8_KV_CFG), forward_loop(batches(1)))
    plain = AttentionInterface._global_mapping["sdpa"].__wrapped__
    monkeypatch.setitem(ALL_ATTENTION_FUNCTIONS._local_mapping, "sdpa", plain)  # an override quantlib never saw
    with pytest.raises(hf_attention.KVQuantizationError, match=r"model\.layers\.0\.self_attn .*'sdpa'"):
        with torch.no_grad():
            model(batches(1)[0])


def test_kv_disabled_quantizers_leave_logits_unchanged():
    model = build("qwen3", "sdpa")
    ref = copy.deepcopy(model)
    model = ql.quantize(model, {"quant_cfg": {"default": {"enable": False}}, "algorithm": None})
    x = batches(1)[0]
    with torch.no_grad():
        assert torch.equal(model(x).logits, ref(x).logits)


def test_kv_generate_with_cache_matches_reference(monkeypatch):
    """Decoding: k/v are quantized after the cache update (the whole cache, with the calibrated amax)."""
    model = build("llama", "sdpa")
    ref = copy.deepcopy(model)
    data = batches()
    model = ql.quantize(model, ql.merge_kv_config(None, ql.FP8_KV_CFG), forward_loop(data))
    hand = HandAttention(monkeypatch, ref, "sdpa", "fp8")
    for i, layer in enumerate(model.model.layers):
        hand.amax[(i, "k")], hand.amax[(i, "v")] = layer.self_attn.k_bmm_quantizer.amax, layer.self_attn.v_bmm_quantizer.amax
    hand.mode = "quant"
    prompt = batches(1, seed=3)[0]
    expected = ref.generate(prompt, max_new_tokens=4, do_sample=False, output_scores=True, return_dict_in_generate=True)
    monkeypatch.undo()
    got = model.generate(prompt, max_new_tokens=4, do_sample=False, output_scores=True, return_dict_in_generate=True)
    assert torch.equal(got.sequences, expected.sequences)
    assert all(torch.equal(a, b) for a, b in zip(got.scores, expected.scores))
