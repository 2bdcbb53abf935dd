"""Where the quantized MoE layer of ``bench_moe.py`` spends its time: ``torch.profiler`` tables (device and
host time per op and kernel) of the unquantized layer and of the quantized one, forward (no grad, the weight
cache) and forward + backward (QAT), for one shape and preset.

    python benchmarks/profile_moe.py --device cuda --preset FP8 --experts 64      # H=2048 I=1408, 4096 tokens, top-8
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run from a checkout

import quantlib as ql  # noqa: E402
from benchmarks.bench_moe import PRESETS, SHAPES, build_layer  # noqa: E402


def table(layer: torch.nn.Module, x: torch.Tensor, backward: bool, device: str, rows: int) -> str:
    """The profiler's table of 3 steps after 2 warm-ups, sorted by device (else host) time."""
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
    key = "self_cuda_time_total" if device == "cuda" else "self_cpu_time_total"
    return prof.key_averages().table(sort_by=key, row_limit=rows)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--preset", default="FP8", choices=list(PRESETS))
    p.add_argument("--experts", type=int, default=64, choices=[s[0] for s in SHAPES])
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--top-k", type=int, default=8)
    p.add_argument("--rows", type=int, default=25, help="rows of each table")
    args = p.parse_args()
    shape = next(s for s in SHAPES if s[0] == args.experts)
    dtype = torch.bfloat16 if args.device == "cuda" else torch.float32
    x = torch.randn(1, args.tokens, shape[1], generator=torch.Generator().manual_seed(1)).to(args.device, dtype)
    base = build_layer(*shape, args.top_k, "grouped_mm" if args.device == "cuda" else "eager", dtype, args.device)
    quant = ql.quantize(build_layer(*shape, args.top_k, "eager", dtype, args.device), ql.PRESETS[PRESETS[args.preset][0]], lambda m: m(x))
    for name, layer in (("unquantized", base), (f"quantlib {args.preset}", quant)):
        for backward in (False, True):
            print(f"\n### {name}, {'forward + backward' if backward else 'forward'} (E={shape[0]} H={shape[1]} I={shape[2]}, "
                  f"{args.tokens} tokens, top-{args.top_k}, 3 steps)\n")
            print(table(layer, x, backward, args.device, args.rows))


if __name__ == "__main__":
    main()
