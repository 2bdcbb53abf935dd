"""Writes the frozen schema-5 golden checkpoint of tests/test_nn/test_pass_through_bwd.py (an old
checkpoint, written when every static quantizer clipped its straight-through gradient at the amax, must
restore with that backward). Kept for the record: ``v5_mlp.pt`` was produced once by running it with
quantlib at schema 5 (the main checkout at commit d1ac3fc, torch 2.13, CPU):
``PYTHONPATH=<quantlib at schema 5> python tests/data/write_v5_golden.py``. Do not regenerate it for a
new schema; add new golden files instead.

The model, its weights, config and calibration data are those of the schema-3 golden file
(``write_v3_golden``): static INT4-block, FP8 and INT8 quantizers, whose gradients schema 5 clipped.
"""

from __future__ import annotations

import importlib.util
import os

HERE = os.path.dirname(os.path.abspath(__file__))
# loaded by path, not through sys.path: an imported test-data folder on sys.path could shadow packages
_spec = importlib.util.spec_from_file_location("write_v3_golden", os.path.join(HERE, "write_v3_golden.py"))
v3 = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(v3)


def main() -> None:
    import quantlib as ql
    from quantlib.checkpoint import SCHEMA_VERSION

    assert SCHEMA_VERSION == 5, f"run with quantlib at schema 5, got {SCHEMA_VERSION}"
    model = v3.v2.build()
    data = v3.calibration_data()
    ql.quantize(model, v3.v2.CONFIG, lambda m: [m(x) for x in data])
    ql.save(model, os.path.join(HERE, "v5_mlp.pt"))


if __name__ == "__main__":
    main()
