"""Megatron-Core GPTModel (2 layers, 4 SequentialMLP experts top-2, gated MLP) on 4 gloo ranks: the
export at TP2xEP2 is byte for byte the export at TP1 (NVFP4 and INT8 per-channel weights), and the TP1
export's q / k / v and gate / up halves dequantize to the slices of quantlib's fake-quantized fused
weights."""

from __future__ import annotations

import hashlib
import os

import pytest
import torch

pytest.importorskip("psutil")
pytest.importorskip("megatron.core")
import quantlib as ql  # noqa: E402
from tests.test_plugins import megatron_shims as shims  # noqa: E402

pytestmark = [pytest.mark.megatron, pytest.mark.distributed]

#: weight-only: activation amax come from forward passes whose TP reductions round differently at each
#: layout (last bits), so they are the same model's only up to calibration; weights and their amax are exact
NVFP4_W = {"quant_cfg": {"*weight_quantizer": ql.NVFP4_DEFAULT_CFG["quant_cfg"]["*weight_quantizer"], "*router*": {"enable": False},
                         "default": {"enable": False}}, "algorithm": "max"}
CASES = {"modelopt_nvfp4": NVFP4_W, "ct_int8": ql.INT8_WEIGHT_ONLY_CFG}


def _digest(out_dir: str) -> dict[str, str]:
    return {f: hashlib.sha256(open(os.path.join(out_dir, f), "rb").read()).hexdigest() for f in sorted(os.listdir(out_dir))}


def export_layouts(tmp: str, layouts: tuple, cases: dict, build, check) -> dict:
    """On every rank: each layout's model built by ``build(tp, ep)``, max-calibrated with each case's config
    on its share of the data and exported; on rank 0, the file digests by (layout, format) and, under
    "check", ``check(model, path, qkv rows)`` of the TP1 ModelOpt NVFP4 export."""
    from megatron.core import parallel_state as mpu

    from quantlib.export.megatron_export import export_megatron_checkpoint
    from quantlib.export.megatron_names import qkv_rows

    out: dict = {}
    for layout in layouts:
        tp, ep = shims.LAYOUTS[layout]
        shims.set_layout(tp, ep)
        for fmt, cfg in cases.items():
            model = build(tp, ep)
            dp, dp_rank = mpu.get_data_parallel_world_size(), mpu.get_data_parallel_rank()
            data = shims.token_batches(4, 1)[dp_rank::dp]
            ql.quantize(model, cfg, shims.forward_loop(data), parallel_state=ql.ParallelState.from_megatron())
            path = os.path.join(tmp, f"{layout}-{fmt}")
            export_megatron_checkpoint(model, path, fmt, hf_config={})
            if torch.distributed.get_rank() == 0:
                out[(layout, fmt)] = _digest(path)
                if layout == "tp1" and fmt == "modelopt_nvfp4":
                    out["check"] = check(model, path, qkv_rows(model.config))
    return out


def nvfp4_weights(path: str):
    """A function of a module name: its dequantized weight in the ModelOpt NVFP4 export at ``path``."""
    from safetensors.torch import load_file

    from quantlib.formats.nvfp4 import nvfp4_dequantize

    sd = load_file(os.path.join(path, "model.safetensors"))

    def deq(name: str) -> torch.Tensor:
        return nvfp4_dequantize(sd[f"{name}.weight"], sd[f"{name}.weight_scale"], sd[f"{name}.weight_scale_2"],
                                sd[f"{name}.weight"].shape[1] * 2)

    deq.keys = sd.keys()
    return deq


def _build_moe(tp: int, ep: int):
    return shims.build_gpt(tp, ep, 0, gated_linear_unit=True)


def _export_all(rank: int, world: int, tmp: str) -> dict:
    return export_layouts(tmp, ("tp1", "tp2ep2"), CASES, _build_moe, _check_tp1)


def _check_tp1(model, path: str, qkv) -> list[str]:
    deq = nvfp4_weights(path)
    bad = []

    for i, layer in enumerate(model.decoder.layers):
        attn = layer.self_attention.linear_qkv
        fq = attn.weight_quantizer(attn.weight)
        for leaf, rows in zip(("q_proj", "k_proj", "v_proj"), qkv):
            if not torch.equal(deq(f"model.layers.{i}.self_attn.{leaf}"), fq[rows]):
                bad.append(f"layer {i} {leaf}")
        for j, expert in enumerate(layer.mlp.experts.local_experts):
            fc1 = expert.linear_fc1
            fq = fc1.weight_quantizer(fc1.weight)
            half = fq.shape[0] // 2
            for leaf, part in (("gate_proj", fq[:half]), ("up_proj", fq[half:])):
                if not torch.equal(deq(f"model.layers.{i}.mlp.experts.{j}.{leaf}"), part):
                    bad.append(f"layer {i} expert {j} {leaf}")
    return bad


def test_tp2ep2_export_equals_tp1_byte_for_byte(tmp_path):
    results = shims.run_distributed(_export_all, 4, str(tmp_path), timeout=300)
    out = results[0]
    assert out["check"] == []
    for fmt in CASES:
        tp1, tp2ep2 = out[("tp1", fmt)], out[("tp2ep2", fmt)]
        assert "model.safetensors" in tp1 and tp1 == tp2ep2, fmt
