"""The formats' own consumers reading an export back from disk (transformers ``from_pretrained`` for the HF formats,
compressed-tensors' decompressors and ModelOpt's qtensors for theirs: quantlib.pipeline.check's readers), and the pairs
(fake-quantized weight, the consumer's weight) of every quantized linear and expert, in module space."""

from __future__ import annotations

import os
import re

import torch
from torch import nn

import quantlib as ql
from quantlib.pipeline.check import _read_modules, _ulp, reload_export
from quantlib.plugins import huggingface as hf

#: how the consumer's weight compares with quantlib's fake-quantized one (docs/numerics.md): bit for bit; equal after
#: rounding to bf16 (compressed-tensors' NVFP4 multiplies in bf16); INT: within 1 ulp (consumers multiply by 1 / s)
RULES = {"ct_nvfp4": "bf16", "ct_int_pack": "ulp1", "ct_int8": "ulp1", "modelopt_int4_awq": "ulp1", "ct_mixed": "bf16"}
#: the per-tensor / global scale that siblings fused into one GEMM must share, per format (mixed: that of its NVFP4 scheme)
SHARED_SCALE = {"modelopt_fp8": "weight_scale", "modelopt_nvfp4": "weight_scale_2", "ct_nvfp4": "weight_global_scale",
                "modelopt_w4a8_awq": "weight_scale_2", "ct_mixed": "weight_global_scale", "modelopt_mixed": "weight_scale_2"}  # fmt: skip


def exported_modules(export_dir) -> dict[str, dict[str, torch.Tensor]]:
    """Checkpoint module -> its tensors by local name, as the export's safetensors files hold them."""
    return _read_modules(str(export_dir))


def _weight_parts(t: dict[str, torch.Tensor]) -> set[str]:
    """A module's tensors that hold its quantized weight: codes and scales (``weight_scale_inv``, ``weight_packed``, ...)."""
    return {k for k in t if k.startswith("weight_")}


def quantized_names(modules: dict[str, dict[str, torch.Tensor]]) -> set[str]:
    """The checkpoint modules whose weight is written quantized (codes and scales)."""
    return {m for m, t in modules.items() if _weight_parts(t)}


def dense_keys(modules: dict[str, dict[str, torch.Tensor]]) -> set[str]:
    """The keys the export would have unquantized: a quantized module's codes and scales become its ``weight``, its
    activation scales go (a router's ``e_score_correction_bias``, a bias stay)."""
    keys = set()
    for m, t in modules.items():
        parts = _weight_parts(t)
        if parts:
            parts |= {"weight", "input_scale", "input_global_scale", "pre_quant_scale"}
            keys |= {f"{m}.weight"} | {f"{m}.{k}" for k in t if k not in parts}
        else:
            keys |= {f"{m}.{k}" for k in t}
    return keys


def consumer_model(export_dir, fmt: str, shapes: dict[str, torch.Size]) -> nn.Module:
    """The export as its consumer reads it, in a dense fp32 transformers model (experts eager, as quantlib runs them)."""
    model, consumer, why = reload_export(str(export_dir), fmt, shapes, False, experts_implementation="eager")
    assert model is not None, f"{fmt}: {consumer} {why}"
    return model


@torch.no_grad()
def fake_weights(model: nn.Module) -> dict[str, torch.Tensor]:
    """Module-space name (``<experts>.<proj>[e]`` for an expert) -> ``weight_quantizer(weight)``, for every quantized
    linear and expert."""
    out = {}
    for name, m in model.named_modules():
        if isinstance(m, hf.QuantFusedExperts):
            for proj in m.projections:
                for e in range(m.num_experts):
                    if getattr(m, f"{proj}_weight_quantizer")[e].is_enabled:
                        out[f"{name}.{proj}[{e}]"] = m.quantize_weight(hf.expert_weight(m, proj, e), f"{proj}_weight_quantizer", e)
        elif isinstance(m, ql.QuantModule) and isinstance(m._parameters.get("weight"), torch.Tensor) and m.weight_quantizer.is_enabled:
            out[name] = m.quantize_weight(next(iter(m.weight_groups()))[1][0])
    return out


def consumer_weight(loaded: nn.Module, name: str) -> torch.Tensor:
    """The weight ``loaded`` holds for module-space name ``name`` (as :func:`fake_weights` names them), as (out, in)."""
    from transformers.pytorch_utils import Conv1D

    m = re.fullmatch(r"(.*)\.(\w+)\[(\d+)\]", name)
    if m:
        return hf.expert_weight(loaded.get_submodule(m.group(1)), m.group(2), int(m.group(3)))
    module = loaded.get_submodule(name)
    return module.weight.t() if isinstance(module, Conv1D) else module.weight


def fake_and_loaded(model: nn.Module, loaded: nn.Module) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """Module-space pairs (fake-quantized weight, the weight ``loaded`` holds) of every quantized linear and expert."""
    return {name: (fake, consumer_weight(loaded, name)) for name, fake in fake_weights(model).items()}


def mismatches(pairs: dict[str, tuple[torch.Tensor, torch.Tensor]], rule: str) -> list[str]:
    """The pairs that break ``rule`` ("exact", "bf16", "ulp1"), each named with its distance."""
    bad = []
    for name, (fake, got) in pairs.items():
        fake, got = fake.detach().float(), got.detach().float()
        if fake.shape != got.shape:
            bad.append(f"{name}: shape {tuple(got.shape)} != {tuple(fake.shape)}")
        elif rule == "exact" and not torch.equal(got, fake):
            bad.append(f"{name}: {_ulp(got, fake)} ulp")
        elif rule == "bf16" and not torch.equal(got.bfloat16(), fake.bfloat16()):
            bad.append(f"{name}: {_ulp(got, fake, torch.bfloat16)} bf16 ulp")
        elif rule == "ulp1" and _ulp(got, fake) > 1:
            bad.append(f"{name}: {_ulp(got, fake)} ulp")
    return bad


def save_pretrained_shapes(model: nn.Module, out_dir) -> dict[str, torch.Size]:
    """Key -> shape of what the family's own ``save_pretrained`` writes for ``model`` (unquantized)."""
    from safetensors import safe_open

    model.save_pretrained(out_dir)
    shapes = {}
    for f in os.listdir(out_dir):
        if f.endswith(".safetensors"):
            with safe_open(os.path.join(out_dir, f), "pt") as sf:
                shapes.update({k: sf.get_slice(k).get_shape() for k in sf.keys()})
    return {k: torch.Size(v) for k, v in shapes.items()}
