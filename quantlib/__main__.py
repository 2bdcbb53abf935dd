"""``quantlib quantize`` (the main job: quantlib.pipeline) and ``quantlib demo`` (quantlib.demo); also ``python -m quantlib``."""

from __future__ import annotations

import argparse
import sys


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="quantlib", description="quantlib command line")
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="quantize a built-in small model with several presets, save and restore it")
    demo.add_argument("--presets", nargs="*", help="preset names (default: a representative set)")
    from .pipeline.cli import add_arguments

    add_arguments(sub.add_parser("quantize", help="quantize a Hugging Face model directory (default: a small built-in LM), evaluate, "
                                                  "export, reload and check"))
    args = parser.parse_args(argv)
    if args.command == "demo":
        from .demo import DEMO_PRESETS, run_demo
        from .presets import PRESETS

        names = tuple(args.presets or DEMO_PRESETS)
        unknown = [n for n in names if n not in PRESETS]
        if unknown:
            parser.error(f"unknown presets {unknown}; available: {sorted(PRESETS)}")
        return run_demo(names)
    if args.command == "quantize":
        from .pipeline.cli import run_command

        return run_command(args)
    return 2


if __name__ == "__main__":
    sys.exit(main())
