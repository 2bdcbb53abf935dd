"""Tensors that a family's ``save_pretrained`` writes under other keys (quantlib.export.moved): renamed, transposed,
concatenated from several, padded. transformers' conversion is replaced here by one that does all four to a tiny Llama,
so each case is walked on a model whose every other key is plain; test_families judges real families by loading them."""

from __future__ import annotations

import copy

import pytest
import torch

pytest.importorskip("transformers")
import transformers.core_model_loading as cml  # noqa: E402

# save_pretrained binds revert_weight_conversion when modeling_utils is first imported: imported here, before the fixture
# patches it, so the fake save never leaks into a later test's save_pretrained
import transformers.modeling_utils  # noqa: E402, F401
from safetensors.torch import load_file  # noqa: E402

import quantlib as ql  # noqa: E402
from quantlib.export import ExportError, export_checkpoint  # noqa: E402
from tests.test_export._export_models import weight_only  # noqa: E402
from tests.test_export._families import build, tokens  # noqa: E402

A = "model.layers.0.self_attn."
PAD = 3  # rows of zeros the fake save adds to lm_head


def _save(model, state_dict):
    """A save-time conversion: norm renamed, down_proj transposed, q / k / v concatenated, lm_head padded."""
    out = {}
    qkv = [state_dict.pop(f"{A}{p}_proj.weight") for p in "qkv" if f"{A}{p}_proj.weight" in state_dict]
    if qkv:
        out[f"{A}qkv.weight"] = torch.cat(qkv)
    for k, t in state_dict.items():
        if k == "model.norm.weight":
            out["model.norm.gamma"] = t
        elif k == "model.layers.0.mlp.down_proj.weight":
            out["model.layers.0.mlp.down_kernel"] = t.t().contiguous()
        elif k == "lm_head.weight":
            out[k] = torch.cat([t, t.new_zeros(PAD, *t.shape[1:])])
        else:
            out[k] = t
    return out


@pytest.fixture
def fake_save(monkeypatch):
    monkeypatch.setattr(cml, "revert_weight_conversion", _save)


def _quantized(off: tuple[str, ...]):
    model = build("llama", seed=1)
    cfg = weight_only(ql.MXFP8_DEFAULT_CFG)
    cfg = {**cfg, "quant_cfg": {k: v for k, v in cfg["quant_cfg"].items() if k != "*lm_head*"}}  # lm_head quantized unless OFF says
    ql.quantize(model, cfg, lambda m: m(tokens(5)))
    for pattern in off:
        ql.disable_quantizer(model, pattern)
    return model


OFF = ("*q_proj*", "*k_proj*", "*v_proj*", "*down_proj*", "*lm_head*")


def test_moved_tensors_are_written_as_the_save_makes_them(tmp_path, fake_save):
    model = _quantized(OFF)
    export_checkpoint(model, tmp_path / "q", "hf_mxfp8")
    got = load_file(tmp_path / "q" / "model.safetensors")
    sd = model.state_dict()
    a = {p: sd[f"{A}{p}_proj.weight"] for p in "qkv"}
    assert torch.equal(got[f"{A}qkv.weight"], torch.cat([a["q"], a["k"], a["v"]]))
    assert torch.equal(got["model.layers.0.mlp.down_kernel"], sd["model.layers.0.mlp.down_proj.weight"].t())
    assert torch.equal(got["model.norm.gamma"], sd["model.norm.weight"])
    head = sd["lm_head.weight"]
    assert torch.equal(got["lm_head.weight"], torch.cat([head, head.new_zeros(PAD, head.shape[1])]))
    for gone in ("model.norm.weight", "model.layers.0.mlp.down_proj.weight", f"{A}q_proj.weight"):
        assert gone not in got
    assert got[f"{A}o_proj.weight"].dtype == torch.float8_e4m3fn  # the rest as ever
    with open(tmp_path / "q" / "config.json") as f:
        ignored = __import__("json").load(f)["quantization_config"]["ignored_layers"]
    assert {f"{A}q_proj", "model.layers.0.mlp.down_proj"} <= set(ignored)  # transformers matches its own module names


@pytest.mark.parametrize("on, words", [
    # rows of one key: written quantized only where a consumer reads it (test_rows_within.py), not in hf_mxfp8
    (("*q_proj*", "*k_proj*", "*v_proj*"), r"self_attn.v_proj.weight_quantizer\): transformers saves these weights as one key, "
     r"model.layers.0.self_attn.qkv.weight, and format hf_mxfp8 has no consumer that reads it quantized"),
    (("*down_proj*",), r"mlp.down_proj.weight_quantizer is enabled, but transformers saves model.layers.0.mlp.down_proj.weight as "
                    r"model.layers.0.mlp.down_kernel rearranged \(transposed or reshaped on save\)"),
    (("*lm_head*",), r"lm_head.weight_quantizer is enabled, but transformers saves lm_head.weight from \['lm_head.weight'\] and values it "
                  r"adds on save \(padding\)"),
])  # fmt: skip
def test_a_quantized_tensor_saved_under_another_key_is_refused(tmp_path, fake_save, on, words):
    model = _quantized(tuple(p for p in OFF if p not in on))
    with pytest.raises(ExportError, match=words):
        export_checkpoint(model, tmp_path / "q", "hf_mxfp8")
    assert not (tmp_path / "q").exists()


def test_keys_read_as_block_scales_are_refused_in_finegrained_fp8(tmp_path, monkeypatch):
    """transformers' fine-grained FP8 loader renames any '<m>.scale' key to '<m>.weight_scale_inv': a tensor saved so is
    refused in hf_* FP8 formats and written in ct_mxfp8."""

    def save(model, sd):
        return {("model.norm.scale" if k == "model.norm.weight" else k): t for k, t in sd.items()}

    monkeypatch.setattr(cml, "revert_weight_conversion", save)
    model = _quantized(())
    with pytest.raises(ExportError, match=r"model.norm.weight: written as model.norm.scale, but transformers' fine-grained FP8 loader"):
        export_checkpoint(model, tmp_path / "q", "hf_mxfp8")
    assert not (tmp_path / "q").exists()
    export_checkpoint(model, tmp_path / "ct", "ct_mxfp8")
    assert "model.norm.scale" in load_file(tmp_path / "ct" / "model.safetensors")


def test_folds_into_moved_tensors_are_taken_at_their_source(tmp_path, monkeypatch):
    """SmoothQuant's scales fold into the producers' output channels: o_proj's into v_proj's rows (here saved within a
    q / k / v concatenation) and gate / up's into post_attention_layernorm (here renamed): the moved keys hold exactly
    what the same export writes under the model's own names."""
    norm = "model.layers.0.post_attention_layernorm"

    def save(model, sd):
        out = {}
        if f"{A}q_proj.weight" in sd:
            out[f"{A}qkv.weight"] = torch.cat([sd.pop(f"{A}{p}_proj.weight") for p in "qkv"])
        out.update({(f"{norm}.gamma" if k == f"{norm}.weight" else k): t for k, t in sd.items()})
        return out

    model = build("llama", seed=1, num_key_value_heads=2)  # a head per value channel: o_proj's scale folds into v_proj
    cfg = {**ql.INT8_SMOOTHQUANT_CFG, "quant_cfg": {**ql.INT8_SMOOTHQUANT_CFG["quant_cfg"], "*q_proj*": {"enable": False},
                                                    "*k_proj*": {"enable": False}, "*v_proj*": {"enable": False}}}
    ql.quantize(model, cfg, lambda m: m(tokens(5)))
    assert model.model.layers[0].self_attn.o_proj.input_quantizer.pre_quant_scale is not None
    export_checkpoint(model, tmp_path / "plain", "ct_int8")
    plain = load_file(tmp_path / "plain" / "model.safetensors")
    monkeypatch.setattr(cml, "revert_weight_conversion", save)
    export_checkpoint(copy.deepcopy(model), tmp_path / "moved", "ct_int8")  # a copy: the names found for a model are kept
    moved = load_file(tmp_path / "moved" / "model.safetensors")
    qkv = torch.cat([plain[f"{A}{p}_proj.weight"] for p in "qkv"])
    assert not torch.equal(plain[f"{A}v_proj.weight"], model.model.layers[0].self_attn.v_proj.weight)  # a fold changed it
    assert torch.equal(moved[f"{A}qkv.weight"], qkv)
    assert not torch.equal(plain[f"{norm}.weight"], model.model.layers[0].post_attention_layernorm.weight)
    assert torch.equal(moved[f"{norm}.gamma"], plain[f"{norm}.weight"])


def test_weight_sync_after_a_step_sends_moved_tensors_as_they_are_now(fake_save):
    """An RL sync plans once and reads the live tensors each step: after the weights move, every moved key (renamed,
    transposed, concatenated, padded) holds the save of the new tensors, and the quantized ones their new codes."""
    from quantlib.export import sync_pairs

    model = _quantized(OFF)
    before = dict(sync_pairs(model, "hf_mxfp8"))
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(1.5).add_(0.01)
    after = dict(sync_pairs(model, "hf_mxfp8"))
    sd = model.state_dict()
    a = torch.cat([sd[f"{A}{p}_proj.weight"] for p in "qkv"])
    head = sd["lm_head.weight"]
    assert torch.equal(after[f"{A}qkv.weight"], a)
    assert torch.equal(after["model.layers.0.mlp.down_kernel"], sd["model.layers.0.mlp.down_proj.weight"].t())
    assert torch.equal(after["model.norm.gamma"], sd["model.norm.weight"])
    assert torch.equal(after["lm_head.weight"], torch.cat([head, head.new_zeros(PAD, head.shape[1])]))
    assert sorted(after) == sorted(before) and not torch.equal(after[f"{A}o_proj.weight"], before[f"{A}o_proj.weight"])


def test_a_tensor_saved_under_its_own_key_and_within_another_is_refused(tmp_path, monkeypatch):
    """A save that writes a tensor whole and also inside a key built of several: the walk writes each tensor once, so the
    export says which and writes nothing."""

    def save(model, sd):
        return {**sd, "model.norms": torch.cat([sd["model.norm.weight"], sd["model.layers.0.input_layernorm.weight"]])}

    monkeypatch.setattr(cml, "revert_weight_conversion", save)
    with pytest.raises(ExportError, match=r"transformers saves model.(norm|layers.0.input_layernorm).weight under its own key and within "
                                          r"another; quantlib cannot write both"):
        export_checkpoint(_quantized(("*lm_head*",)), tmp_path / "q", "hf_mxfp8")
    assert not (tmp_path / "q").exists()
