"""``p_bmm_quantizer`` (the attention probabilities) in transformers attention: Llama and Qwen3 from tiny
configs, eager and sdpa.

The reference never goes through quantlib: an unquantized copy of the model runs with eager attention
whose function is replaced by one written out here (repeat the k/v heads, QK^T * scale + mask, softmax in
fp32), which records max|P| per layer (the hand amax) and then fake-quantizes P by hand with it before
the P @ V matmul. Logits must be equal bit for bit, for the eager and the sdpa model alike.
"""

from __future__ import annotations

import copy
import inspect

import pytest
import torch
from torch import nn

pytest.importorskip("transformers", reason="needs transformers (pip install quantlib[transformers])")

import quantlib as ql  # noqa: E402
from quantlib.nn.quant_module import QuantModuleRegistry  # noqa: E402
from quantlib.plugins import attention_probs, hf_attention  # noqa: E402
from quantlib.plugins.hf_attention import QuantHFAttention  # noqa: E402
from tests.test_kv.test_kv_hf import batches, build, forward_loop, fp8_by_hand, run_modelopt  # noqa: E402

NAMES = ("llama", "qwen3")
P_RULE = {"quantizer_name": "*p_bmm_quantizer", "cfg": {"num_bits": (4, 3), "axis": None}}
P_CFG = ql.merge_kv_config(None, [P_RULE])


def quantized(name: str, impl: str, config: dict = P_CFG, data=None) -> nn.Module:
    return ql.quantize(build(name, impl), config, forward_loop(data if data is not None else batches()))


class HandProbs:
    """The eager attention function of the reference model: records max|P| ("amax") or fake-quantizes P ("quant")."""

    def __init__(self, monkeypatch, model: nn.Module) -> None:
        self.amax: dict[int, torch.Tensor] = {}
        self.mode = "amax"
        model.config._attn_implementation = "eager"
        glb = inspect.unwrap(type(model.model.layers[0].self_attn).forward).__globals__
        monkeypatch.setitem(glb, "eager_attention_forward", self)

    def __call__(self, module, query, key, value, attention_mask, scaling, dropout=0.0, **kwargs):
        assert not isinstance(module, QuantHFAttention)  # the reference is the plain model
        b, kv_heads, s, d = key.shape
        rep = query.shape[1] // kv_heads
        key = key[:, :, None].expand(b, kv_heads, rep, s, d).reshape(b, kv_heads * rep, s, d)
        value = value[:, :, None].expand(b, kv_heads, rep, s, d).reshape(b, kv_heads * rep, s, d)
        scores = torch.matmul(query, key.transpose(2, 3)) * scaling
        if attention_mask is not None:
            scores = scores + attention_mask
        probs = torch.softmax(scores, dim=-1, dtype=torch.float32)
        if self.mode == "amax":
            a = probs.detach().abs().amax()
            old = self.amax.get(module.layer_idx)
            self.amax[module.layer_idx] = a if old is None else torch.maximum(old, a)
        else:
            probs = fp8_by_hand(probs, self.amax[module.layer_idx])
        probs = probs.to(query.dtype)
        return torch.matmul(probs, value).transpose(1, 2).contiguous(), probs


@pytest.mark.parametrize("impl", ["eager", "sdpa"])
@pytest.mark.parametrize("name", NAMES)
def test_probs_logits_equal_hand_fake_quant(monkeypatch, name, impl):
    model = build(name, impl)
    ref = copy.deepcopy(model)
    data = batches()
    model = ql.quantize(model, P_CFG, forward_loop(data))
    x = batches(1, seed=7)[0]
    with monkeypatch.context() as mp:
        hand = HandProbs(mp, ref)
        with torch.no_grad():
            forward_loop(data)(ref)
        for i, layer in enumerate(model.model.layers):
            attn = layer.self_attn
            assert attn.p_bmm_quantizer.is_enabled and torch.equal(attn.p_bmm_quantizer.amax, hand.amax[i]), i
            assert not any(getattr(attn, q).is_enabled for q in ("q_bmm_quantizer", "k_bmm_quantizer", "v_bmm_quantizer"))
        hand.mode = "quant"
        with torch.no_grad():
            expected = ref(x).logits
        hand.mode = "off"
    with torch.no_grad():
        got = model(x).logits
        unquantized = build(name, "eager")(x).logits
    assert torch.equal(got, expected)
    assert not torch.equal(got, unquantized)  # P's quantization changed something


def test_probs_sdpa_equals_eager_with_padding_and_cache():
    """sdpa with P enabled computes eager attention: a padded batch (SDPA's boolean mask) and cached
    decoding (no mask at all for one query) give the eager model's logits bit for bit."""
    eager, sdpa = quantized("llama", "eager"), quantized("llama", "sdpa")
    x = batches(1, seed=5)[0]
    mask = torch.ones_like(x)
    mask[0, :3] = 0  # left padding in the first row
    with torch.no_grad():
        assert torch.equal(eager(x, attention_mask=mask).logits, sdpa(x, attention_mask=mask).logits)
        a = eager.generate(x, attention_mask=mask, max_new_tokens=3, do_sample=False, output_scores=True, return_dict_in_generate=True)
        b = sdpa.generate(x, attention_mask=mask, max_new_tokens=3, do_sample=False, output_scores=True, return_dict_in_generate=True)
    assert torch.equal(a.sequences, b.sequences) and all(torch.equal(s, t) for s, t in zip(a.scores, b.scores))


def test_probs_combines_with_kv_quantizers(monkeypatch):
    """P and k/v together: both kinds of quantizers are applied (not one instead of the other)."""
    cfg = ql.merge_kv_config(ql.merge_kv_config(None, ql.FP8_KV_CFG), [P_RULE])
    both, kv_only, p_only = quantized("qwen3", "sdpa", cfg), quantized("qwen3", "sdpa",
                                                                       ql.merge_kv_config(None, ql.FP8_KV_CFG)), quantized("qwen3", "sdpa")
    attn = both.model.layers[0].self_attn
    assert attn.p_bmm_quantizer.is_enabled and attn.k_bmm_quantizer.is_enabled and attn.v_bmm_quantizer.is_enabled
    x = batches(1, seed=7)[0]
    with torch.no_grad():
        out = both(x).logits
        assert not torch.equal(out, kv_only(x).logits) and not torch.equal(out, p_only(x).logits)


def test_probs_disabled_by_default():
    model = quantized("llama", "eager", ql.merge_kv_config(None, ql.FP8_KV_CFG))
    for layer in model.model.layers:
        q = layer.self_attn.p_bmm_quantizer
        assert not q.is_enabled and q.amax is None


@pytest.mark.parametrize("impl", ["flash_attention_2", "flex_attention"])
def test_probs_refused_on_fused_attention(impl):
    model = quantized("llama", "eager")
    model.config._attn_implementation = impl
    with pytest.raises(attention_probs.ProbsQuantizationError, match=r"model\.layers\.0\.self_attn\.p_bmm_quantizer \(.*Attention\): "
                                                                     rf"attention implementation '{impl}'"):
        with torch.no_grad():
            model(batches(1)[0])
    ql.disable_quantizer(model, "*p_bmm_quantizer")
    assert model.model.layers[0].self_attn.p_bmm_quantizer.is_enabled is False


def test_probs_refused_when_eager_function_calls_no_softmax(monkeypatch):
    model = quantized("llama", "eager")
    glb = inspect.unwrap(QuantModuleRegistry.original_class_of(model.model.layers[0].self_attn).forward).__globals__

    def no_softmax(module, query, key, value, attention_mask, scaling, dropout=0.0, **kwargs):
        return torch.zeros_like(query).transpose(1, 2).contiguous(), None

    monkeypatch.setitem(glb, "eager_attention_forward", hf_attention._wrap(no_softmax, "eager"))
    with pytest.raises(attention_probs.ProbsQuantizationError, match=r"model\.layers\.0\.self_attn\.p_bmm_quantizer .*called no softmax"):
        with torch.no_grad():
            model(batches(1)[0])


def test_probs_rule_refused_on_unreachable_attention():
    from tests.test_kv.test_kv_hf import MyAttention

    with pytest.raises(ql.ConfigError, match=r"\*p_bmm_quantizer.*1 \(MyAttention\)"):
        ql.quantize(nn.Sequential(nn.Linear(8, 8), MyAttention()), P_CFG, lambda m: m(torch.randn(2, 8)))


def test_probs_export_refused(tmp_path):
    from quantlib.export import ExportError, export_checkpoint

    model = quantized("llama", "sdpa", ql.merge_kv_config(ql.FP8_DEFAULT_CFG, [P_RULE]))
    with pytest.raises(ExportError, match=r"model\.layers\.0\.self_attn\.p_bmm_quantizer = .*no export format carries "
                                          r"attention-probabilities"):
        export_checkpoint(model, tmp_path / "c", "modelopt_fp8")
    assert not list(tmp_path.iterdir())
    ql.disable_quantizer(model, "*p_bmm_quantizer")
    export_checkpoint(model, tmp_path / "c", "modelopt_fp8", unify_siblings=True)  # the same model exports once P is off


_MODELOPT_SCRIPT = r"""
import sys, torch, warnings
warnings.filterwarnings("ignore")
sys.path.insert(0, sys.argv[2])
import test_kv_hf as t
import modelopt.torch.quantization as mtq
from modelopt.torch.quantization.utils.core_utils import update_quant_cfg_with_kv_cache_quant
rule = {"quantizer_name": "*p_bmm_quantizer", "cfg": {"num_bits": (4, 3), "axis": None}}
out = {}
for name in ("llama", "qwen3"):
    model = t.build(name, "eager")
    for layer in model.model.layers:  # ModelOpt's CPU path for P: its eager softmax wrapper, taken for non-causal modules
        layer.self_attn.is_causal = False  # (eager attention ignores the flag: the model's causal mask still applies)
    mtq.quantize(model, update_quant_cfg_with_kv_cache_quant({"quant_cfg": None}, [rule]), t.forward_loop(t.batches()))
    for i, layer in enumerate(model.model.layers):
        out[f"{name}.{i}"] = layer.self_attn.p_bmm_quantizer.amax.float().clone()
    with torch.no_grad():
        out[f"{name}.logits"] = model(t.batches(1, seed=7)[0]).logits
torch.save(out, sys.argv[1])
"""


def test_probs_amax_and_logits_equal_modelopt(tmp_path):
    """ModelOpt 0.47 calibrates p_bmm_quantizer on the CPU only through its eager softmax wrapper, which it
    takes for non-causal attention modules (causal ones go to its Triton kernel, CUDA only, and skip P
    while calibrating): there its amax, and its logits, equal quantlib's. Its own process: importing
    ModelOpt patches transformers classes for the whole process."""
    theirs = run_modelopt(_MODELOPT_SCRIPT, tmp_path)
    for name in NAMES:
        model = quantized(name, "eager")
        for i, layer in enumerate(model.model.layers):
            assert torch.equal(layer.self_attn.p_bmm_quantizer.amax, theirs[f"{name}.{i}"]), (name, i)
        with torch.no_grad():
            assert torch.equal(model(batches(1, seed=7)[0]).logits, theirs[f"{name}.logits"]), name
