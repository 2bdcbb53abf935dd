"""auto_quantize -> mixed-precision export, end to end: the model auto_quantize returns, and a fresh model
quantized with the config it returns, export to ``modelopt_mixed`` (NVFP4 + FP8, ModelOpt's usual pair) and
``ct_mixed`` (NVFP4 + FP8 128x128 blocks); each consumer's own code (ModelOpt's qtensors, compressed-tensors'
decompressors) gives back the fake-quantized weights, each module in the format the search chose for it.
(transformers 5's compressed-tensors loader is not used here: it dequantizes every dense module with one
scheme, its ``get_dense_scheme``, so a per-layer mix of dense schemes fails in it with KeyError 'weight',
and it cannot load FP8 block-scaled fused experts, a plain ct_fp8_block export's neither; its mixed path
for FP8 attention + INT4 experts is tests/test_export/test_mixed.py's.)

Before: a ``modelopt_mixed`` export of FP8 W8A8 modules (FP8_DEFAULT_CFG) raised "no member packs fp8":
packing picked the member by the weight alone, skipping the FP8 member that needs an input quantizer."""

from __future__ import annotations

import copy
import json
import warnings

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("compressed_tensors")
from safetensors.torch import load_file  # noqa: E402

import quantlib as ql  # noqa: E402
from quantlib.auto_quantize import auto_quantize  # noqa: E402
from quantlib.export import export_checkpoint, share_sibling_amax  # noqa: E402
from tests.test_export._export_models import fake_quant_weights, llama, qwen3_moe, tokens  # noqa: E402
from tests.test_export.test_mixed import _check  # noqa: E402

DATA = [tokens(s) for s in range(4)]


def _step(m, b):
    return m(b).logits


def _loss(out, b):
    return torch.nn.functional.cross_entropy(out[:, :-1].reshape(-1, out.shape[-1]), b[:, 1:].reshape(-1))


def _searched(base, formats: list[str], bits: float) -> tuple[list, dict]:
    """[auto_quantize's model, a fresh model quantized with its config], siblings sharing their amax as an
    export needs, and the search's state."""
    model, state = auto_quantize(copy.deepcopy(base), {"effective_bits": bits}, formats, DATA, _step, _loss,
                                 disabled_layers="*lm_head*", num_calib_steps=2, num_score_steps=2)  # fmt: skip
    assert sorted(set(state["best"]["recipe"].values())) == sorted(formats), state["best"]  # a real mix
    again = ql.quantize(copy.deepcopy(base), {**state["config"], "algorithm": "max"}, lambda m: [m(b) for b in DATA[:2]])
    models = [model, again]
    want = fake_quant_weights(model)
    got = fake_quant_weights(again)
    assert sorted(got) == sorted(want) and all(torch.equal(got[k], want[k]) for k in want)  # the config is the choice
    for m in models:
        share_sibling_amax(m)
    return models, state


def test_modelopt_mixed_nvfp4_fp8(tmp_path):
    pytest.importorskip("modelopt")
    from quantlib.pipeline.check import modelopt_dequantize
    from tests.test_export.test_modelopt import convert_hf_quant_config_format

    models, state = _searched(llama(), ["NVFP4_DEFAULT_CFG", "FP8_DEFAULT_CFG"], 6.0)
    algo = {"NVFP4_DEFAULT_CFG": "NVFP4", "FP8_DEFAULT_CFG": "FP8"}
    fmt = {"NVFP4": "modelopt_nvfp4", "FP8": "modelopt_fp8"}
    for i, model in enumerate(models):
        out = tmp_path / str(i)
        export_checkpoint(model, out, "modelopt_mixed")
        hf_quant = json.loads((out / "hf_quant_config.json").read_text())
        layers = hf_quant["quantization"]["quantized_layers"]
        assert hf_quant["quantization"]["quant_algo"] == "MIXED_PRECISION"
        assert {n: v["quant_algo"] for n, v in layers.items()} == {n: algo[c] for n, c in state["best"]["recipe"].items() if c in algo}
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            assert json.loads((out / "config.json").read_text())["quantization_config"] == convert_hf_quant_config_format(hf_quant)
        sd = load_file(out / "model.safetensors")
        expected = fake_quant_weights(model)
        assert set(expected) == set(layers)
        for name, ref in expected.items():
            t = {k.rpartition(".")[2]: v for k, v in sd.items() if k.rpartition(".")[0] == name}
            assert torch.equal(modelopt_dequantize(fmt[layers[name]["quant_algo"]], t, ref.shape), ref.float()), name


@pytest.mark.parametrize("family", ["llama", "qwen3_moe"])
def test_ct_mixed_decompresses_to_the_fake_quant_weights(tmp_path, family):
    base = llama() if family == "llama" else qwen3_moe()
    models, _ = _searched(base, ["NVFP4_DEFAULT_CFG", "FP8_2D_BLOCKWISE_WEIGHT_ONLY_CFG"], 6.0)
    for i, model in enumerate(models):
        export_checkpoint(model, tmp_path / str(i), "ct_mixed")
        _check(model, tmp_path / str(i), {"nvfp4-pack-quantized", "float-quantized"}, "<none>")
