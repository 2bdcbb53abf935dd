"""Where the quantized MoE layer of ``bench_moe.py`` spends its time: ``torch.profiler`` tables (device and
host time per op and kernel) of the unquantized layer and of the quantized one, forward (no grad, the weight
cache) and forward + backward (QAT), for one shape and preset. ``--host`` sorts the tables by host time and adds,
for each layer, the Python profile (``cProfile``, by own time) of its eval forward: where a layer bound by its host
(``fwd_host`` of bench_moe.py near ``fwd``) spends that time, launches included.

    python benchmarks/profile_moe.py --device cuda --preset FP8 --experts 64      # H=2048 I=1408, 4096 tokens, top-8
    python benchmarks/profile_moe.py --device cuda --preset INT4-block --host     # the host's share, function by function
"""

from __future__ import annotations

import argparse
import cProfile
import io
import os
import pstats
import sys
from typing import Optional

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run from a checkout

import quantlib as ql  # noqa: E402
from benchmarks.bench_moe import PRESETS, SHAPES, build_layer  # noqa: E402


def table(layer: torch.nn.Module, x: torch.Tensor, backward: bool, device: str, rows: int, host: bool = False) -> str:
    """The profiler's table of 3 steps after 2 warm-ups, sorted by device time (on the CPU, or ``host``: host time)."""
    layer.train(backward)

    def step():
        if backward:
            layer.zero_grad(set_to_none=True)
            layer(x).float().square().mean().backward()
        else:
            with torch.no_grad():
                layer(x)

    for _ in range(2):
        step()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
    with profile(activities=activities) as prof:
        for _ in range(3):
            step()
        if device == "cuda":
            torch.cuda.synchronize()
    key = "self_cuda_time_total" if device == "cuda" and not host else "self_cpu_time_total"
    return prof.key_averages().table(sort_by=key, row_limit=rows)


def python_profile(layer: torch.nn.Module, x: torch.Tensor, device: str, rows: int, calls: int = 50) -> str:
    """cProfile of ``calls`` eval forwards (no grad) after 3 warm-ups, by own time: the host's work per function."""
    layer.eval()
    with torch.no_grad():
        for _ in range(3):
            layer(x)
        if device == "cuda":
            torch.cuda.synchronize()
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(calls):
            layer(x)
        prof.disable()
    out = io.StringIO()
    pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(rows)
    return f"{calls} calls; per call: divide by {calls}\n" + out.getvalue()


def main(argv: Optional[list[str]] = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--preset", default="FP8", choices=list(PRESETS))
    p.add_argument("--experts", type=int, default=64, choices=[s[0] for s in SHAPES])
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--top-k", type=int, default=8)
    p.add_argument("--rows", type=int, default=25, help="rows of each table")
    p.add_argument("--host", action="store_true", help="tables by host time, and each layer's Python profile (eval forward)")
    args = p.parse_args(argv)
    shape = next(s for s in SHAPES if s[0] == args.experts)
    dtype = torch.bfloat16 if args.device == "cuda" else torch.float32
    x = torch.randn(1, args.tokens, shape[1], generator=torch.Generator().manual_seed(1)).to(args.device, dtype)
    base = build_layer(*shape, args.top_k, "grouped_mm" if args.device == "cuda" else "eager", dtype, args.device)
    quant = ql.quantize(build_layer(*shape, args.top_k, "eager", dtype, args.device), ql.PRESETS[PRESETS[args.preset][0]], lambda m: m(x))
    for name, layer in (("unquantized", base), (f"quantlib {args.preset}", quant)):
        for backward in (False, True):
            print(f"\n### {name}, {'forward + backward' if backward else 'forward'} (E={shape[0]} H={shape[1]} I={shape[2]}, "
                  f"{args.tokens} tokens, top-{args.top_k}, 3 steps)\n")
            print(table(layer, x, backward, args.device, args.rows, args.host))
        if args.host:
            print(f"\n### {name}, Python profile of the eval forward\n")
            print(python_profile(layer, x, args.device, args.rows))


if __name__ == "__main__":
    main()
