"""Preset recipes: plain dicts in ModelOpt's dict form, with ModelOpt's names and meanings.

The presets that need a calibration algorithm beyond max, or quantize only part of a model, follow the
base ones.

Each attribute dict is the one ModelOpt 0.47 resolves its preset of the same name to (its YAML recipes
through ``model_dump(exclude_unset=True)``), so a preset means here what it means there, defaults
included (INT ``narrow_range`` False, for one). Where quantlib differs the comment says so. Copy and edit
them freely: ``quantize`` never modifies a config it is given.

To add a preset: build it with :func:`preset` and list its name in :data:`PRESETS` (and in
``quantlib/__init__.py``).
"""

from __future__ import annotations

import copy
from typing import Any, Union

AttrCfg = Union[dict, list]

#: Quantizers every ModelOpt 0.47 preset disables (its ``default_disabled_quantizers`` unit), after
#: ``"default": {"enable": False}`` (its ``base_disable_all``), which applies first wherever it sits.
DEFAULT_DISABLED: dict = {
    "*block_sparse_moe.gate*": {"enable": False},
    "*linear_attn.conv1d*": {"enable": False},
    "*self_attention.conv1d*": {"enable": False},
    "*linear_attn.in_proj_a*": {"enable": False},
    "*linear_attn.in_proj_b*": {"enable": False},
    "*lm_head*": {"enable": False},
    "*mixer.conv1d*": {"enable": False},
    "*mlp.gate.*": {"enable": False},
    "*mlp.shared_expert_gate.*": {"enable": False},
    "*output_layer*": {"enable": False},
    "*proj_out.*": {"enable": False},
    "*router*": {"enable": False},
    "mtp.*": {"enable": False},
    "output.*": {"enable": False},
    "*embed_vision*": {"enable": False},
    "*vision_tower*": {"enable": False},
    "*visual*": {"enable": False},
    "*vision_model*": {"enable": False},
    "*multi_modal_projector*": {"enable": False},
    "nn.BatchNorm1d": {"*": {"enable": False}},
    "nn.BatchNorm2d": {"*": {"enable": False}},
    "nn.BatchNorm3d": {"*": {"enable": False}},
    "nn.LeakyReLU": {"*": {"enable": False}},
    "nn.Embedding": {"*": {"enable": False}},
    "default": {"enable": False},
}


def preset(weight: AttrCfg, inp: AttrCfg | None = None, algorithm: Any = "max") -> dict:
    """A recipe: ``weight`` for every ``*weight_quantizer``, ``inp`` for every ``*input_quantizer``
    (None: disabled), :data:`DEFAULT_DISABLED` after them, and the calibration ``algorithm``."""
    quant_cfg: dict = {"*weight_quantizer": copy.deepcopy(weight)}
    quant_cfg["*input_quantizer"] = copy.deepcopy(inp) if inp is not None else {"enable": False}
    quant_cfg.update(copy.deepcopy(DEFAULT_DISABLED))
    return {"quant_cfg": quant_cfg, "algorithm": algorithm}


# ModelOpt 0.47's numerics units (configs/numerics/*.yaml), as its loader turns them into dicts
INT8 = {"num_bits": 8, "axis": None}
INT8_PER_CHANNEL = {"num_bits": 8, "axis": 0}
INT4_PER_BLOCK = {"num_bits": 4, "block_sizes": {-1: 128, "type": "static"}}
FP8 = {"num_bits": (4, 3), "axis": None}
NVFP4 = {"num_bits": (2, 1), "effective_bits": 4.5, "block_sizes": {-1: 16, "type": "dynamic", "scale_bits": (4, 3)}}
MXFP8 = {"num_bits": (4, 3), "block_sizes": {-1: 32, "type": "dynamic", "scale_bits": (8, 0)}}
MXFP4 = {"num_bits": (2, 1), "block_sizes": {-1: 32, "type": "dynamic", "scale_bits": (8, 0)}}
MXFP6 = {"num_bits": (3, 2), "block_sizes": {-1: 32, "type": "dynamic", "scale_bits": (8, 0)}}  # E3M2 (ModelOpt's)
MXINT8 = {"num_bits": 8, "block_sizes": {-1: 32, "type": "dynamic", "scale_bits": (8, 0)}}
# E2M1 elements with E4M3 scales over blocks of 32 (ModelOpt's W4A8 NVFP4 unit)
NVFP4_BLOCK32 = {"num_bits": (2, 1), "block_sizes": {-1: 32, "type": "dynamic", "scale_bits": (4, 3)}}

INT8_DEFAULT_CFG = preset(INT8_PER_CHANNEL, INT8)
INT8_WEIGHT_ONLY_CFG = preset(INT8_PER_CHANNEL)
FP8_DEFAULT_CFG = preset(FP8, FP8)
# activations: "type": "dynamic" with one block per row is ModelOpt's dynamic per-token amax
FP8_PER_CHANNEL_PER_TOKEN_CFG = preset(dict(FP8, axis=0), dict(FP8, type="dynamic", block_sizes={-1: None}))
FP8_2D_BLOCKWISE_WEIGHT_ONLY_CFG = preset(dict(FP8, block_sizes={-1: 128, -2: 128}))
# quantlib's own (not a ModelOpt preset): the DeepSeek-V3 / TE recipe, 128x128 weights, 1x128 activations
FP8_BLOCKWISE_CFG = preset(
    {"num_bits": (4, 3), "block_sizes": {-1: 128, -2: 128}},
    {"num_bits": (4, 3), "block_sizes": {-1: 128, "type": "dynamic"}},
)
INT4_BLOCKWISE_WEIGHT_ONLY_CFG = preset(INT4_PER_BLOCK)
NVFP4_DEFAULT_CFG = preset(NVFP4, NVFP4)
# dynamic formats: nothing to calibrate, hence no algorithm (as in ModelOpt)
MXFP8_DEFAULT_CFG = preset(MXFP8, MXFP8, algorithm=None)
MXFP4_DEFAULT_CFG = preset(MXFP4, MXFP4, algorithm=None)
MXFP6_DEFAULT_CFG = preset(MXFP6, MXFP6, algorithm=None)
MXINT8_DEFAULT_CFG = preset(MXINT8, MXINT8, algorithm=None)
W4A8_AWQ_BETA_CFG = preset([INT4_PER_BLOCK, FP8], FP8, "awq_lite")
W4A8_NVFP4_FP8_CFG = preset(NVFP4_BLOCK32, FP8)

PRESETS: dict[str, dict] = {
    "INT8_DEFAULT_CFG": INT8_DEFAULT_CFG,
    "INT8_WEIGHT_ONLY_CFG": INT8_WEIGHT_ONLY_CFG,
    "FP8_DEFAULT_CFG": FP8_DEFAULT_CFG,
    "FP8_PER_CHANNEL_PER_TOKEN_CFG": FP8_PER_CHANNEL_PER_TOKEN_CFG,
    "FP8_2D_BLOCKWISE_WEIGHT_ONLY_CFG": FP8_2D_BLOCKWISE_WEIGHT_ONLY_CFG,
    "FP8_BLOCKWISE_CFG": FP8_BLOCKWISE_CFG,
    "INT4_BLOCKWISE_WEIGHT_ONLY_CFG": INT4_BLOCKWISE_WEIGHT_ONLY_CFG,
    "NVFP4_DEFAULT_CFG": NVFP4_DEFAULT_CFG,
    "MXFP8_DEFAULT_CFG": MXFP8_DEFAULT_CFG,
    "MXFP4_DEFAULT_CFG": MXFP4_DEFAULT_CFG,
    "MXFP6_DEFAULT_CFG": MXFP6_DEFAULT_CFG,
    "MXINT8_DEFAULT_CFG": MXINT8_DEFAULT_CFG,
    "W4A8_AWQ_BETA_CFG": W4A8_AWQ_BETA_CFG,
    "W4A8_NVFP4_FP8_CFG": W4A8_NVFP4_FP8_CFG,
}


def only(patterns: tuple[str, ...], weight: AttrCfg, inp: AttrCfg | None = None, algorithm: Any = "max") -> dict:
    """A recipe quantizing only the quantizers under ``patterns`` (wildcards before ``*weight_quantizer``
    / ``*input_quantizer``); everything else stays disabled."""
    quant_cfg: dict = {}
    for p in patterns:
        quant_cfg[f"{p}weight_quantizer"] = copy.deepcopy(weight)
        if inp is not None:
            quant_cfg[f"{p}input_quantizer"] = copy.deepcopy(inp)
    quant_cfg.update(copy.deepcopy(DEFAULT_DISABLED))
    return {"quant_cfg": quant_cfg, "algorithm": algorithm}


_EXPERTS = ("*block_sparse_moe*", "*.experts.*")
_MLP = ("*mlp*", "*.mixer.up_proj.", "*.mixer.down_proj.", "*block_sparse_moe*", "*.experts.*")

INT4_AWQ_CFG = preset(INT4_PER_BLOCK, None, {"method": "awq_lite", "alpha_step": 0.1})
INT8_SMOOTHQUANT_CFG = preset(INT8_PER_CHANNEL, INT8, "smoothquant")
NVFP4_AWQ_LITE_CFG = preset(NVFP4, NVFP4, "awq_lite")
NVFP4_AWQ_CLIP_CFG = preset(NVFP4, NVFP4, {"method": "awq_clip"})
NVFP4_AWQ_FULL_CFG = preset(NVFP4, NVFP4, {"method": "awq_full", "alpha_step": 0.1})
W4A16_NVFP4_CFG = preset(NVFP4)
NVFP4_EXPERTS_ONLY_CFG = only(_EXPERTS, NVFP4, NVFP4)
NVFP4_MLP_ONLY_CFG = only(_MLP, NVFP4, NVFP4)
NVFP4_OMLP_ONLY_CFG = only(("*o_proj*",) + _MLP, NVFP4, NVFP4)
MXFP4_MLP_WEIGHT_ONLY_CFG = only(("*mlp*", "*block_sparse_moe*"), MXFP4, None, None)
# not in ModelOpt 0.47: its NVFP4 experts-only / MLP-only presets with MXFP8 (what RL trainers run)
MXFP8_EXPERTS_ONLY_CFG = only(_EXPERTS, MXFP8, MXFP8, None)
MXFP8_MLP_ONLY_CFG = only(_MLP, MXFP8, MXFP8, None)
# NVFP4 weights with static block scales, each block's E4M3 scale the one of least squared error
NVFP4_STATIC = {"num_bits": (2, 1), "block_sizes": {-1: 16, "type": "static", "scale_bits": (4, 3)}}
NVFP4_W4A4_WEIGHT_MSE_FP8_SWEEP_CFG = preset(NVFP4_STATIC, NVFP4, {"method": "mse", "fp8_scale_sweep": True})
NVFP4_MLP_WEIGHT_ONLY_CFG = only(("*mlp*", "*block_sparse_moe*"), NVFP4_BLOCK32)

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
    "NVFP4_W4A4_WEIGHT_MSE_FP8_SWEEP_CFG",
    "NVFP4_MLP_WEIGHT_ONLY_CFG",
)
#: the presets that quantize only part of a model (by module names)
SCOPED_PRESETS: tuple[str, ...] = tuple(n for n in CALIBRATION_PRESETS if "_ONLY_" in n)
PRESETS.update({name: globals()[name] for name in CALIBRATION_PRESETS})
