"""compressed-tensors' own decompressors (and transformers' compressed-tensors path for a dense model) on
quantlib's CT exports: FP8 block, MXFP8, MXFP4 bit-exact; NVFP4 equal after bf16 rounding; INT: codes
identical, the consumer's weight is exactly codes x exported scale and at most 1 ulp from quantlib's
fake quantization (docs/numerics.md). Every config passes CT's own parser. Needs compressed-tensors."""

from __future__ import annotations

import json

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("compressed_tensors")
from compressed_tensors.compressors import BaseCompressor  # noqa: E402
from compressed_tensors.compressors.pack_quantized.helpers import unpack_from_int32  # noqa: E402
from compressed_tensors.quantization import QuantizationConfig  # noqa: E402
from safetensors.torch import load_file  # noqa: E402

import quantlib as ql  # noqa: E402
from quantlib.export import export_checkpoint  # noqa: E402
from tests.test_export._export_models import (  # noqa: E402
    fake_quant_weights,
    llama,
    quantized,
    qwen3_moe,
    reference_codes,
    tokens,
    weight_only,
)

INT8_W = {"quant_cfg": {"*weight_quantizer": {"num_bits": 8, "axis": 0}, "default": {"enable": False}}, "algorithm": "max"}
CASES = {
    "ct_fp8_block": (weight_only(ql.FP8_2D_BLOCKWISE_WEIGHT_ONLY_CFG), "exact"),
    "ct_mxfp8": (weight_only(ql.MXFP8_DEFAULT_CFG), "exact"),
    "ct_mxfp4": (weight_only(ql.MXFP4_DEFAULT_CFG), "exact"),
    "ct_nvfp4": (weight_only(ql.NVFP4_DEFAULT_CFG), "bf16"),
    "ct_int_pack": (ql.INT4_BLOCKWISE_WEIGHT_ONLY_CFG, "int"),
    "ct_int8": (INT8_W, "int"),
}


@pytest.fixture(scope="module")
def bases():
    return {"llama": llama(), "qwen3_moe": qwen3_moe()}


def _decompress(out_dir) -> tuple[dict, dict[str, torch.Tensor], dict]:
    qc = json.loads((out_dir / "config.json").read_text())["quantization_config"]
    parsed = QuantizationConfig.model_validate(qc)  # CT's own parser
    scheme = parsed.config_groups["group_0"]
    compressor = BaseCompressor.get_value_from_registry(qc["format"])
    sd = load_file(out_dir / "model.safetensors")
    by_module: dict[str, dict] = {}
    for k, t in sd.items():
        mod, _, local = k.rpartition(".")
        by_module.setdefault(mod, {})[local] = t
    out = {mod: compressor.decompress(local, scheme)["weight"] for mod, local in by_module.items() if "weight_scale" in local}
    return qc, out, by_module


def _ulp_distance(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    a, b = a.float(), b.float()
    ia, ib = a.view(torch.int32).long(), b.view(torch.int32).long()
    d = (ia - ib).abs()
    return torch.where((a == 0) & (b == 0), torch.zeros_like(d), d)  # +0 and -0: packed codes keep no sign of zero


@pytest.mark.parametrize("fmt", sorted(CASES))
@pytest.mark.parametrize("family", ["llama", "qwen3_moe"])
def test_ct_decompressor_matches_fake_quant(bases, tmp_path, fmt, family):
    cfg, rule = CASES[fmt]
    model = quantized(bases[family], cfg)
    export_checkpoint(model, tmp_path / "c", fmt)
    qc, got, raw = _decompress(tmp_path / "c")
    expected = fake_quant_weights(model)
    assert set(got) == set(expected)
    assert set(qc["ignore"]) >= {"lm_head", "model.embed_tokens"}
    for name, ref in expected.items():
        out = got[name]
        if rule == "exact":
            assert torch.equal(out.float(), ref.float()), name
        elif rule == "bf16":
            assert raw[name]["weight_global_scale"].shape == (1,)
            assert torch.equal(out.to(torch.bfloat16), ref.to(torch.bfloat16)), name
        else:
            _check_int(name, out, ref, raw[name], model, fmt)


def _check_int(name, out, ref, tensors, model, fmt):
    scale = tensors["weight_scale"]
    assert scale.dtype == torch.float32
    if fmt == "ct_int_pack":
        codes = unpack_from_int32(tensors["weight_packed"], 4, torch.Size(tensors["weight_shape"].tolist()))
    else:
        codes = tensors["weight"]
    assert torch.equal(codes.to(torch.int8), reference_codes(model, name).to(torch.int8))  # codes identical
    g = codes.shape[1] // scale.shape[1]
    assert torch.equal(out.float(), codes.float() * scale.repeat_interleave(g, dim=1))  # consumer = codes x scale, exactly
    assert int(_ulp_distance(out, ref).max()) <= 1  # and at most 1 ulp from quantlib's q / s


def test_transformers_ct_path_dense_logits_bit_exact(bases, tmp_path):
    from transformers import AutoModelForCausalLM, CompressedTensorsConfig

    model = quantized(bases["llama"], weight_only(ql.FP8_2D_BLOCKWISE_WEIGHT_ONLY_CFG))
    export_checkpoint(model, tmp_path / "c", "ct_fp8_block")
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "c", dtype=torch.float32,
                                                  quantization_config=CompressedTensorsConfig(run_compressed=False, dequantize=True))
    for name, ref in fake_quant_weights(model).items():
        assert torch.equal(loaded.get_submodule(name).weight.float(), ref), name
    ids = tokens()
    with torch.no_grad():
        assert torch.equal(loaded(ids).logits, model(ids).logits)


def test_nvfp4_w4a4_input_global_scale(bases, tmp_path):
    model = quantized(bases["llama"], ql.NVFP4_DEFAULT_CFG)
    export_checkpoint(model, tmp_path / "c", "ct_nvfp4")
    qc = json.loads((tmp_path / "c" / "config.json").read_text())["quantization_config"]
    assert QuantizationConfig.model_validate(qc).config_groups["group_0"].input_activations.strategy == "tensor_group"
    sd = load_file(tmp_path / "c" / "model.safetensors")
    q = model.model.layers[0].self_attn.q_proj.input_quantizer
    assert torch.equal(sd["model.layers.0.self_attn.q_proj.input_global_scale"], torch.tensor([2688.0]) / q.amax.reshape(1))


@pytest.mark.parametrize("bits", [2, 3, 4, 5, 6, 7, 8])
def test_pack_int32_is_compressed_tensors_packing(bits):
    # every width (those that divide 32 pack word by word, the others as a bit stream), odd lengths, both extremes
    from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32

    from quantlib.export.writers.ct_int_pack import pack_int32

    lo, hi = -(1 << (bits - 1)), (1 << (bits - 1)) - 1
    for n in (1, 31, 33, 100, 256):
        codes = torch.randint(lo, hi + 1, (3, n), generator=torch.Generator().manual_seed(n), dtype=torch.int8)
        codes[0, 0], codes[1, -1] = lo, hi
        assert torch.equal(pack_int32(codes, bits), pack_to_int32(codes, bits)), (bits, n)
