"""AWQ / SmoothQuant on fused MoE experts (one pre_quant_scale row per expert): ModelOpt's AWQ formats carry each expert's
own scale under the family's per-expert names (Qwen3-MoE's ``mlp.experts.{e}.gate_proj``, Mixtral's
``block_sparse_moe.experts.{e}.w1``), and the consumer's logits equal quantlib's fake-quant model's; down_proj's scale
folds into the same expert's up rows where a format has no pre_quant_scale; gate/up's folds nowhere and is refused by
name, with the formats that carry it."""

from __future__ import annotations

import copy
import re

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("compressed_tensors")

import quantlib as ql  # noqa: E402
from quantlib.export import ExportError, export_checkpoint, share_pre_quant_scale, share_sibling_amax  # noqa: E402
from tests.test_export._families import build, tokens  # noqa: E402
from tests.test_export.test_fold_consumers import MOE, RECIPES, SHAPE, _consumer, _loop, _reference  # noqa: E402

#: family -> the experts module and its per-expert checkpoint names (gate, up, down), as save_pretrained writes them
NAMES = {"qwen3_moe": ("model.layers.0.mlp.experts", "model.layers.0.mlp.experts.{}.", ("gate_proj", "up_proj", "down_proj")),
         "mixtral": ("model.layers.0.mlp.experts", "model.layers.0.block_sparse_moe.experts.{}.", ("w1", "w3", "w2")),
         "qwen2_moe": ("model.layers.0.mlp.experts", "model.layers.0.mlp.experts.{}.", ("gate_proj", "up_proj", "down_proj"))}
CASES = [("qwen3_moe", "int4_awq_lite", "modelopt_int4_awq"), ("qwen3_moe", "int4_awq_full", "modelopt_int4_awq"),
         ("qwen3_moe", "nvfp4_awq_lite", "modelopt_nvfp4"), ("qwen3_moe", "w4a8_awq", "modelopt_w4a8_awq"),
         ("mixtral", "int4_awq_lite", "modelopt_int4_awq"), ("mixtral", "nvfp4_awq_full", "modelopt_nvfp4"),
         ("qwen2_moe", "int4_awq_lite", "modelopt_int4_awq")]  # fmt: skip
TOL = 1e-5  # test_fold_consumers' bound for every format but ct_nvfp4


@pytest.fixture(scope="module")
def calibrated():
    cache: dict[tuple, torch.nn.Module] = {}

    def get(family: str, recipe: str, **quant_cfg) -> torch.nn.Module:
        key = (family, recipe, tuple(sorted(quant_cfg)))
        if key not in cache:
            model = build(family, **SHAPE, **MOE[family])
            cfg = copy.deepcopy(RECIPES[recipe][0])
            cfg["quant_cfg"].update(quant_cfg)
            ql.quantize(model, cfg, _loop)
            ql.disable_quantizer(model, "*lm_head*")
            share_pre_quant_scale(model, _loop)
            share_sibling_amax(model)
            cache[key] = model
        return cache[key]

    return get


def _assert_logits(model, family: str, out_dir, fmt: str) -> None:
    with torch.no_grad():
        got = _consumer(model, family, out_dir, fmt)(tokens()).logits
    ref = _reference(model)
    assert (got - ref).abs().max() <= TOL * ref.abs().max(), float((got - ref).abs().max())


@pytest.mark.parametrize("family, recipe, fmt", CASES, ids=["-".join(c) for c in CASES])
def test_carried_per_expert(calibrated, tmp_path, family, recipe, fmt):
    """Every expert part carries its own expert's row under the family's name (gate and up: the one row of their shared
    input), in the table's dtype, [in]; the consumer applies them and its logits equal the fake-quant model's."""
    from safetensors.torch import load_file

    model = calibrated(family, recipe)
    experts, ckpt, (gate, up, down) = NAMES[family]
    mod = model.get_submodule(experts)
    p_up, p_down = mod.gate_up_proj_input_quantizer.pre_quant_scale, mod.down_proj_input_quantizer.pre_quant_scale
    assert p_up.dim() == 2 and p_down.dim() == 2
    assert not torch.equal(p_up[0], p_up[1]), "the experts' own scales differ: a shared one would hide a wrong row"
    export_checkpoint(model, tmp_path / "c", fmt)
    sd = load_file(tmp_path / "c" / "model.safetensors")
    carried = {k for k in sd if ".experts." in k and k.endswith(".pre_quant_scale")}
    assert carried == {ckpt.format(e) + f"{leaf}.pre_quant_scale" for e in range(mod.num_experts) for leaf in (gate, up, down)}
    for e in range(mod.num_experts):
        for leaf, p in ((gate, p_up), (up, p_up), (down, p_down)):
            t = sd[ckpt.format(e) + f"{leaf}.pre_quant_scale"]
            assert t.dtype == p.dtype and torch.equal(t, p[e]), (e, leaf)
            assert ckpt.format(e) + f"{leaf}.weight" in sd
    _assert_logits(model, family, tmp_path / "c", fmt)


@pytest.mark.parametrize("recipe, fmt", [("int4_awq_lite", "ct_int_pack"), ("int8_smoothquant", "ct_int8"),
                                         ("nvfp4_awq_lite", "ct_nvfp4")])  # fmt: skip
def test_gate_up_scale_refused_where_not_carried(calibrated, tmp_path, recipe, fmt):
    """gate/up's rows differ per expert and the norm before them feeds the router and every expert: no op takes them,
    and a format without pre_quant_scale refuses them naming the experts' quantizer, the scale's shape and the formats
    that carry it."""
    model = calibrated("qwen3_moe", recipe)
    name = "model.layers.0.mlp.experts.gate_up_proj_input_quantizer"
    with pytest.raises(ExportError, match=rf"^{re.escape(name)}: pre_quant_scale of shape \(4, 128\) \(one row per expert.*\) on a "
                                          rf"QuantQwen3MoeExperts folds nowhere .*format {fmt} has no pre_quant_scale tensor: .*"
                                          r"modelopt_int4_awq, modelopt_nvfp4 \(NVFP4_AWQ\), modelopt_w4a8_awq"):
        export_checkpoint(model, tmp_path / "c", fmt)
    assert not (tmp_path / "c").exists()


def test_down_scale_folds_into_unquantized_up_rows(calibrated, tmp_path):
    """Experts' gate/up left unquantized, down_proj AWQ'd: each expert's down scale folds into its own up rows
    (``act(gate) * up * p``), so compressed-tensors (no pre_quant_scale) exports it and its logits equal; ModelOpt's
    INT4_AWQ carries it instead (what TensorRT-LLM's MoE loaders read)."""
    from safetensors.torch import load_file

    model = calibrated("mixtral", "int4_awq_lite", **{"*experts.gate_up_proj*": {"enable": False}})
    mod = model.model.layers[0].mlp.experts
    p = mod.down_proj_input_quantizer.pre_quant_scale
    assert p is not None and mod.gate_up_proj_input_quantizer.pre_quant_scale is None
    export_checkpoint(model, tmp_path / "ct", "ct_int_pack")
    sd = load_file(tmp_path / "ct" / "model.safetensors")
    w3 = "model.layers.0.block_sparse_moe.experts.1.w3.weight"
    assert torch.equal(sd[w3], (mod.gate_up_proj[1, 128:].float() * p[1].float()[:, None]).to(sd[w3].dtype))
    assert torch.equal(sd["model.layers.0.block_sparse_moe.experts.1.w1.weight"], mod.gate_up_proj[1, :128])
    _assert_logits(model, "mixtral", tmp_path / "ct", "ct_int_pack")
    export_checkpoint(model, tmp_path / "mo", "modelopt_int4_awq")
    assert "model.layers.0.block_sparse_moe.experts.1.w2.pre_quant_scale" in load_file(tmp_path / "mo" / "model.safetensors")
    _assert_logits(model, "mixtral", tmp_path / "mo", "modelopt_int4_awq")


def _without_gate_up_scale(model: torch.nn.Module) -> torch.nn.Module:
    """A copy of ``model`` whose experts' gate/up hold no pre_quant_scale (weights recalibrated without it); down keeps its."""
    model = copy.deepcopy(model)
    mod = model.model.layers[0].mlp.experts
    mod.gate_up_proj_input_quantizer.pre_quant_scale = None
    for q in mod.gate_up_proj_weight_quantizer:
        q.pre_quant_scale = None
    mod.calibrate_weights()
    return model


def test_down_scale_folds_into_int_up_rows(calibrated, tmp_path):
    """INT4 up rows (one scale per row and group) take down's scale in their scales, codes kept: compressed-tensors
    exports the experts and its logits equal (ModelOpt's INT4_AWQ carries it)."""
    from safetensors.torch import load_file

    model = _without_gate_up_scale(calibrated("qwen3_moe", "int4_awq_lite"))
    mod = model.model.layers[0].mlp.experts
    p = mod.down_proj_input_quantizer.pre_quant_scale
    export_checkpoint(model, tmp_path / "ct", "ct_int_pack")
    sd = load_file(tmp_path / "ct" / "model.safetensors")
    assert not any(k.endswith("pre_quant_scale") for k in sd)
    _assert_logits(model, "qwen3_moe", tmp_path / "ct", "ct_int_pack")
    export_checkpoint(model, tmp_path / "mo", "modelopt_int4_awq")
    assert torch.equal(load_file(tmp_path / "mo" / "model.safetensors")["model.layers.0.mlp.experts.2.down_proj.pre_quant_scale"], p[2])
    _assert_logits(model, "qwen3_moe", tmp_path / "mo", "modelopt_int4_awq")


def test_down_scale_refused_where_up_rows_cannot_take_it(calibrated, tmp_path):
    """NVFP4 up rows share block scales along the input and a global one: down's scale folds nowhere in ct_nvfp4, refused
    naming the quantizer, the shape and why."""
    model = _without_gate_up_scale(calibrated("qwen3_moe", "nvfp4_awq_lite"))
    name = "model.layers.0.mlp.experts.down_proj_input_quantizer"
    with pytest.raises(ExportError, match=rf"^{re.escape(name)}: pre_quant_scale of shape \(4, 128\) .*"
                                          r"gate_up_proj_weight_quantizer\[0\] \(nvfp4\) has no scale per output row"):
        export_checkpoint(model, tmp_path / "c", "ct_nvfp4")


def test_smoothquant_down_scale_folds_into_up_rows(calibrated, tmp_path):
    """SmoothQuant on the experts' down_proj (gate/up excluded): INT8 per-channel compressed-tensors takes each expert's
    scale in its up rows and gives the fake-quant logits (no format carries SmoothQuant's gate/up scales: INT8 has no
    ModelOpt AWQ format)."""
    model = calibrated("qwen3_moe", "int8_smoothquant", **{"*experts.gate_up_proj*": {"enable": False}})
    assert model.model.layers[0].mlp.experts.down_proj_input_quantizer.pre_quant_scale.dim() == 2
    export_checkpoint(model, tmp_path / "c", "ct_int8")
    _assert_logits(model, "qwen3_moe", tmp_path / "c", "ct_int8")
