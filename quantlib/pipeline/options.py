"""What one ``quantlib quantize`` run does: its options, the recipe they name, and the export format it writes."""

from __future__ import annotations

import copy
import json
import os
from dataclasses import dataclass, field
from typing import Any, Optional

from ..config import ConfigError, QuantizeConfig, turns_on
from ..formats import Kind
from ..kv.presets import ATTENTION_QUANTIZER_NAMES, KV_PRESETS, merge_kv_config
from ..presets import PRESETS


class PipelineError(RuntimeError):
    """A run refused or stopped; the message is one line naming the input and the fix."""


#: --kv-cache choices -> quantlib's KV presets
KV_CHOICES = {"fp8": "FP8_KV_CFG", "fp8_affine": "FP8_AFFINE_KV_CFG", "nvfp4": "NVFP4_KV_CFG"}

#: the export format a preset is written in when --export-format is not given (presets absent: no format carries them);
#: NVFP4 AWQ: o_proj / down_proj scales fold into no NVFP4 producer, so ModelOpt's NVFP4_AWQ carries them
DEFAULT_FORMATS = {
    "INT8_DEFAULT_CFG": "ct_int8",
    "INT8_WEIGHT_ONLY_CFG": "ct_int8",
    "INT8_SMOOTHQUANT_CFG": "ct_int8",
    "INT4_AWQ_CFG": "ct_int_pack",
    "NVFP4_AWQ_LITE_CFG": "modelopt_nvfp4",
    "NVFP4_AWQ_FULL_CFG": "modelopt_nvfp4",
    "NVFP4_AWQ_CLIP_CFG": "ct_nvfp4",
    "FP8_DEFAULT_CFG": "modelopt_fp8",
    "FP8_2D_BLOCKWISE_WEIGHT_ONLY_CFG": "hf_fp8_block",
    "FP8_BLOCKWISE_CFG": "hf_fp8_block",
    "INT4_BLOCKWISE_WEIGHT_ONLY_CFG": "ct_int_pack",
    "NVFP4_DEFAULT_CFG": "ct_nvfp4",
    "W4A16_NVFP4_CFG": "ct_nvfp4",
    "NVFP4_MLP_ONLY_CFG": "ct_nvfp4",
    "NVFP4_OMLP_ONLY_CFG": "ct_nvfp4",
    "NVFP4_EXPERTS_ONLY_CFG": "ct_nvfp4",
    "NVFP4_W4A4_WEIGHT_MSE_FP8_SWEEP_CFG": "modelopt_nvfp4",
    "MXFP8_DEFAULT_CFG": "hf_mxfp8",
    "MXFP8_MLP_ONLY_CFG": "ct_mxfp8",
    "MXFP8_EXPERTS_ONLY_CFG": "ct_mxfp8",
    "MXFP4_DEFAULT_CFG": "ct_mxfp4",
    "MXFP4_MLP_WEIGHT_ONLY_CFG": "ct_mxfp4",
}
#: the preset of the embedded default run
DEFAULT_PRESET = "FP8_2D_BLOCKWISE_WEIGHT_ONLY_CFG"


@dataclass
class OneshotOptions:
    """Every option of a run (the CLI's flags, by the same names). ``model=None``: the embedded model;
    ``data=None``: the model's built-in text (the embedded model's) or an error naming --data."""

    model: Optional[str] = None
    preset: Optional[str] = None
    config: Optional[str] = None
    algorithm: Optional[str] = None
    data: Optional[str] = None
    text_field: str = "text"
    device: Optional[str] = None
    dtype: str = "auto"
    num_samples: int = 32
    eval_samples: int = 32
    seq_len: int = 256
    batch_size: int = 4
    kv_cache: Optional[str] = None
    exclude: list[str] = field(default_factory=list)
    export_format: Optional[str] = None
    out: Optional[str] = None
    resume: bool = False
    overwrite: bool = False
    sequential: str = "auto"
    seed: int = 0
    trust_remote_code: bool = False
    lm_eval_tasks: Optional[str] = None
    progress: bool = True

    def check(self) -> None:
        """Refuse contradictory or impossible options before anything loads."""
        if self.preset and self.config:
            raise PipelineError("--preset and --config both given: name one recipe")
        for name in ("num_samples", "eval_samples", "seq_len", "batch_size"):
            if getattr(self, name) < 1:
                raise PipelineError(f"--{name.replace('_', '-')} must be at least 1, got {getattr(self, name)}")
        if self.sequential not in ("auto", "on", "off"):
            raise PipelineError(f"--sequential must be auto, on or off, got {self.sequential!r}")
        if self.kv_cache is not None and self.kv_cache not in KV_CHOICES:
            raise PipelineError(f"--kv-cache {self.kv_cache!r}: one of {sorted(KV_CHOICES)}")
        if self.lm_eval_tasks:
            raise PipelineError(
                "--lm-eval-tasks: lm-eval-harness tasks are not run by quantlib quantize; run `lm_eval --model hf --model_args "
                "pretrained=OUT` on the export"
            )


def _read_config_file(path: str) -> dict:
    if not os.path.isfile(path):
        raise PipelineError(
            f"--config {path}: no such file; pass a YAML or JSON file in ModelOpt's schema ({{'quant_cfg': ..., 'algorithm': ...}})"
        )
    with open(path) as f:
        text = f.read()
    try:
        if path.endswith((".yaml", ".yml")):
            import yaml

            raw = yaml.safe_load(text)
        else:
            raw = json.loads(text)
    except ImportError:
        raise PipelineError(f"--config {path}: reading YAML needs PyYAML (pip install pyyaml), or write the recipe as JSON") from None
    except Exception as exc:
        raise PipelineError(
            f"--config {path}: not valid {'YAML' if path.endswith(('.yaml', '.yml')) else 'JSON'}: {exc}".replace("\n", " ")
        ) from None
    if not isinstance(raw, dict) or "quant_cfg" not in raw:
        raise PipelineError(f"--config {path}: expected a mapping with 'quant_cfg' (and 'algorithm'), as ModelOpt's configs")
    return raw


def _algorithm(value: str) -> Any:
    """--algorithm: a name (``awq_lite``), ``none``, or ModelOpt's dict form as JSON."""
    if value.strip().startswith("{"):
        try:
            return json.loads(value)
        except json.JSONDecodeError as exc:
            raise PipelineError(f"--algorithm {value!r}: not valid JSON ({exc})") from None
    return None if value.lower() == "none" else value


def exclusion_rules(patterns: list[str]) -> list[dict]:
    """--exclude module patterns as rules that disable every quantizer under the matching modules."""
    return [{"quantizer_name": p if p.endswith("*") else p + "*", "enable": False} for p in patterns]


def resolve_recipe(opts: OneshotOptions) -> tuple[str, QuantizeConfig]:
    """(recipe name, config) from --preset / --config, with --algorithm, --kv-cache and --exclude applied; the
    config is parsed here, once, before any model loads: the typed config serves every later step."""
    if opts.config:
        name, cfg = os.path.basename(opts.config), _read_config_file(opts.config)
    else:
        name = opts.preset or DEFAULT_PRESET
        if name not in PRESETS:
            raise PipelineError(f"--preset {name}: unknown; one of {', '.join(sorted(PRESETS))}")
        cfg = copy.deepcopy(PRESETS[name])
    algorithm = _algorithm(opts.algorithm) if opts.algorithm is not None else cfg.get("algorithm", "max")
    extra: list[dict] = []
    if opts.kv_cache:
        extra += copy.deepcopy(KV_PRESETS[KV_CHOICES[opts.kv_cache]]["quant_cfg"])
    extra += exclusion_rules(opts.exclude)
    try:
        if extra:
            cfg = merge_kv_config(cfg, extra)
        cfg["algorithm"] = algorithm
        return name, QuantizeConfig.from_any(cfg)
    except (ConfigError, ValueError, TypeError) as exc:
        raise PipelineError(f"recipe {name}: {exc}") from None


#: algorithms that leave a pre_quant_scale (a per-channel input scale), folded into the export or carried by it
PRE_QUANT_SCALE_ALGORITHMS = ("smoothquant", "awq_lite", "awq_full")
#: --export-format none: quantize and evaluate only
NO_EXPORT = "none"
#: (producer, consumer) below a decoder layer: the consumer's pre_quant_scale folds only into the producer's output rows
ROW_FOLDS = (("self_attn.v_proj", "self_attn.o_proj"), ("mlp.up_proj", "mlp.down_proj"))


def export_format(opts: OneshotOptions, recipe: str, cfg: QuantizeConfig) -> str:
    """The export format: --export-format, else the recipe's default; a recipe no format can carry is refused
    up front (before any model loads), unless --export-format none skips the export."""
    from ..export import ExportError
    from ..export.writers import as_format

    if opts.export_format == NO_EXPORT:
        return NO_EXPORT
    if opts.export_format:
        try:
            fmt = as_format(opts.export_format).value
        except ExportError as exc:
            raise PipelineError(f"--export-format: {exc}") from None
    elif recipe in DEFAULT_FORMATS:
        fmt = DEFAULT_FORMATS[recipe]
    else:
        raise PipelineError(
            f"recipe {recipe}: no export format carries it by default; pass --export-format FORMAT (or none to skip the export)"
        )
    refuse_pre_quant_scale_pair(recipe, cfg, fmt)
    return fmt


def _enabled(qcfg: QuantizeConfig, name: str) -> Any:
    """The attribute config a decoder-layer quantizer ``name`` gets (None: off)."""
    attrs, enable = qcfg.resolve(f"model.layers.0.{name}")
    return attrs if turns_on(attrs, enable) else None


def _per_row_int(attrs: Any) -> bool:
    """INT weights with a scale per output row (per channel, or blocks along the input dim), which can take a scale."""
    if isinstance(attrs, list):
        return False
    spec = attrs.format_spec()
    return spec.kind == Kind.INT and (spec.block is not None and len(spec.block) == 1 or spec.block is None and attrs.axis == (0,))


def refuse_pre_quant_scale_pair(recipe: str, qcfg: QuantizeConfig, fmt: str) -> None:
    """Refuse, before any model loads, a SmoothQuant / AWQ recipe whose o_proj / down_proj scales the format can
    neither fold (into v_proj / up_proj rows, which need per-row INT scales) nor carry. The export checks every
    module again after calibration; this catches the pairs the recipe alone decides."""
    from ..export.writers import packer

    method = qcfg.algorithm_name
    if method not in PRE_QUANT_SCALE_ALGORITHMS:
        return
    carries = packer(fmt).carries_pre_quant_scale
    kv = [n for n in ATTENTION_QUANTIZER_NAMES if _enabled(qcfg, f"self_attn.{n}") is not None]
    for producer, consumer in ROW_FOLDS:
        weights = _enabled(qcfg, f"{consumer}.weight_quantizer")
        made = _enabled(qcfg, f"{producer}.weight_quantizer")
        if kv and producer == "self_attn.v_proj" and weights is not None and not carries:
            raise PipelineError(
                f"recipe {recipe}: {method} gives {consumer} a pre_quant_scale that {fmt} can hold only folded into "
                f"{producer}'s output rows, and the KV cache is quantized ({', '.join(kv)}: a per-channel scale on v would "
                "not match its amax); drop --kv-cache, pass --exclude '*o_proj*', or use --algorithm max"
            )
        if weights is None or made is None or _per_row_int(made):
            continue  # no scale on the consumer, or a producer that takes it
        if not carries:
            raise PipelineError(
                f"recipe {recipe}: {method} gives {consumer} a pre_quant_scale that {fmt} can hold only folded into "
                f"{producer}'s output rows, whose {made.format_spec().kind.value} weights have no scale per row; pass a format "
                "that carries pre_quant_scale (--export-format modelopt_nvfp4 for NVFP4 W4A4, modelopt_int4_awq for INT4 "
                f"weight-only), --exclude '*{consumer}*', or --algorithm max"
            )
        if fmt == "modelopt_nvfp4" and _enabled(qcfg, f"{consumer}.input_quantizer") is None:
            raise PipelineError(
                f"recipe {recipe}: {method} gives {consumer} a pre_quant_scale that only ModelOpt's NVFP4_AWQ carries, and "
                "NVFP4_AWQ quantizes activations (this recipe leaves them unquantized: W4A16_NVFP4 has no pre_quant_scale); "
                "enable the input quantizers or use --algorithm max"
            )


def refuse_expert_scales(model: Any, recipe: str, qcfg: QuantizeConfig, fmt: str) -> None:
    """Refuse, once the model is loaded and before it calibrates, SmoothQuant / AWQ on fused experts' gate/up (one scale
    per expert, which folds nowhere) in a format without pre_quant_scale tensors (ModelOpt's AWQ formats carry one per
    expert), unless the recipe leaves gate/up unquantized (down_proj's scale then folds into the up rows)."""
    from ..export.fold_experts import CARRYING
    from ..export.writers import packer

    method = qcfg.algorithm_name
    if fmt == NO_EXPORT or method not in PRE_QUANT_SCALE_ALGORITHMS or packer(fmt).carries_pre_quant_scale:
        return
    for name, m in model.named_modules():
        w = getattr(m, "down_proj", None)
        if getattr(w, "dim", lambda: 0)() == 3:  # transformers' fused experts: [experts, out, in]
            up = "gate_up_proj" if getattr(m, "gate_up_proj", None) is not None else "up_proj"
            attrs, enable = qcfg.resolve(f"{name}.{up}_weight_quantizer", (type(m).__name__,))
            if turns_on(attrs, enable):
                raise PipelineError(
                    f"recipe {recipe}: {method} gives the fused experts {name} one pre_quant_scale per expert on {up}, which format "
                    f"{fmt} can neither fold (the norm before it feeds the router and every expert) nor carry; pass --export-format "
                    f"with a format that carries it ({CARRYING}), --exclude '*experts*', --algorithm max, or --export-format none"
                )
