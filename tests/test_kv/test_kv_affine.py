"""Affine KV-cache quantization (ModelOpt's FP8_AFFINE_KV_CFG) in transformers attention.

The hand reference is written here from ModelOpt 0.47's documented behaviour (checked against it by
``test_affine_kv_bias_and_amax_equal_modelopt``): per layer and for k and v, the bias is the running
average of the per-batch means over batch and sequence (one per head and channel), the amax the running
max of |x - running bias|, and the quantized tensor ``fp8(x - b) + b``.
"""

from __future__ import annotations

import copy
import importlib.util
import os
import subprocess
import sys

import pytest
import torch

pytest.importorskip("transformers", reason="needs transformers (pip install quantlib[transformers])")

import quantlib as ql  # noqa: E402
from quantlib import checkpoint as ckpt  # noqa: E402
from quantlib.export import ExportError, export_checkpoint  # noqa: E402
from tests._scripts import load_golden_writer  # noqa: E402
from tests.ranks import run_on_ranks  # noqa: E402
from tests.test_kv.test_kv_hf import MODELS, HandAttention, batches, build, forward_loop, fp8_by_hand  # noqa: E402

AFFINE = ql.merge_kv_config(None, ql.FP8_AFFINE_KV_CFG)
DATA = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "data")


class HandAffine(HandAttention):
    """Records the running bias and amax by hand (mode "calib"), or quantizes with them (mode "quant")."""

    def __init__(self, monkeypatch, model, impl: str) -> None:
        super().__init__(monkeypatch, model, impl, "fp8")
        self.mode = "calib"
        self.bias: dict[tuple[int, str], torch.Tensor] = {}
        self.batches: dict[tuple[int, str], int] = {}

    def __call__(self, module, query, key, value, *args, **kwargs):
        out = {}
        for tag, t in (("k", key), ("v", value)):
            slot = (module.layer_idx, tag)
            if self.mode == "calib":
                n = self.batches.get(slot, 0)
                mean = t.float().mean(dim=(0, 2), keepdim=True)  # keys are [batch, heads, seq, head dim]
                self.bias[slot] = mean if n == 0 else (self.bias[slot] * n + mean) / (n + 1)
                self.batches[slot] = n + 1
                a = (t.float() - self.bias[slot]).abs().amax()
                self.amax[slot] = a if n == 0 else torch.maximum(self.amax[slot], a)
                out[tag] = t
            else:
                out[tag] = fp8_by_hand(t.float() - self.bias[slot], self.amax[slot]) + self.bias[slot]
        return self.original(module, query, out["k"], out["v"], *args, **kwargs)


def _kv(model, i: int, tag: str):
    return getattr(model.model.layers[i].self_attn, f"{tag}_bmm_quantizer")


@pytest.mark.parametrize("impl", ["sdpa", "eager"])
@pytest.mark.parametrize("name", ["llama", "qwen3"])
def test_affine_kv_logits_equal_hand_reference(monkeypatch, name, impl):
    model = build(name, impl)
    ref = copy.deepcopy(model)
    data = batches()
    model = ql.quantize(model, AFFINE, forward_loop(data))
    with monkeypatch.context() as mp:
        hand = HandAffine(mp, ref, impl)
        with torch.no_grad():
            forward_loop(data)(ref)
        for i in range(len(model.model.layers)):
            for tag in "kv":
                q = _kv(model, i, tag)
                assert q.bias_value.shape == (1, 2, 1, 16)  # one per key/value head and channel
                assert torch.equal(q.bias_value, hand.bias[(i, tag)]), (i, tag)
                assert torch.equal(q.amax, hand.amax[(i, tag)]), (i, tag)
        hand.mode = "quant"
        x = batches(1, seed=7)[0]
        with torch.no_grad():
            expected = ref(x).logits
    with torch.no_grad():
        got = model(x).logits
        symmetric = ql.quantize(build(name, impl), ql.merge_kv_config(None, ql.FP8_KV_CFG), forward_loop(data))(x).logits
    assert torch.equal(got, expected)
    assert not torch.equal(got, symmetric)  # the bias changed something


_MODELOPT_SCRIPT = r"""
import sys, torch, warnings
warnings.filterwarnings("ignore")
sys.path.insert(0, sys.argv[2])
import test_kv_hf as t
import modelopt.torch.quantization as mtq
from modelopt.torch.quantization.utils.core_utils import update_quant_cfg_with_kv_cache_quant
out = {}
for name in ("llama", "qwen3"):
    model = t.build(name, "sdpa")
    cfg = update_quant_cfg_with_kv_cache_quant(mtq.FP8_DEFAULT_CFG, mtq.FP8_AFFINE_KV_CFG["quant_cfg"])
    mtq.quantize(model, cfg, t.forward_loop(t.batches()))
    for i, layer in enumerate(model.model.layers):
        for q in ("k_bmm_quantizer", "v_bmm_quantizer"):
            out[f"{name}.{i}.{q}.amax"] = getattr(layer.self_attn, q).amax.float().clone()
            out[f"{name}.{i}.{q}.bias"] = getattr(layer.self_attn, q)._bias_value.float().clone()
    with torch.no_grad():
        out[f"{name}.logits"] = model(t.batches(1, seed=7)[0]).logits
torch.save(out, sys.argv[1])
"""


def test_affine_kv_bias_and_amax_equal_modelopt(tmp_path):
    """ModelOpt 0.47 quantizes the same Llama and Qwen3 with FP8_AFFINE_KV_CFG merged into FP8_DEFAULT_CFG on the
    same data (in its own process: importing it patches transformers classes): the same bias and amax bit
    for bit, and logits within 1e-6"""
    if importlib.util.find_spec("modelopt") is None:
        pytest.skip("needs nvidia-modelopt")
    out = tmp_path / "modelopt.pt"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([os.path.dirname(os.path.dirname(os.path.abspath(ql.__file__))),
                                                       os.environ.get("PYTHONPATH", "")]))
    here = os.path.dirname(os.path.abspath(__file__))
    subprocess.run([sys.executable, "-c", _MODELOPT_SCRIPT, str(out), here], check=True, env=env, timeout=600)
    theirs = torch.load(out, weights_only=True)
    for name in ("llama", "qwen3"):
        model = ql.quantize(build(name, "sdpa"), ql.merge_kv_config(ql.FP8_DEFAULT_CFG, ql.FP8_AFFINE_KV_CFG), forward_loop(batches()))
        for i in range(len(model.model.layers)):
            for tag in "kv":
                q, key = _kv(model, i, tag), f"{name}.{i}.{tag}_bmm_quantizer"
                assert torch.equal(q.bias_value, theirs[f"{key}.bias"]), key
                assert torch.equal(q.amax, theirs[f"{key}.amax"]), key
        with torch.no_grad():
            ours = model(batches(1, seed=7)[0]).logits
        # not bit for bit: ModelOpt's FP8 scale 448 / amax rounds twice (docs/numerics.md), an ulp off for some amax
        assert torch.allclose(ours, theirs[f"{name}.logits"], rtol=0, atol=1e-6), (name, (ours - theirs[f"{name}.logits"]).abs().max())


@pytest.mark.parametrize("name", sorted(MODELS))
def test_affine_kv_save_restore_round_trip(tmp_path, name):
    model = build(name, "sdpa")
    fresh, other = copy.deepcopy(model), copy.deepcopy(model)
    model = ql.quantize(model, ql.merge_kv_config(ql.FP8_DEFAULT_CFG, ql.FP8_AFFINE_KV_CFG), forward_loop(batches()))
    ql.save(model, tmp_path / "q.pt")
    entry = ckpt.load_state(tmp_path / "q.pt")["quantizers"]["model.layers.0.self_attn.k_bmm_quantizer"]
    assert entry["_bias_value"].shape == (1, 2, 1, 16) and entry["attrs"]["bias"] == {-4: None, -2: None, "type": "static",
                                                                                      "method": "mean"}
    fresh = ql.restore(fresh, tmp_path / "q.pt")
    # the module state_dict carries the bias too: an uncalibrated copy of the recipe loads it
    other = ql.quantize(other, ql.merge_kv_config(ql.FP8_DEFAULT_CFG, ql.FP8_AFFINE_KV_CFG) | {"algorithm": None})
    assert _kv(other, 0, "k").bias_value is None
    sd = model.state_dict()
    assert "model.layers.1.self_attn.v_bmm_quantizer._bias_value" in sd
    other.load_state_dict(sd)
    x = batches(1, seed=9)[0]
    with torch.no_grad():
        expected = model(x).logits
        for restored in (fresh, other):
            for i in range(len(model.model.layers)):
                for tag in "kv":
                    assert torch.equal(_kv(restored, i, tag).bias_value, _kv(model, i, tag).bias_value)
                    assert torch.equal(_kv(restored, i, tag).amax, _kv(model, i, tag).amax)
            assert torch.equal(restored(x).logits, expected)


def test_affine_kv_checkpoint_bias_refused_when_bad():
    model = ql.quantize(build("llama", "sdpa"), AFFINE, forward_loop(batches(1)))
    state = ql.quantizer_state(model)
    state["quantizers"]["model.layers.0.self_attn.v_bmm_quantizer"]["_bias_value"] = torch.full((1, 2, 1, 16), float("nan"))
    fresh = build("llama", "sdpa")
    with pytest.raises(ql.CheckpointError, match=r"model\.layers\.0\.self_attn\.v_bmm_quantizer: invalid _bias_value: .*NaN"):
        ql.restore_state(fresh, state)
    state = ql.quantizer_state(model)
    state["quantizers"]["model.layers.0.self_attn.q_bmm_quantizer"]["_bias_value"] = torch.zeros(1, 4, 1, 16)
    with pytest.raises(ql.CheckpointError, match=r"q_bmm_quantizer: invalid _bias_value: .*no 'bias'"):
        ql.restore_state(fresh, state)
    assert not any(isinstance(m, ql.QuantModule) for m in fresh.modules())


# ------------------------------------------------------------------------------ schema 3 -> 4


def _golden_v3():
    return load_golden_writer(3)


def test_golden_v3_checkpoint_without_bias_restores():
    """An old (schema-3) checkpoint has no bias anywhere: it migrates to ``_bias_value: None`` and
    restores to the model the current code calibrates from the same data."""
    golden = _golden_v3()
    state = torch.load(os.path.join(DATA, "v3_mlp.pt"), weights_only=True)
    assert state["schema"] == 3 and all("_bias_value" not in q for q in state["quantizers"].values() if q["type"] == "tensor")
    assert ckpt.MIGRATIONS[3] is ckpt.migrate_v3_to_v4
    v4 = ckpt.migrate_v3_to_v4(state)
    assert v4["schema"] == 4 and "_bias_value" not in state["quantizers"]["fc2.input_quantizer"]  # input untouched
    assert v4["quantizers"]["fc2.input_quantizer"]["_bias_value"] is None
    assert [m["_bias_value"] for m in v4["quantizers"]["fc1.weight_quantizer"]["members"]] == [None, None]
    restored = ql.restore(golden.v2.build(), os.path.join(DATA, "v3_mlp.pt"))
    data = golden.calibration_data()
    now = ql.quantize(golden.v2.build(), golden.v2.CONFIG, lambda m: [m(x) for x in data])
    x = torch.randn(5, 16, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        assert torch.equal(restored(x), now(x))
    assert restored.fc1.input_quantizer.bias_value is None


# ------------------------------------------------------------------------------ refusals


def _with_bias(bias, **attrs) -> dict:
    return {"quant_cfg": [{"quantizer_name": "*[kv]_bmm_quantizer", "cfg": {"num_bits": (4, 3), "axis": None, "bias": bias} | attrs}],
            "algorithm": "max"}


BAD_BIAS = {
    "not_a_dict": ([-2, -4], {}, r"bias must be a dict .* got \[-2, -4\]"),
    "enable_key": ({"enable": True, -2: None}, {}, r"bias: unknown key 'enable' \(value True\)"),
    "bool_axis": ({True: None}, {}, r"bias: unknown key True"),
    "block_value": ({-2: 16}, {}, r"bias\[-2\]=16: an axis entry takes None"),
    "no_axis": ({"type": "static"}, {}, r"names no axis"),
    "bad_type": ({-2: None, "type": "affine"}, {}, r"bias\['type'\]='affine': expected 'static' or 'dynamic'"),
    "dynamic_bias": ({-2: None, "type": "dynamic"}, {}, r"bias\['type'\]='dynamic': only a static"),
    "bad_method": ({-2: None, "method": "median"}, {}, r"bias\['method'\]='median'"),
    "max_min": ({-2: None, "method": "max_min"}, {}, r"bias\['method'\]='max_min': only method 'mean'"),
    "nvfp4_blocks": ({-2: None, -4: None}, {"num_bits": (2, 1), "block_sizes": {-1: 16, "type": "dynamic", "scale_bits": (4, 3)}},
                     r"with block_sizes=.*static per-tensor or per-channel"),
    "dynamic_amax": ({-2: None, -4: None}, {"type": "dynamic"}, r"with type='dynamic'"),
}


@pytest.mark.parametrize("case", sorted(BAD_BIAS))
def test_bad_bias_config_refused_naming_quantizer_key_value(case):
    bias, attrs, match = BAD_BIAS[case]
    with pytest.raises(ql.ConfigError, match=match) as info:
        ql.merge_kv_config(ql.FP8_DEFAULT_CFG, _with_bias(bias, **attrs))
    assert "'*[kv]_bmm_quantizer'" in str(info.value)


def test_bias_axis_out_of_range_named_at_calibration():
    with pytest.raises(ValueError, match=r"model\.layers\.0\.self_attn\.k_bmm_quantizer: bias axis -5 is out of range for a 4-D tensor"):
        ql.quantize(build("llama", "sdpa"), ql.merge_kv_config(None, _with_bias({-5: None})), forward_loop(batches(1)))


def test_bias_outside_attention_refused():
    cfg = ql.merge_kv_config(ql.FP8_DEFAULT_CFG, [{"quantizer_name": "*mlp.down_proj.input_quantizer",
                                                   "cfg": {"num_bits": (4, 3), "bias": {-2: None}}}])
    with pytest.raises(ql.ConfigError, match=r"model\.layers\.0\.mlp\.down_proj\.input_quantizer \(.*\): bias=.*q/k/v bmm quantizers of "
                                             r"transformers attention only"):
        ql.quantize(build("llama", "sdpa"), cfg, forward_loop(batches(1)))


@pytest.mark.parametrize("algorithm", ["smoothquant", "mse"])
def test_bias_with_other_algorithm_refused(algorithm):
    with pytest.raises(ql.ConfigError, match=rf"k_bmm_quantizer .*: bias=.*algorithm '{algorithm}'"):
        ql.quantize(build("llama", "sdpa"), AFFINE | {"algorithm": algorithm}, forward_loop(batches(1)))


def test_bias_with_sequential_calibration_refused():
    with pytest.raises(ql.ConfigError, match=r"k_bmm_quantizer .*: bias=.*sequential \(layer-by-layer\) calibration"):
        ql.quantize(build("llama", "sdpa"), AFFINE, forward_loop(batches(1)), sequential=True)


def test_uncalibrated_static_bias_refused_at_forward():
    model = ql.quantize(build("llama", "sdpa"), AFFINE | {"algorithm": None})
    with pytest.raises(RuntimeError, match=r"model\.layers\.0\.self_attn\.k_bmm_quantizer: bias=.*not calibrated"):
        with torch.no_grad():
            model(batches(1)[0])


def test_affine_kv_export_refused_naming_the_module(tmp_path):
    model = ql.quantize(build("llama", "sdpa"), ql.merge_kv_config(ql.FP8_DEFAULT_CFG, ql.FP8_AFFINE_KV_CFG), forward_loop(batches(1)))
    with pytest.raises(ExportError, match=r"model\.layers\.0\.self_attn\.k_bmm_quantizer: affine KV-cache quantization .* format "
                                          r"modelopt_fp8"):
        export_checkpoint(model, tmp_path / "out", "modelopt_fp8")
    assert not (tmp_path / "out").exists()


def _dp_rank(rank: int, world: int) -> str:
    import torch.distributed as dist

    try:
        ql.quantize(build("llama", "sdpa"), AFFINE, forward_loop(batches(1, seed=rank)),
                    parallel_state=ql.ParallelState(data_group=dist.group.WORLD))
    except ql.ConfigError as exc:
        return str(exc)
    return "not refused"


def test_affine_kv_refused_over_data_parallel_ranks():
    for msg in run_on_ranks(_dp_rank, 2, timeout=120):
        assert "k_bmm_quantizer" in msg and "2 data-parallel ranks: the bias is not reduced" in msg, msg


def test_affine_kv_bias_survives_the_meta_device_and_shows_in_the_summary():
    """A model sent to meta and materialised (to_empty) gets its bias values back, as its amax."""
    model = ql.quantize(build("llama", "sdpa"), AFFINE, forward_loop(batches(1)))
    bias = _kv(model, 1, "v").bias_value.clone()
    model.to("meta")
    assert _kv(model, 1, "v").bias_value.is_meta and torch.equal(_kv(model, 1, "v").bias_values, bias)
    model.to_empty(device="cpu")
    assert torch.equal(_kv(model, 1, "v").bias_value, bias)
    assert "bias over (-4, -2)" in ql.quant_summary(model)
