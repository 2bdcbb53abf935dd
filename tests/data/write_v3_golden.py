"""Writes the frozen schema-3 golden checkpoint of tests/test_kv/test_kv_affine.py (an old checkpoint,
written before affine quantization existed, must still restore). Kept for the record: ``v3_mlp.pt`` was
produced once by running it with quantlib at schema 3 (the main checkout at commit 1ea0443, torch 2.13,
CPU): ``PYTHONPATH=<quantlib at schema 3> python tests/data/write_v3_golden.py``. Do not regenerate it
for a new schema; add new golden files instead.

The model and its weights are the schema-2 golden MLP (``write_v2_golden.build()``,
``v2_mlp_weights.pt``), quantized with the same ``CONFIG`` on the same calibration data.
"""

from __future__ import annotations

import importlib.util
import os

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
# loaded by path, not through sys.path: an imported test-data folder on sys.path could shadow packages
_spec = importlib.util.spec_from_file_location("write_v2_golden", os.path.join(HERE, "write_v2_golden.py"))
v2 = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(v2)


def calibration_data() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(20261204)
    return [torch.randn(4, 16, generator=g) for _ in range(3)]


def main() -> None:
    import quantlib as ql
    from quantlib.checkpoint import SCHEMA_VERSION

    assert SCHEMA_VERSION == 3, f"run with quantlib at schema 3, got {SCHEMA_VERSION}"
    model = v2.build()
    data = calibration_data()
    ql.quantize(model, v2.CONFIG, lambda m: [m(x) for x in data])
    ql.save(model, os.path.join(HERE, "v3_mlp.pt"))


if __name__ == "__main__":
    main()
