"""ModelOpt ``W4A8_AWQ`` export of AWQ models (INT4 blocks then FP8 per tensor, FP8 activations): the tensors ModelOpt's
exporter writes, bytes equal to ModelOpt's own INT4 packing, weights equal to ModelOpt's FP8 qtensor applied to the
INT4 stage (bit for bit), and a consumer built from the files alone (ModelOpt's qtensors for weights and activations)
giving quantlib's fake-quant logits. Needs nvidia-modelopt."""

from __future__ import annotations

import json
import warnings

import pytest
import torch

pytest.importorskip("transformers")
with warnings.catch_warnings():
    warnings.simplefilter("ignore")  # "transformers X is not tested with this modelopt"
    qtensor = pytest.importorskip("modelopt.torch.quantization.qtensor")
    from modelopt.torch.export.convert_hf_config import convert_hf_quant_config_format
    from modelopt.torch.export.quant_utils import pack_int4_in_uint8
from safetensors.torch import load_file  # noqa: E402

import quantlib as ql  # noqa: E402
from quantlib.export import ExportError, export_checkpoint, iter_packed  # noqa: E402
from quantlib.pipeline.check import modelopt_dequantize  # noqa: E402
from tests.test_export._awq_models import _calibrated  # noqa: E402
from tests.test_export._export_models import tokens  # noqa: E402

W4A8 = ql.W4A8_AWQ_BETA_CFG


@pytest.fixture(scope="module")
def models():
    # q/k/v and gate/up share their AWQ scale (it folds into the norms) and their FP8 amax, as ModelOpt's exporter makes them
    return {"llama": _calibrated("llama", W4A8), "qwen3": _calibrated("qwen3", W4A8)}


def _modules(sd: dict[str, torch.Tensor]) -> dict[str, dict[str, torch.Tensor]]:
    out: dict[str, dict[str, torch.Tensor]] = {}
    for k, v in sd.items():
        mod, _, leaf = k.rpartition(".")
        out.setdefault(mod, {})[leaf] = v
    return out


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_w4a8_awq_tensors_are_modelopts(models, tmp_path, family):
    model = models[family]
    export_checkpoint(model, tmp_path / "c", "modelopt_w4a8_awq")
    hf_quant = json.loads((tmp_path / "c" / "hf_quant_config.json").read_text())
    q = hf_quant["quantization"]
    assert (q["quant_algo"], q["group_size"], q["has_zero_point"], q["pre_quant_scale"],
            q["kv_cache_quant_algo"]) == ("W4A8_AWQ", 128, False, True, None)
    assert json.loads((tmp_path / "c" / "config.json").read_text())["quantization_config"] == convert_hf_quant_config_format(hf_quant)
    mods = _modules(load_file(tmp_path / "c" / "model.safetensors"))
    linears = [n for n, m in model.named_modules() if isinstance(getattr(m, "weight_quantizer", None), ql.SequentialQuantizer)
               and m.weight_quantizer.is_enabled]
    assert len(linears) == 14
    carried = 0
    for name in linears:
        lin, t = model.get_submodule(name), mods[name]
        out, inp = lin.weight.shape
        assert {k: (tuple(v.shape), v.dtype) for k, v in t.items() if k != "pre_quant_scale"} == {
            "weight": ((out // 2, inp), torch.uint8), "weight_scale": ((out, inp // 128), torch.float32),
            "weight_scale_2": ((), torch.float32), "input_scale": ((), torch.float32)}  # fmt: skip
        int4 = lin.weight_quantizer[0](lin.weight.detach())  # the chain's first member, its pre_quant_scale included
        assert torch.equal(pack_int4_in_uint8(int4, t["weight_scale"], 128), t["weight"]), name  # ModelOpt's own packing
        # ModelOpt's weight (the INT4 stage, then its FP8 qtensor with weight_scale_2) is the evaluated weight, bit for bit
        assert torch.equal(modelopt_dequantize("modelopt_w4a8_awq", t, lin.weight.shape), lin.quantize_weight(lin.weight).detach()), name
        carried += "pre_quant_scale" in t
    # q/k/v and gate/up scales fold into the norms; o_proj's (query heads of a GQA group disagree) and down_proj's (up_proj's
    # rows cannot take it through the chain's FP8 scale) are carried
    assert carried == 4
    for group in (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj")):  # one GEMM for the consumer: one FP8 scale
        parent = "model.layers.1." + ("self_attn." if group[0] == "q_proj" else "mlp.")
        assert len({float(mods[parent + leaf]["weight_scale_2"]) for leaf in group}) == 1
        assert len({float(mods[parent + leaf]["input_scale"]) for leaf in group}) == 1


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_w4a8_awq_consumer_logits_equal_fake_quant(models, tmp_path, family):
    """A consumer made of the files alone: each quantized linear's weight as ModelOpt dequantizes it, its input times
    ``pre_quant_scale`` then FP8 per tensor with ``input_scale`` (ModelOpt's FP8 qtensor); the rest loaded as stored."""
    model = models[family]
    export_checkpoint(model, tmp_path / "c", "modelopt_w4a8_awq")
    mods = _modules(load_file(tmp_path / "c" / "model.safetensors"))
    consumer = type(model)(model.config).eval()
    dense, hooks = {}, {}
    for mod, t in mods.items():
        if "weight_scale_2" in t:
            dense[f"{mod}.weight"] = modelopt_dequantize("modelopt_w4a8_awq", t, consumer.get_submodule(mod).weight.shape)
            hooks[mod] = (t.get("pre_quant_scale"), t["input_scale"])
        else:
            dense.update({f"{mod}.{k}": v for k, v in t.items()})
    consumer.load_state_dict(dense, strict=True)

    def fp8_input(pqs, scale):
        def hook(_m, args):
            x = args[0] if pqs is None else args[0] * pqs
            fp8, _ = qtensor.FP8QTensor.quantize(x, scales=scale)
            return (fp8.dequantize(dtype=x.dtype, scale=scale),)

        return hook

    for mod, (pqs, scale) in hooks.items():
        consumer.get_submodule(mod).register_forward_pre_hook(fp8_input(pqs, scale))
    with torch.no_grad():
        got, ref = consumer(tokens()).logits, model(tokens()).logits
    assert (got - ref).abs().max() <= 1e-5 * ref.abs().max()


def test_w4a8_refusals_name_the_quantizer(models, tmp_path):
    llama = models["llama"]
    with pytest.raises(ExportError, match=r"^model\.layers\.0\.self_attn\.q_proj\.weight_quantizer: chained member 1 = fp8 element=\(4, "
                                          r"3\): format modelopt_int4_awq cannot carry it .*modelopt_w4a8_awq"):
        export_checkpoint(llama, tmp_path / "a", "modelopt_int4_awq")
    # o_proj's AWQ scale has no place in ct_int_pack: v_proj's rows cannot take it through the chain's FP8 scale
    with pytest.raises(ExportError, match=r"^model\.layers\.0\.self_attn\.o_proj\.input_quantizer: pre_quant_scale "
                                          r".*v_proj\.weight_quantizer is a chain"):
        export_checkpoint(llama, tmp_path / "b", "ct_int_pack")
    with pytest.raises(ExportError, match=r"^model\.layers\.0\.self_attn\.q_proj\.weight_quantizer: a chained weight quantizer \(W4A8\) "
                                          r"packs with its calibrated scales only"):
        next(iter_packed(llama, "modelopt_w4a8_awq", scales="dynamic"))
    int4 = _calibrated("llama", ql.INT4_AWQ_CFG, share=False)
    with pytest.raises(ExportError, match=r"^model\.layers\.0\.self_attn\.q_proj\.weight_quantizer: chained member 1 = none: format "
                                          r"modelopt_w4a8_awq cannot carry it \(W4A8_AWQ needs a weight chain"):
        export_checkpoint(int4, tmp_path / "c", "modelopt_w4a8_awq")
    second = llama.model.layers[1].mlp.down_proj.weight_quantizer[1]
    second.disable()  # one chain with its FP8 member off
    try:
        with pytest.raises(ExportError, match=r"^model\.layers\.1\.mlp\.down_proj\.weight_quantizer = SequentialQuantizer \[int num_bits=4 "
                                              r"block=\(128,\), disabled\]: export formats carry a chain of two enabled members only"):
            export_checkpoint(llama, tmp_path / "d", "modelopt_w4a8_awq")
    finally:
        second.enable()


def test_w4a8_siblings_need_one_scale(tmp_path):
    """q/k/v and gate/up are one GEMM for the consumer (ModelOpt's exporter resmooths them and takes one FP8 amax): left
    with their own AWQ scales and FP8 amax, the export refuses, naming them, until share_* gives them one."""
    from quantlib.export import share_pre_quant_scale, share_sibling_amax

    model = _calibrated("qwen3", W4A8, share=False)
    with pytest.raises(ExportError, match=r"^siblings \('model\.layers\.0\.self_attn\.q_proj', 'model\.layers\.0\.self_attn\.k_proj', "
                                          r"'model\.layers\.0\.self_attn\.v_proj'\) .*"
                                          r"model\.layers\.0\.self_attn\.q_proj\.weight_quantizer\[1\] = "):
        export_checkpoint(model, tmp_path / "a", "modelopt_w4a8_awq")
    assert share_sibling_amax(model)  # the FP8 members now agree, the AWQ scales still differ
    with pytest.raises(ExportError, match=r"^model\.layers\.0\.self_attn\.k_proj\.input_quantizer and "
                                          r"model\.layers\.0\.self_attn\.q_proj\.input_quantizer: "
                                          r"siblings fused by consumers into one GEMM need one pre_quant_scale"):
        export_checkpoint(model, tmp_path / "b", "modelopt_w4a8_awq")
    share_pre_quant_scale(model, lambda m: m(tokens(5)))
    share_sibling_amax(model)
    export_checkpoint(model, tmp_path / "c", "modelopt_w4a8_awq")
