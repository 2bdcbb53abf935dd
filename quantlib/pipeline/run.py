"""``oneshot``: a Hugging Face model directory to a checked export in one call (the ``quantlib quantize``
command): load, evaluate, calibrate (layer by layer when the model does not fit the device), evaluate,
export, reload the export with its consumer and compare, report.

The run works in ``<out>.partial`` beside ``--out`` and renames the finished export to ``--out`` at the end,
so nothing half-written ever sits at ``--out``; a crashed or interrupted run leaves ``<out>.partial`` (the
calibrated quantizer state, or layer-by-layer calibration's resume file) for ``--resume``.
"""

from __future__ import annotations

import dataclasses
import errno
import json
import os
import shutil
from typing import Any, Callable, Optional

import torch
from torch import nn

from ..checkpoint import restore, save
from ..config import QuantizeConfig
from ..coverage import weight_coverage
from ..export import ExportError, export_checkpoint, share_pre_quant_scale, share_sibling_amax
from ..export.fold import Folds, holds_pre_quant_scale
from ..model_quant import quantize
from ..nn.containers import QuantizerContainer, SequentialQuantizer
from ..nn.quant_module import QuantModule
from . import check as check_mod
from .data import TextWindows, load_windows
from .evaluate import Perplexity, perplexity
from .model import (
    EMBEDDED_DIR,
    EMBEDDED_TEXT,
    check_model_dir,
    load_model,
    load_tokenizer,
    model_bytes,
    needs_sequential,
    quiet_transformers,
    resolve_device,
)
from .options import NO_EXPORT, OneshotOptions, PipelineError, export_format, refuse_expert_scales, resolve_recipe
from .report import format_table, stored_weight_bytes, summary_rows, versions, weight_error, write_reports
from .stages import Stages


class Interrupted(PipelineError):
    """Ctrl-C: the finished work is kept for ``--resume``."""


#: options that must match for --resume to continue a run (the others may change: --progress, --resume)
_RESUME_KEYS = (
    "model",
    "preset",
    "config",
    "algorithm",
    "data",
    "text_field",
    "dtype",
    "num_samples",
    "eval_samples",
    "seq_len",
    "batch_size",
    "kv_cache",
    "exclude",
    "export_format",
    "sequential",
    "seed",
)


def default_out(model_dir: str, fmt: str) -> str:
    return os.path.abspath(f"{os.path.basename(os.path.normpath(model_dir))}-{fmt}")


def _prepare_dirs(opts: OneshotOptions, out: str) -> str:
    """The staging directory ``<out>.partial``: fresh, or (--resume) the crashed run's, checked to be the same run."""
    if os.path.exists(out) and (not os.path.isdir(out) or os.listdir(out)) and not opts.overwrite:
        raise PipelineError(f"--out {out}: exists and is not empty; pass --overwrite to replace it or another --out")
    parent = os.path.dirname(out)
    if not os.path.isdir(parent):
        raise PipelineError(f"--out {out}: its parent directory {parent} does not exist")
    staging = out + ".partial"
    run_file = os.path.join(staging, "run.json")
    wanted = {k: getattr(opts, k) for k in _RESUME_KEYS}
    if opts.resume:
        if not os.path.isfile(run_file):
            raise PipelineError(f"--resume: no unfinished run at {staging}; run without --resume to start one")
        with open(run_file) as f:
            saved = json.load(f)
        diff = [k for k in _RESUME_KEYS if saved.get(k) != wanted[k]]
        if diff:
            raise PipelineError(
                f"--resume: the unfinished run at {staging} was started with other options "
                f"({', '.join(f'{k}={saved.get(k)!r}' for k in diff)}); pass the same options or drop --resume"
            )
        return staging
    shutil.rmtree(staging, ignore_errors=True)  # an old unfinished run, not resumed: start over
    os.makedirs(staging)
    with open(run_file, "w") as f:
        json.dump(wanted, f)
    return staging


def _forward_loop(
    batches: list[torch.Tensor], device: torch.device, on_pass: Callable[[int], None], on_batch: Callable[[], None]
) -> Callable[[nn.Module], None]:
    calls = [0]

    def loop(model: nn.Module) -> None:
        on_pass(calls[0])
        calls[0] += 1
        for b in batches:
            model(input_ids=b.to(device), use_cache=False)
            on_batch()

    return loop


def _resident_on(model: nn.Module, device: torch.device) -> None:
    """Everything but the decoder layers onto ``device`` (layer-by-layer calibration moves each layer there itself)."""
    from ..calib.sequential import decoder_layers

    name, layers = decoder_layers(model)
    parent_name, _, attr = name.rpartition(".")
    parent = model.get_submodule(parent_name)
    setattr(parent, attr, nn.ModuleList())
    try:
        model.to(device)
    finally:
        setattr(parent, attr, layers)


def _calibrate(
    model: nn.Module,
    cfg: QuantizeConfig,
    windows: TextWindows,
    opts: OneshotOptions,
    device: torch.device,
    sequential: bool,
    staging: str,
    stages: Stages,
) -> None:
    """Quantize ``model`` (or restore the state a crashed run saved), then share sibling amax as the export formats need."""
    state_file = os.path.join(staging, "quantizer_state.pt")
    if opts.resume and os.path.isfile(state_file):
        stage = stages.begin("calibrate (restored)", total=1)
        restore(model, state_file)
        stage.advance()
        return
    batches = windows.batches("calib", opts.batch_size)
    if sequential:
        from ..calib.sequential import SequentialOptions, decoder_layers

        n_layers = len(decoder_layers(model)[1])
        stage = stages.begin(f"calibrate layer 1/{n_layers}", total=(n_layers + 1) * len(batches))

        def on_pass(i: int) -> None:
            stage.describe(f"calibrate layer {min(i + 1, n_layers)}/{n_layers}" if i < n_layers else "calibrate outside the layers")

        seq = SequentialOptions(device=device if device.type != "cpu" else None, resume_file=os.path.join(staging, "calib.resume"))
        if device.type != "cpu":
            _resident_on(model, device)
        quantize(model, cfg, _forward_loop(batches, device, on_pass, stage.advance), sequential=seq)
    else:
        stage = stages.begin("calibrate", total=len(batches))
        quantize(model, cfg, _forward_loop(batches, device, lambda i: None, stage.advance))
    if any(isinstance(m, QuantModule) and holds_pre_quant_scale(m) for m in model.modules()):
        # SmoothQuant / AWQ: the linears one op feeds take one scale, so the export folds what was evaluated; static
        # input amax are recalibrated on the whole model, on the CPU after layer-by-layer calibration (it may not fit the device)
        where = torch.device("cpu") if sequential else device
        model.to(where)
        stage = stages.begin("share pre_quant_scale", total=None)  # a pass over the data only where static input amax need it
        share_pre_quant_scale(model, _forward_loop(batches, where, lambda i: None, stage.advance))
    share_sibling_amax(model)  # q/k/v and gate/up: one per-tensor / global amax, as the formats' consumers fuse them
    save(model, state_file)


def _labels(model: nn.Module) -> dict[str, str]:
    """Quantized module -> a short name of its weight format (``fp8 e4m3 block 128x128``; a chain joined by ``+``)."""
    from ..model_quant import _describe

    def label(q: nn.Module) -> str:
        if isinstance(q, SequentialQuantizer):
            return " + ".join(label(member) for member in q)
        if isinstance(q, QuantizerContainer):
            return label(q[0])
        return " ".join(filter(None, _describe(q)[:2]))

    out = {}
    for name, m in model.named_modules():
        if isinstance(m, QuantModule):
            found = [label(q) for qname, q in m.named_children() if qname.endswith("weight_quantizer") and q.is_enabled]
            if found:
                out[name] = found[0]
    return out


def _module_of(ckpt_name: str, labels: dict[str, str]) -> str:
    """The model module a checkpoint name comes from (``...experts.3.gate_proj`` -> ``...experts``)."""
    while ckpt_name and ckpt_name not in labels:
        ckpt_name = ckpt_name.rpartition(".")[0]
    return ckpt_name


def _unquantized(model: nn.Module, labels: dict[str, str]) -> list[str]:
    """Modules with a weight that stays in full precision (no export manifest to say it)."""
    return [n for n, m in model.named_modules() if isinstance(getattr(m, "weight", None), torch.Tensor) and n not in labels]


def _checkpoint_bytes(model_dir: str) -> int:
    return sum(os.path.getsize(os.path.join(model_dir, f)) for f in os.listdir(model_dir) if f.endswith((".safetensors", ".bin")))


def _publish(staging: str, out: str) -> None:
    """Move the finished export to ``out`` (replacing an old one only once the new one is whole)."""
    src = os.path.join(staging, "export")
    old = None
    if os.path.exists(out):
        old = out + ".old"
        shutil.rmtree(old, ignore_errors=True)
        os.replace(out, old)
    os.replace(src, out)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
    shutil.rmtree(staging, ignore_errors=True)


def run(opts: OneshotOptions) -> dict[str, Any]:
    """Run every stage; returns the report (also written as ``report.json`` and ``report.html`` in the export)."""
    opts.check()
    recipe, cfg = resolve_recipe(opts)
    fmt = export_format(opts, recipe, cfg)
    model_dir = os.path.abspath(opts.model) if opts.model else EMBEDDED_DIR
    check_model_dir(model_dir)
    out = os.path.abspath(opts.out) if opts.out else default_out(model_dir, fmt)
    staging = _prepare_dirs(opts, out)
    stages = Stages(opts.progress)
    try:
        report = _stages(opts, recipe, cfg, fmt, model_dir, out, staging, stages)
    except KeyboardInterrupt:
        stages.end()
        raise Interrupted(
            f"interrupted; nothing was written to {out}; the finished work is in {staging}: run the same command with --resume to continue"
        ) from None
    except (OSError, ExportError) as exc:
        stages.end()
        disk_error = exc if isinstance(exc, OSError) else exc.__cause__
        if isinstance(disk_error, OSError) and disk_error.errno == errno.ENOSPC:
            raise PipelineError(
                f"no space left on the device writing {disk_error.filename or staging}; free space (or pass --out on another disk) and "
                "rerun with --resume"
            ) from None
        if isinstance(exc, ExportError):
            raise PipelineError(f"export {fmt}: {exc}; pass another --export-format or recipe") from None
        raise
    return report


def _stages(
    opts: OneshotOptions, recipe: str, cfg: QuantizeConfig, fmt: str, model_dir: str, out: str, staging: str, stages: Stages
) -> dict[str, Any]:
    torch.manual_seed(opts.seed)
    stage = stages.begin("load", total=3)
    tok = load_tokenizer(model_dir, opts.trust_remote_code)
    stage.advance()
    model = load_model(model_dir, opts.dtype, opts.trust_remote_code)
    refuse_expert_scales(model, recipe, cfg, fmt)
    stage.advance()
    max_pos = getattr(model.config, "max_position_embeddings", None)
    if max_pos is not None and opts.seq_len > max_pos:
        raise PipelineError(f"--seq-len {opts.seq_len}: longer than the model's max_position_embeddings {max_pos}")
    windows = load_windows(
        tok,
        opts.data,
        EMBEDDED_TEXT if model_dir == EMBEDDED_DIR else None,
        opts.text_field,
        opts.num_samples,
        opts.eval_samples,
        opts.seq_len,
    )
    stage.advance()
    device = resolve_device(opts.device)
    sequential = needs_sequential(model, device, opts.sequential)
    eval_device = torch.device("cpu") if sequential else device
    size_before = _checkpoint_bytes(model_dir)
    if not sequential:
        model.to(device)
    held_out = windows.batches("held_out", opts.batch_size)

    ppl: dict[str, Optional[Perplexity]] = {}
    ppl["before"] = perplexity(model, held_out, eval_device, stages.begin("evaluate before", total=len(held_out)))
    _calibrate(model, cfg, windows, opts, device, sequential, staging, stages)
    if sequential:
        model.to(eval_device)
    ppl["after"] = perplexity(model, held_out, eval_device, stages.begin("evaluate after", total=len(held_out)))

    export_dir = os.path.join(staging, "export")
    manifest, loaded, consumer, why = None, None, "", f"--export-format {NO_EXPORT}"
    if fmt != NO_EXPORT:
        stage = stages.begin(f"export {fmt}", total=2)
        manifest = export_checkpoint(model, export_dir, fmt, overwrite=True, progress=False)
        stage.advance()
        tok.save_pretrained(export_dir)
        stage.advance()
        stage = stages.begin("check", total=len(held_out) + 2)
        shapes = check_mod.checkpoint_shapes(model)
        with quiet_transformers():
            loaded, consumer, why = check_mod.reload_export(export_dir, fmt, shapes, opts.trust_remote_code)
        stage.advance()
    else:
        stage = stages.begin("weight errors", total=1)
        os.makedirs(export_dir, exist_ok=True)
    result = check_mod.CheckResult(consumer, check_mod.RULES.get(fmt, "exact")) if loaded is not None else None
    folds = check_mod.export_folds(model, fmt) if loaded is not None else None
    weights = _weight_pass(model, loaded, result, folds)
    if loaded is not None:
        check_mod.check_folded_ops(result, model, folds, loaded, {w["module"] for w in weights})
    stage.advance()
    if loaded is not None:
        ppl["reloaded"] = perplexity(loaded, held_out, torch.device("cpu"), stage)
        del loaded
        check_mod.require_passed(result, fmt)
    stages.end()

    report = _report(
        opts,
        recipe,
        cfg,
        fmt,
        model_dir,
        out,
        model,
        windows,
        weights,
        manifest,
        ppl,
        result,
        consumer,
        why,
        size_before,
        sequential,
        stages,
    )
    write_reports(report, export_dir)
    _publish(staging, out)
    if opts.progress:
        print(format_table(summary_rows(report)))
    return report


def _weight_pass(
    model: nn.Module, loaded: Optional[nn.Module], result: Optional[check_mod.CheckResult], folds: Optional[Folds]
) -> list[dict]:
    """One quantized weight at a time: its relative error, its size, and (with a reloaded export) the check,
    against the weight scaled as the export scaled it where a pre_quant_scale was folded or carried."""
    out = []
    for name, raw, w in check_mod.iter_weights(model):
        out.append({"module": name, "rel_error": weight_error(raw, w), "numel": w.numel()})
        if result is not None:
            ref, scaled = check_mod.expected_weight(name, w, folds)
            check_mod.check_weight(result, name, ref, loaded, scaled)
    return out


def _report(
    opts, recipe, cfg, fmt, model_dir, out, model, windows, weights, manifest, ppl, result, consumer, why, size_before, sequential, stages
) -> dict[str, Any]:
    labels = _labels(model)
    by_label: dict[str, int] = {}
    for w in weights:
        label = labels.get(_module_of(w["module"], labels), "?")
        by_label[label] = by_label.get(label, 0) + 1
    quantized_names = {w["module"] for w in weights}
    elements = sum(w["numel"] for w in weights)
    export_dir = os.path.join(os.path.dirname(out), os.path.basename(out) + ".partial", "export")
    cov = weight_coverage(model, cfg)
    if result is None:
        summary = f"skipped: {why}"
    else:
        summary = (f"{consumer}: {result.compared} weights {'identical' if result.rule == 'exact' else 'within rule ' + result.rule} (max "
                   f"{result.max_ulp} ulp)")
        if result.scaled:
            scaled_rule = "identical" if result.rule == "exact" else "rule " + check_mod.SCALED_RULES[result.rule]
            summary += f"; {result.scaled} scaled by a pre_quant_scale ({scaled_rule})"
    return {
        "model": "embedded (quantlib/embedded)" if model_dir == EMBEDDED_DIR else model_dir,
        "recipe": recipe,
        "algorithm": cfg.algorithm_name,
        "options": {k: v for k, v in dataclasses.asdict(opts).items() if k != "progress"},
        "data": {
            "source": os.path.relpath(windows.source, os.path.dirname(EMBEDDED_DIR)) if windows.source == EMBEDDED_TEXT else windows.source,
            "calib_windows": windows.calib.shape[0],
            "eval_windows": windows.held_out.shape[0],
            "seq_len": windows.calib.shape[1],
        },
        "sequential": sequential,
        "modules": {"quantized": by_label, "skipped": list(manifest.unquantized_modules) if manifest else _unquantized(model, labels)},
        "coverage": {
            "total": cov.total,
            "quantized": cov.quantized,
            "quantized_share": 1 - cov.unquantized_share,
            "silent_share": cov.silent_share,
            "silent": cov.silent,
        },
        "effective_bits": 8 * stored_weight_bytes(export_dir, quantized_names) / elements if elements and manifest else None,
        "size_bytes": {"before": size_before, "after": manifest.num_bytes if manifest else None, "in_memory": model_bytes(model)},
        "perplexity": {k: (v.as_dict() if v is not None else None) for k, v in ppl.items()},
        "check": {
            "consumer": consumer,
            "summary": summary,
            "passed": None if result is None else result.passed,
            "max_ulp": None if result is None else result.max_ulp,
        },
        "export": {"dir": out, "format": fmt, "files": (list(manifest.files) if manifest else []) + ["report.json", "report.html"]},
        "layer_errors": [{"module": w["module"], "rel_error": w["rel_error"]} for w in weights],
        "stage_seconds": dict(stages.times),
        "versions": versions(),
    }


def oneshot(model: Optional[str] = None, **options: Any) -> dict[str, Any]:
    """Quantize the Hugging Face model directory ``model`` (None: the embedded small LM), evaluate, export,
    reload and check it, as ``quantlib quantize`` does; ``options`` are its flags by name (``preset=``,
    ``export_format=``, ``out=`` ...). Returns the report; raises :class:`PipelineError` with a one-line message."""
    fields = {f.name for f in dataclasses.fields(OneshotOptions)}
    unknown = sorted(set(options) - fields)
    if unknown:
        raise PipelineError(f"oneshot: unknown option(s) {unknown}; known: {sorted(fields - {'model'})}")
    return run(OneshotOptions(model=model, **options))
