"""Presets that need a calibration algorithm beyond max, or quantize only part of a model, under
ModelOpt 0.47's names and meaning (plain dicts in ModelOpt's dict form: copy and edit them freely).
They join :data:`quantlib.config.PRESETS`, the one table of every preset.

Not here because quantlib has no such format: ModelOpt's ``W4A8_NVFP4_FP8_CFG`` and
``NVFP4_MLP_WEIGHT_ONLY_CFG`` (E2M1 with E4M3 scales over blocks of 32), ``MXFP6_DEFAULT_CFG`` (E3M2
elements), ``MXINT8_DEFAULT_CFG`` (integers with E8M0 scales) and
``NVFP4_W4A4_WEIGHT_MSE_FP8_SWEEP_CFG`` (static NVFP4 block scales).
"""

from __future__ import annotations

import copy
from typing import Any

from .config import _DEFAULT_DISABLED, _MXFP4, _MXFP8, _NVFP4, PRESETS, _preset

_INT4_BLOCK128 = {"num_bits": 4, "block_sizes": {-1: 128, "type": "static"}, "enable": True}
_FP8 = {"num_bits": (4, 3), "axis": None, "enable": True}
_NVFP4_W = dict(_NVFP4, effective_bits=4.5)


def _only(patterns: tuple[str, ...], weight: Any, inp: Any = None, algorithm: Any = "max") -> dict:
    """A preset quantizing only the quantizers under ``patterns`` (wildcards before ``*weight_quantizer``
    / ``*input_quantizer``); everything else stays disabled."""
    quant_cfg: dict = {}
    for p in patterns:
        quant_cfg[f"{p}weight_quantizer"] = copy.deepcopy(weight)
        if inp is not None:
            quant_cfg[f"{p}input_quantizer"] = copy.deepcopy(inp)
    quant_cfg.update(copy.deepcopy(_DEFAULT_DISABLED))
    return {"quant_cfg": quant_cfg, "algorithm": algorithm}


_EXPERTS = ("*block_sparse_moe*", "*.experts.*")
_MLP = ("*mlp*", "*.mixer.up_proj.", "*.mixer.down_proj.", "*block_sparse_moe*", "*.experts.*")

INT4_AWQ_CFG = _preset(dict(_INT4_BLOCK128), None, {"method": "awq_lite", "alpha_step": 0.1})
INT8_SMOOTHQUANT_CFG = _preset({"num_bits": 8, "axis": 0}, {"num_bits": 8, "axis": None}, "smoothquant")
NVFP4_AWQ_LITE_CFG = _preset(dict(_NVFP4_W), dict(_NVFP4_W), "awq_lite")
NVFP4_AWQ_CLIP_CFG = _preset(dict(_NVFP4_W), dict(_NVFP4_W), {"method": "awq_clip"})
NVFP4_AWQ_FULL_CFG = _preset(dict(_NVFP4_W), dict(_NVFP4_W), {"method": "awq_full", "alpha_step": 0.1})
W4A16_NVFP4_CFG = _preset(dict(_NVFP4_W))
NVFP4_EXPERTS_ONLY_CFG = _only(_EXPERTS, _NVFP4_W, _NVFP4_W)
NVFP4_MLP_ONLY_CFG = _only(_MLP, _NVFP4_W, _NVFP4_W)
NVFP4_OMLP_ONLY_CFG = _only(("*o_proj*",) + _MLP, _NVFP4_W, _NVFP4_W)
MXFP4_MLP_WEIGHT_ONLY_CFG = _only(("*mlp*", "*block_sparse_moe*"), _MXFP4, None, None)
# not in ModelOpt 0.47: its NVFP4 experts-only / MLP-only presets with MXFP8 (what RL trainers run)
MXFP8_EXPERTS_ONLY_CFG = _only(_EXPERTS, _MXFP8, _MXFP8, None)
MXFP8_MLP_ONLY_CFG = _only(_MLP, _MXFP8, _MXFP8, None)

CALIBRATION_PRESETS: tuple[str, ...] = (
    "INT4_AWQ_CFG",
    "INT8_SMOOTHQUANT_CFG",
    "NVFP4_AWQ_LITE_CFG",
    "NVFP4_AWQ_CLIP_CFG",
    "NVFP4_AWQ_FULL_CFG",
    "W4A16_NVFP4_CFG",
    "NVFP4_EXPERTS_ONLY_CFG",
    "NVFP4_MLP_ONLY_CFG",
    "NVFP4_OMLP_ONLY_CFG",
    "MXFP4_MLP_WEIGHT_ONLY_CFG",
    "MXFP8_EXPERTS_ONLY_CFG",
    "MXFP8_MLP_ONLY_CFG",
)
#: the presets that quantize only part of a model (by module names)
SCOPED_PRESETS: tuple[str, ...] = tuple(n for n in CALIBRATION_PRESETS if "_ONLY_" in n)
PRESETS.update({name: globals()[name] for name in CALIBRATION_PRESETS})
