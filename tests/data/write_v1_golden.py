"""Writes the frozen schema-1 golden checkpoints of tests/test_migrations.py. Kept for the record:
the files in this folder were produced by running it once (``python tests/data/write_v1_golden.py``,
torch 2.13); do not regenerate them for a new schema, add new golden files instead.

It depends on torch only (never on quantlib, whose code moves on) and writes exactly what quantlib's
schema-1 ``save()`` wrote (``torch.save`` of ``{"schema": 1, "config": ..., "quantizers": ...}``) for
the toy model below, in the two layouts schema 1 allowed for a grouped linear's weight quantizer:

- ``v1_anchor_shared.pt``: the anchor implementation's layout: one shared ``"tensor"`` entry with one
  ``_amax`` for all GEMMs of a grouped linear (the max over every GEMM's weight, as its single
  quantizer calibrated on each weight in turn);
- ``v1_grouped_members.pt``: quantlib 0.1.0's schema-1 layout: ``"grouped"`` with one member per GEMM,
  each with its own weight's amax.

``v1_toy_weights.pt`` holds the toy model's parameters, so a test can rebuild it. The toy model::

    experts       grouped linear, 4 GEMMs, 16 -> 8, weights weight0..weight3, weight i ~ 2**i * N(0, 1)
                  input FP8 E4M3 per tensor, weight FP8 E4M3 per tensor, output disabled
    experts_int8  grouped linear, 3 GEMMs, 16 -> 8, weight i ~ 2**i * N(0, 1)
                  input disabled, weight INT8 per output channel (axis 0), output disabled
    proj          nn.Linear(8, 8), input INT8 per tensor, weight INT8 per channel, output disabled
"""

from __future__ import annotations

import copy
import os

import torch

HERE = os.path.dirname(os.path.abspath(__file__))


def attrs(enable: bool = True, num_bits=8, axis=None) -> dict:
    """The schema-1 attribute dict (every field of quantlib 0.1.0's QuantizerAttributeConfig)."""
    return {"enable": enable, "num_bits": num_bits, "axis": axis, "block_sizes": None, "unsigned": False, "narrow_range": True,
            "fake_quant": True,
            "calibrator": "max", "learn_amax": False, "eps": 1e-10, "pow2_scale": False, "rounding": "rceil",
            "backend": "auto"}  # fmt: skip


def tensor(a: dict, amax) -> dict:
    return {"type": "tensor", "attrs": a, "_amax": amax}


def weights() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(20261202)
    out = {}
    for name, num in (("experts", 4), ("experts_int8", 3)):
        for i in range(num):
            out[f"{name}.weight{i}"] = (2.0**i) * torch.randn(8, 16, generator=g)
    out["proj.weight"] = torch.randn(8, 8, generator=g)
    out["proj.bias"] = torch.randn(8, generator=g)
    return out


def per_channel(w: torch.Tensor) -> torch.Tensor:
    return w.abs().amax(dim=1, keepdim=True)


def states(w: dict[str, torch.Tensor]) -> tuple[dict, dict]:
    fp8, int8, int8_ch, off = attrs(num_bits=(4, 3)), attrs(num_bits=8), attrs(num_bits=8, axis=(0,)), attrs(enable=False)
    experts = [w[f"experts.weight{i}"] for i in range(4)]
    experts_int8 = [w[f"experts_int8.weight{i}"] for i in range(3)]
    common = {
        "experts.input_quantizer": tensor(fp8, torch.tensor(3.25)),
        "experts.output_quantizer": tensor(off, None),
        "experts_int8.input_quantizer": tensor(off, None),
        "experts_int8.output_quantizer": tensor(off, None),
        "proj.input_quantizer": tensor(int8, torch.tensor(5.5)),
        "proj.weight_quantizer": tensor(int8_ch, per_channel(w["proj.weight"])),
        "proj.output_quantizer": tensor(off, None),
    }
    config = {
        "quant_cfg": [
            {"quantizer_name": "*", "cfg": None, "enable": False, "module_class": None},
            {"quantizer_name": "experts.*_quantizer", "cfg": fp8, "enable": None, "module_class": None},
            {"quantizer_name": "experts_int8.weight_quantizer", "cfg": int8_ch, "enable": None, "module_class": None},
            {"quantizer_name": "proj.input_quantizer", "cfg": int8, "enable": None, "module_class": None},
            {"quantizer_name": "proj.weight_quantizer", "cfg": int8_ch, "enable": None, "module_class": None},
            {"quantizer_name": "*output_quantizer", "cfg": None, "enable": False, "module_class": None},
        ],
        "algorithm": "max",
        "expert_input_policy": "max_of_peers",
        "sync_expert_weight_amax": False,
    }
    shared = dict(common)
    shared["experts.weight_quantizer"] = tensor(fp8, torch.stack([x.abs().amax() for x in experts]).amax())
    shared["experts_int8.weight_quantizer"] = tensor(int8_ch, torch.stack([per_channel(x) for x in experts_int8]).amax(dim=0))
    members = dict(common)
    members["experts.weight_quantizer"] = {"type": "grouped", "members": [tensor(fp8, x.abs().amax()) for x in experts]}
    members["experts_int8.weight_quantizer"] = {"type": "grouped", "members": [tensor(int8_ch, per_channel(x)) for x in experts_int8]}
    return (
        {"schema": 1, "config": copy.deepcopy(config), "quantizers": shared},
        {"schema": 1, "config": copy.deepcopy(config), "quantizers": members},
    )


def main() -> None:
    w = weights()
    shared, members = states(w)
    torch.save(w, os.path.join(HERE, "v1_toy_weights.pt"))
    torch.save(shared, os.path.join(HERE, "v1_anchor_shared.pt"))
    torch.save(members, os.path.join(HERE, "v1_grouped_members.pt"))


if __name__ == "__main__":
    main()
