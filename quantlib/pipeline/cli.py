"""``quantlib quantize``: the flags of :func:`quantlib.pipeline.run.oneshot` and the one-line errors."""

from __future__ import annotations

import argparse
import sys

from .options import KV_CHOICES, OneshotOptions, PipelineError

EXIT_INTERRUPTED = 130


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The ``quantize`` subcommand's flags (defaults from :class:`OneshotOptions`)."""
    d = OneshotOptions()
    p.add_argument("--model", help="Hugging Face model directory (default: the small LM shipped with quantlib)")
    p.add_argument("--preset", help="a quantlib.presets name (default: FP8_2D_BLOCKWISE_WEIGHT_ONLY_CFG)")
    p.add_argument("--config", help="a recipe file, YAML or JSON in ModelOpt's schema ({quant_cfg: ..., algorithm: ...})")
    p.add_argument(
        "--algorithm",
        help="calibration algorithm: max, mse, smoothquant, awq_lite, awq_clip, awq_full, none, or ModelOpt's dict form as JSON",
    )
    p.add_argument(
        "--data",
        help="calibration text: a text / JSONL / Parquet file, a directory of them, or a cached Hugging Face dataset name[:config[:split]]",
    )
    p.add_argument("--text-field", default=d.text_field, help="the text field of JSONL / Parquet / dataset rows (default: text)")
    p.add_argument("--device", help="cpu, cuda, cuda:1 (default: cuda when available)")
    p.add_argument("--dtype", default=d.dtype, help="auto (the checkpoint's), float32, bfloat16, float16")
    p.add_argument("--num-samples", type=int, default=d.num_samples, help="calibration windows")
    p.add_argument("--eval-samples", type=int, default=d.eval_samples, help="held-out windows for perplexity")
    p.add_argument("--seq-len", type=int, default=d.seq_len, help="tokens per window")
    p.add_argument("--batch-size", type=int, default=d.batch_size, help="windows per forward")
    p.add_argument("--kv-cache", choices=sorted(KV_CHOICES), help="also quantize the KV cache")
    p.add_argument(
        "--exclude", action="append", default=[], metavar="PATTERN", help="leave modules matching PATTERN unquantized (repeatable)"
    )
    p.add_argument("--export-format", help="quantlib.export format (default: the recipe's), or none: quantize and evaluate only")
    p.add_argument("--out", help="export directory (default: ./<model>-<format>); written whole or not at all")
    p.add_argument("--overwrite", action="store_true", help="replace a non-empty --out")
    p.add_argument("--resume", action="store_true", help="continue the crashed or interrupted run kept in <out>.partial")
    p.add_argument(
        "--sequential",
        choices=("auto", "on", "off"),
        default=d.sequential,
        help="layer-by-layer calibration (auto: when the model does not fit the device)",
    )
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--trust-remote-code", action="store_true", help="let transformers run the model directory's own code")
    p.add_argument("--lm-eval-tasks", help="lm-eval-harness tasks (not run by quantlib quantize: refused)")
    p.add_argument("--quiet", action="store_true", help="no progress bars and no summary table")


def options_from_args(args: argparse.Namespace) -> OneshotOptions:
    fields = vars(args).copy()
    fields.pop("command", None)
    fields["progress"] = not fields.pop("quiet")
    return OneshotOptions(**fields)


def run_command(args: argparse.Namespace) -> int:
    """Run ``quantlib quantize``; a refusal prints one line ``quantlib quantize: error: ...`` and returns 1 (130 after Ctrl-C)."""
    from .run import Interrupted, run

    try:
        run(options_from_args(args))
    except Interrupted as exc:
        print(f"quantlib quantize: {exc}", file=sys.stderr)
        return EXIT_INTERRUPTED
    except PipelineError as exc:
        print(f"quantlib quantize: error: {exc}", file=sys.stderr)
        return 1
    return 0
